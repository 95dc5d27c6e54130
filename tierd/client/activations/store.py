"""Saved activations in the job's pool: records sub-allocated in chunks.

[Note: activation chunks]
One request per saved tensor would cost ~100 µs each (DESIGN: batch per
block, never per tensor). The store instead reserves fixed-size *chunks* (one
pool slot each, ``chunk_bytes``) and sub-allocates every offloaded storage
span (a *record*) into the open chunk at an aligned offset. A full chunk is
*sealed*; once every copy into it has completed (its events) it is
published, after which the daemon may spill it to NVMe when the pool is
short. In backward, chunks are leased for reading in the reverse order of
their creation, ahead of use, and each record is copied back on the copy
stream. A chunk's read lease is released only after the events of the copies
that read it, and its key is deleted once no saved-tensor handle refers to
any of its records.

[Note: records, dedupe and views]
A record is a byte span of one tensor *storage*. Tensors saved twice, and
views of one another (``q, k, v = qkv.split(...)``, ``w.t()``), share a record
while the first saved tensor of that storage is alive (a weak reference tells
so: the storage address alone may be reused once freed). A view covering at
least half of its storage records the whole storage, so sibling views reuse
it; a small view records only its span. Unpacking rebuilds each view with
``as_strided`` on one restored buffer, so views stay views of one storage.

[Note: handle lifetime]
Autograd drops the object returned by the pack hook when it frees the saved
variable (after the node ran, or when the graph is dropped). Its ``__del__``
only appends the record to a deque (safe from any thread or the GC); the
store counts it down at its next call (each save/load, the end of backward,
close), never from inside the garbage collector.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tierd import protocol as P
from tierd.client.copy_stream import CopyStream, InflightCopy
from tierd.errors import StateError

ALIGN = 512


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def span_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of ``t``'s storage that its elements touch."""
    es = t.element_size()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    start = t.storage_offset() * es
    return start, start + extent * es


class ChunkState(enum.Enum):
    """Where a chunk's bytes live and who may touch them.

    OPEN: a pool slot reserved by this client; copies of saved tensors are
        queued into it; the daemon will not move it.
    SEALED: no more records go in; copies into it may still be in flight;
        published once their events completed.
    STORED: published; the daemon owns it and may spill it to NVMe.
    LEASED: a read lease was asked for (prefetch) or granted; copies from it
        to the compute device may be in flight.
    DELETED: the key is gone from the daemon (or the reservation aborted).
    """

    OPEN = "open"
    SEALED = "sealed"
    STORED = "stored"
    LEASED = "leased"
    DELETED = "deleted"


@dataclass(eq=False)
class Chunk:
    key: str
    nbytes: int
    state: ChunkState
    view: torch.Tensor | None = None      # pool bytes while OPEN/SEALED or granted
    used: int = 0
    records: set = field(default_factory=set)          # live records
    copies: list[InflightCopy] = field(default_factory=list)  # may touch the slot
    lease: "_Grant | None" = None          # read lease asked for
    waiting: set = field(default_factory=set)  # live records not restored under the lease

    def expect(self, *states: ChunkState) -> None:
        if self.state not in states:
            raise StateError(f"activation chunk {self.key} is {self.state.value}, "
                             f"expected {[s.value for s in states]}")

    def copies_done(self) -> bool:
        self.copies = [c for c in self.copies if not c.done()]
        return not self.copies


class _Grant:
    """One ``lease_async`` reply, read once and shared by the chunks it names."""

    def __init__(self, pending) -> None:
        self._pending, self._views, self._error = pending, None, None

    def _read(self) -> None:
        if self._views is None and self._error is None:
            try:
                self._views = {lease.key: lease.tensor for lease in self._pending.result()}
            except Exception as exc:   # re-raised to every chunk of the batch
                self._error = exc

    def view(self, key: str) -> torch.Tensor:
        self._read()
        if self._error is not None:
            raise self._error
        return self._views[key]

    def granted(self) -> bool:
        """Wait for the reply; True if the lease was granted (so must be released)."""
        self._read()
        return self._error is None


@dataclass(eq=False)
class Record:
    """A byte span of one storage, stored at ``offset`` in ``chunk``."""

    seq: int
    forward: int          # the root forward that saved it
    chunk: Chunk
    offset: int
    nbytes: int
    device: torch.device
    handles: int = 0
    alive: bool = True
    ahead: torch.Tensor | None = None      # restored ahead of use, held until used
    restored: weakref.ref | None = None    # a tensor last unpacked from it, while alive
    copy_in: InflightCopy | None = None
    used_in: int = -1      # the last backward that unpacked it


class SavedActivation:
    """What autograd keeps instead of an offloaded tensor (the pack result)."""

    __slots__ = ("record", "size", "stride", "offset", "dtype", "_dead")

    def __init__(self, record: Record, t: torch.Tensor, byte_offset: int, dead) -> None:
        record.handles += 1
        self.record, self._dead = record, dead
        self.size, self.stride = tuple(t.shape), tuple(t.stride())
        self.offset, self.dtype = byte_offset // t.element_size(), t.dtype

    def __del__(self) -> None:
        self._dead.append(self.record)   # see [Note: handle lifetime]


@dataclass
class StoreStats:
    d2h_bytes: int = 0        # bytes copied out to the pool
    h2d_bytes: int = 0        # bytes copied back
    records: int = 0          # records created
    deduped: int = 0          # saves served by an existing record
    chunks: int = 0           # chunks reserved
    requests: int = 0         # daemon requests
    copy_seconds: float = 0.0  # host time in copy calls (all of it on CPU)
    save_seconds: float = 0.0  # host time inside save(): copies, reserves, publishes
    #: Peak, over the unpacks of backward, of the bytes of restored buffers
    #: still referenced (by autograd, a view, or held ahead of use).
    restored_peak_bytes: int = 0


class ActivationStore:
    """Offloaded saved tensors of one model (see the Notes above).

    Example:
        >>> store = ActivationStore(client, CopyStream(torch.device("cpu")), "act/x")  # doctest: +SKIP
        >>> h = store.save(t); store.load(h).equal(t)                                 # doctest: +SKIP
        True
    """

    def __init__(self, client, copy: CopyStream, prefix: str, *,
                 chunk_bytes: int = 64 << 20, prefetch_bytes: int = 128 << 20) -> None:
        self.client, self.copy, self.prefix = client, copy, prefix
        self.chunk_bytes = align_up(chunk_bytes)
        self.prefetch_bytes = prefetch_bytes
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._dead: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._open: Chunk | None = None
        self._sealed: list[Chunk] = []
        self._chunks: dict[str, Chunk] = {}
        self._order: list[Record] = []
        self._by_storage: dict[int, list[tuple[weakref.ref, Record, int, int]]] = {}
        self._forward = 0
        self._backward = 0
        self._restored: list[tuple[StorageWeakRef, int]] = []   # buffers copied back

    # ------------------------------------------------------------- forward
    def begin_forward(self) -> int:
        """A root forward begins; its records can be dropped with :meth:`abandon`."""
        self._forward += 1
        return self._forward

    def save(self, t: torch.Tensor) -> SavedActivation:
        """Copy ``t``'s storage span out (or reuse a record of it); the pack hook."""
        t0 = time.perf_counter()
        try:
            return self._save(t)
        finally:
            self.stats.save_seconds += time.perf_counter() - t0

    def _save(self, t: torch.Tensor) -> SavedActivation:
        with self._lock:
            self.sweep()
            self._publish_ready(block=False)
            start, end = span_bytes(t)
            storage = t.untyped_storage()
            entries = self._by_storage.setdefault(storage._cdata, [])
            for ref, rec, r0, r1 in entries:
                if (ref() is not None and rec.alive and r0 <= start and end <= r1
                        and (start - r0) % t.element_size() == 0):
                    self.stats.deduped += 1
                    return SavedActivation(rec, t, start - r0, self._dead)
            if end - start < storage.nbytes() // 2:
                r0, r1 = start, end
            else:
                r0, r1 = 0, storage.nbytes()
            rec = self._new_record(storage, r0, r1 - r0, t.device)
            entries.append((weakref.ref(t), rec, r0, r1))
            return SavedActivation(rec, t, start - r0, self._dead)

    def _new_record(self, storage, start: int, nbytes: int, device) -> Record:
        chunk, offset = self._place(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))
        t0 = time.perf_counter()
        chunk.copies.append(self.copy.copy_out(chunk.view[offset:offset + nbytes], src,
                                               (chunk.key,)))
        chunk.copies_done()   # drop finished copies: they hold their source storage
        self.stats.copy_seconds += time.perf_counter() - t0
        rec = Record(len(self._order), self._forward, chunk, offset, nbytes, device)
        chunk.records.add(rec)
        self._order.append(rec)
        self.stats.records += 1
        self.stats.d2h_bytes += nbytes
        return rec

    def _place(self, nbytes: int) -> tuple[Chunk, int]:
        chunk = self._open
        if chunk is not None and chunk.used + nbytes <= chunk.nbytes:
            offset = chunk.used
            chunk.used = align_up(offset + nbytes)
            return chunk, offset
        if chunk is not None:
            self._seal(chunk)
        chunk = self._reserve(max(self.chunk_bytes, align_up(nbytes)))
        chunk.used = align_up(nbytes)
        if nbytes < self.chunk_bytes:
            self._open = chunk
        else:   # a tensor of a chunk or more gets a chunk of its own
            self._seal(chunk)
        return chunk, 0

    def _reserve(self, nbytes: int) -> Chunk:
        key = f"{self.prefix}/{next(self._ids)}"
        # The store client has no public reserve-without-copy call; Reserve +
        # Publish is the protocol's way to write a new key in place.
        spec = P.TensorSpec(key, "uint8", (nbytes,), nbytes)
        placed = self.client._submit(P.Reserve((spec,)), self.client._leased).result()
        self.stats.requests += 1
        self.stats.chunks += 1
        chunk = Chunk(key, nbytes, ChunkState.OPEN, view=placed[0].tensor)
        self._chunks[key] = chunk
        return chunk

    def _seal(self, chunk: Chunk) -> None:
        chunk.expect(ChunkState.OPEN)
        if self._open is chunk:
            self._open = None
        chunk.state = ChunkState.SEALED
        self._sealed.append(chunk)

    def _publish_ready(self, *, block: bool) -> None:
        """Publish sealed chunks whose copies in have all landed (all if ``block``)."""
        ready = []
        for chunk in self._sealed:
            if block:
                for c in chunk.copies:
                    c.synchronize()
                chunk.copies.clear()
            if chunk.copies_done():
                ready.append(chunk)
        if not ready:
            return
        self._sealed = [c for c in self._sealed if c not in ready]
        self.client._submit(P.Publish(tuple(c.key for c in ready))).result()
        self.stats.requests += 1
        for chunk in ready:
            chunk.state, chunk.view = ChunkState.STORED, None
        empty = [c for c in ready if not c.records]
        if empty:
            self._delete(empty)

    def flush(self) -> None:
        """Seal the open chunk and publish every sealed one (backward begins)."""
        with self._lock:
            if self._open is not None:
                self._seal(self._open)
            self._publish_ready(block=True)

    # ------------------------------------------------------------ backward
    def load(self, saved: SavedActivation) -> torch.Tensor:
        """The saved tensor again, on its device; the unpack hook."""
        with self._lock:
            rec = saved.record
            if not rec.alive:
                raise StateError("this saved activation was dropped (its forward raised or "
                                 "the activation handle was closed); run the forward again")
            if self._open is not None or self._sealed:
                self.flush()
            self.sweep()
            rec.used_in = self._backward
            buf = self._take(rec)
            out = torch.as_strided(buf.view(saved.dtype), saved.size, saved.stride,
                                   saved.offset)
            rec.restored = weakref.ref(out)
            if rec.handles > 1:   # another saved view of it may be unpacked later
                rec.ahead = buf
            self._restore_ahead(rec)
            self._release_ready()
            self.stats.restored_peak_bytes = max(self.stats.restored_peak_bytes,
                                                 self.restored_bytes())
        return out

    def restored_bytes(self) -> int:
        """Bytes of buffers copied back that something still references (a
        saved tensor being used, a view of it, a buffer held ahead of use)."""
        with self._lock:
            self._restored = [(ref, n) for ref, n in self._restored if not ref.expired()]
            return sum(n for _, n in self._restored)

    def _take(self, rec: Record) -> torch.Tensor:
        """The record's bytes on its device as a flat uint8 buffer (a multiple of 8 long)."""
        buf, rec.ahead = rec.ahead, None
        if buf is None:
            other = rec.restored() if rec.restored is not None else None
            if other is not None:   # a view of it is alive: share its storage
                st = other.untyped_storage()
                buf = torch.empty(0, dtype=torch.uint8, device=other.device).set_(
                    st, 0, (st.nbytes(),), (1,))
        if buf is None:
            buf = self._restore(rec)
        if rec.copy_in is not None:
            self.copy.wait(rec.copy_in)
            rec.copy_in = None
        return buf

    def _restore(self, rec: Record) -> torch.Tensor:
        chunk = rec.chunk
        self._lease([chunk])
        if chunk.view is None:
            chunk.view = chunk.lease.view(chunk.key)
        like = torch.empty(((rec.nbytes + 7) // 8 * 8,), dtype=torch.uint8, device="meta")
        buf = self.copy.empty_for_copy_in(like)
        st = buf.untyped_storage()
        self._restored.append((StorageWeakRef(st), st.nbytes()))
        t0 = time.perf_counter()
        rec.copy_in = self.copy.copy_in_many(
            [(buf[:rec.nbytes], chunk.view[rec.offset:rec.offset + rec.nbytes])], (chunk.key,))
        self.stats.copy_seconds += time.perf_counter() - t0
        self.stats.h2d_bytes += rec.nbytes
        chunk.copies.append(rec.copy_in)
        chunk.copies_done()   # finished copies would keep their device buffers alive
        chunk.waiting.discard(rec)
        return buf

    def _lease(self, chunks: list[Chunk]) -> None:
        """Ask for read leases on the stored ones among ``chunks`` (one request)."""
        todo = [c for c in chunks if c.state is ChunkState.STORED]
        if not todo:
            return
        pending = _Grant(self.client.lease_async([c.key for c in todo]))
        self.stats.requests += 1
        for chunk in todo:
            chunk.state, chunk.lease = ChunkState.LEASED, pending
            chunk.waiting = set(chunk.records)

    def _restore_ahead(self, rec: Record) -> None:
        """Start copies of the records saved just before ``rec`` (backward runs
        roughly in reverse), up to ``prefetch_bytes``; lease their chunks."""
        budget = self.prefetch_bytes
        to_lease: list[Chunk] = []
        for j in range(rec.seq - 1, -1, -1):
            if budget <= 0:
                break
            other = self._order[j]
            if not other.alive:
                continue
            budget -= other.nbytes
            if other.chunk not in to_lease:
                to_lease.append(other.chunk)
        self._lease(to_lease)
        # Copies to the device: half of it. Records already restored ahead (or
        # whose copy is in flight) count against it: the window slides with
        # backward instead of growing by the budget at every unpack.
        budget = self.prefetch_bytes // 2
        for j in range(rec.seq - 1, -1, -1):
            other = self._order[j]
            if budget <= 0:
                break
            if not other.alive or other.used_in == self._backward or (
                    other.restored is not None and other.restored() is not None):
                continue
            budget -= other.nbytes
            if other.ahead is None and other.copy_in is None:
                other.ahead = self._restore(other)

    def _release_ready(self, *, block: bool = False) -> None:
        """Release read leases no live record still waits for, after their copies."""
        done = []
        for chunk in self._chunks.values():
            if chunk.state is not ChunkState.LEASED or (chunk.waiting and not block):
                continue
            if block:
                for c in chunk.copies:
                    c.synchronize()
                chunk.copies.clear()
            if chunk.copies_done():
                done.append(chunk)
        granted = []
        for chunk in done:
            if chunk.lease.granted():   # waits for the reply: never release early
                granted.append(chunk.key)
            chunk.state, chunk.view, chunk.lease = ChunkState.STORED, None, None
        if granted:
            self.client.release(granted)
            self.stats.requests += 1
        empty = [c for c in done if not c.records]
        if empty:
            self._delete(empty)

    def end_backward(self) -> None:
        """The outermost backward ended: drop prefetched buffers, release every
        read lease, delete chunks no saved tensor refers to."""
        with self._lock:
            self._backward += 1
            for rec in self._order:
                rec.ahead = None
            self._release_ready(block=True)
            self.sweep()
            self.restored_bytes()   # drops the weak references of freed buffers

    # ------------------------------------------------------------ lifetime
    def sweep(self) -> None:
        """Count down handles autograd dropped; delete chunks left empty."""
        with self._lock:
            emptied: list[Chunk] = []
            while self._dead:
                rec = self._dead.popleft()
                rec.handles -= 1
                if rec.handles == 0 and rec.alive:
                    self._forget(rec, emptied)
            self._drop_empty(emptied)

    def _forget(self, rec: Record, emptied: list[Chunk]) -> None:
        rec.alive, rec.ahead = False, None
        chunk = rec.chunk
        chunk.records.discard(rec)
        chunk.waiting.discard(rec)
        if not chunk.records:
            emptied.append(chunk)

    def _drop_empty(self, emptied: list[Chunk]) -> None:
        stored = [c for c in emptied if c.state is ChunkState.STORED and not c.records]
        if stored:
            self._delete(stored)
        for chunk in emptied:
            if chunk.state is ChunkState.LEASED and not chunk.records:
                chunk.waiting.clear()   # released (then deleted) after its copies
        if self._order and not any(c.records for c in self._chunks.values()):
            self._order.clear()
            self._by_storage.clear()

    def _delete(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            chunk.expect(ChunkState.STORED)
            chunk.state = ChunkState.DELETED
            del self._chunks[chunk.key]
        self.client.delete([c.key for c in chunks])
        self.stats.requests += 1

    def abandon(self, forward: int | None = None) -> None:
        """Drop the records of root forward ``forward`` (it raised), or all of
        them: loading them raises; their chunks go once empty."""
        with self._lock:
            emptied: list[Chunk] = []
            for rec in self._order:
                if rec.alive and (forward is None or rec.forward == forward):
                    self._forget(rec, emptied)
            if self._open is not None and not self._open.records:
                self._abort_open()
            self._publish_ready(block=True)
            self._drop_empty(emptied)

    def _abort_open(self) -> None:
        chunk = self._open
        for c in chunk.copies:
            c.synchronize()
        self.client._submit(P.Abort((chunk.key,))).result()
        self.stats.requests += 1
        chunk.state, chunk.view, self._open = ChunkState.DELETED, None, None
        del self._chunks[chunk.key]

    def live_chunks(self) -> int:
        return len(self._chunks)

    def close(self) -> None:
        """Drop every record and give all pool space back (idempotent)."""
        with self._lock:
            self.abandon()
            self._release_ready(block=True)
            self.sweep()
            left = [c for c in self._chunks.values() if c.state is ChunkState.STORED]
            for chunk in left:
                chunk.records.clear()
            if left:
                self._delete(left)
