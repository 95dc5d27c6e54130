"""Saved activations in the job's pool: records sub-allocated in chunks.

Chunks, their lifecycle and the store requests about them are in
:mod:`.chunks` ([Note: activation chunks]); this module keeps the *records*
(what autograd's saved-tensor handles point at) and the copies in and out.

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
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from tierd.client.activations.chunks import Chunk, ChunkSet, StoreStats
from tierd.client.copy_stream import CopyStream, InflightCopy
from tierd.client.store import Store
from tierd.client.torch_internals import StorageRef, storage_id
from tierd.errors import StateError


def span_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of ``t``'s storage that its elements touch."""
    es = t.element_size()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    start = t.storage_offset() * es
    return start, start + extent * es


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


class ActivationStore:
    """Offloaded saved tensors of one model (see the Notes above).

    Example:
        >>> from tierd.client.store import LocalStore
        >>> store = ActivationStore(LocalStore(), CopyStream(torch.device("cpu")), "act/x")
        >>> t = torch.arange(4.0); h = store.save(t); store.load(h).equal(t)
        True
        >>> store.close()
    """

    def __init__(self, client: Store, copy: CopyStream, prefix: str, *,
                 chunk_bytes: int = 64 << 20, prefetch_bytes: int = 128 << 20) -> None:
        self.client, self.copy, self.prefix = client, copy, prefix
        self.prefetch_bytes = prefetch_bytes
        self.stats = StoreStats()
        self.chunks = ChunkSet(client, prefix, chunk_bytes, self.stats)
        self._lock = threading.RLock()
        self._dead: collections.deque = collections.deque()
        self._order: list[Record] = []
        self._by_storage: dict[int, list[tuple[weakref.ref, Record, int, int]]] = {}
        self._forward = 0
        self._backward = 0
        self._restored: list[tuple[StorageRef, int]] = []   # buffers copied back

    @property
    def chunk_bytes(self) -> int:
        return self.chunks.chunk_bytes

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
            self.chunks.publish_ready(block=False)
            start, end = span_bytes(t)
            storage = t.untyped_storage()
            entries = self._by_storage.setdefault(storage_id(t), [])
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
        chunk, offset = self.chunks.place(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))
        t0 = time.perf_counter()
        chunk.copies.append(self.copy.copy_out(
            chunk.pool_view()[offset:offset + nbytes], src, (chunk.key,)))
        chunk.copies_done()   # drop finished copies: they hold their source storage
        self.stats.copy_seconds += time.perf_counter() - t0
        rec = Record(len(self._order), self._forward, chunk, offset, nbytes, device)
        chunk.records.add(rec)
        self._order.append(rec)
        self.stats.records += 1
        self.stats.d2h_bytes += nbytes
        return rec

    def flush(self) -> None:
        """Seal the open chunk and publish every sealed one (backward begins)."""
        with self._lock:
            self.chunks.flush()

    # ------------------------------------------------------------ backward
    def load(self, saved: SavedActivation) -> torch.Tensor:
        """The saved tensor again, on its device; the unpack hook."""
        with self._lock:
            rec = saved.record
            if not rec.alive:
                raise StateError("this saved activation was dropped (its forward raised or "
                                 "the activation handle was closed); run the forward again")
            if self.chunks.unpublished():
                self.chunks.flush()
            self.sweep()
            rec.used_in = self._backward
            buf = self._take(rec)
            out = torch.as_strided(buf.view(saved.dtype), saved.size, saved.stride,
                                   saved.offset)
            rec.restored = weakref.ref(out)
            if rec.handles > 1:   # another saved view of it may be unpacked later
                rec.ahead = buf
            self._restore_ahead(rec)
            self.chunks.release_ready()
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
        self.chunks.lease([chunk])
        view = chunk.pool_view()
        like = torch.empty(((rec.nbytes + 7) // 8 * 8,), dtype=torch.uint8, device="meta")
        buf = self.copy.empty_for_copy_in(like)
        st = buf.untyped_storage()
        self._restored.append((StorageRef(st), st.nbytes()))
        t0 = time.perf_counter()
        rec.copy_in = self.copy.copy_in_many(
            [(buf[:rec.nbytes], view[rec.offset:rec.offset + rec.nbytes])], (chunk.key,))
        self.stats.copy_seconds += time.perf_counter() - t0
        self.stats.h2d_bytes += rec.nbytes
        chunk.copies.append(rec.copy_in)
        chunk.copies_done()   # finished copies would keep their device buffers alive
        chunk.waiting.discard(rec)
        return buf

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
        self.chunks.lease(to_lease)
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

    def end_backward(self) -> None:
        """The outermost backward ended: drop prefetched buffers, release every
        read lease, delete chunks no saved tensor refers to."""
        with self._lock:
            self._backward += 1
            self.chunks.release_ready(block=True)   # every copy in has landed after it
            for rec in self._order:
                # a copy in started ahead holds its buffer too (not only ``ahead``)
                rec.ahead, rec.copy_in = None, None
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
        self.chunks.drop_empty(emptied)
        if self._order and not self.chunks.any_records():
            self._order.clear()
            self._by_storage.clear()

    def abandon(self, forward: int | None = None) -> None:
        """Drop the records of root forward ``forward`` (it raised), or all of
        them: loading them raises; their chunks go once empty."""
        with self._lock:
            emptied: list[Chunk] = []
            for rec in self._order:
                if rec.alive and (forward is None or rec.forward == forward):
                    self._forget(rec, emptied)
            self.chunks.abort_open_if_empty()
            self.chunks.publish_ready(block=True)
            self._drop_empty(emptied)

    def live_chunks(self) -> int:
        return len(self.chunks)

    def close(self) -> None:
        """Drop every record and give all pool space back (idempotent)."""
        with self._lock:
            self.abandon()
            self.chunks.release_ready(block=True)
            self.sweep()
            self.chunks.delete_stored()
