"""Pool chunks of saved activations: their lifecycle and every request about them.

[Note: activation chunks]
One request per saved tensor would cost a daemon round trip each, many per
block. The store instead reserves fixed-size *chunks* (one
pool slot each, ``chunk_bytes``) and sub-allocates every offloaded storage
span (a *record*) into the open chunk at an aligned offset. A full chunk is
*sealed*; once every copy into it has completed (its events) it is
published, after which the daemon may spill it to NVMe when the pool is
short. In backward, chunks are leased for reading in the reverse order of
their creation, ahead of use, and each record is copied back on the copy
stream. A chunk's read lease is released only after the events of the copies
that read it, and its key is deleted once no saved-tensor handle refers to
any of its records.

Only the public store protocol (:class:`tierd.client.store.Store`) is used:
``reserve_async`` + ``publish_async`` write a new key in place, ``abort``
gives an unpublished one back, ``lease_async``/``release`` read it,
``delete`` drops it.
"""

from __future__ import annotations

import enum
import itertools
import logging
from dataclasses import dataclass, field

import torch

from tierd.client.copy_stream import InflightCopy
from tierd.client.leases import LeaseBatch
from tierd.client.store import Store
from tierd.errors import CapacityError, StateError, TierdError, UnknownKey

log = logging.getLogger("tierd.activations")

ALIGN = 512


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class StoreStats:
    d2h_bytes: int = 0        # bytes copied out to the pool
    h2d_bytes: int = 0        # bytes copied back
    records: int = 0          # records created
    deduped: int = 0          # saves served by an existing record
    chunks: int = 0           # chunks reserved
    requests: int = 0         # store requests
    copy_seconds: float = 0.0  # host time in copy calls (all of it on CPU)
    save_seconds: float = 0.0  # host time inside save(): copies, reserves, publishes
    #: Peak, over the unpacks of backward, of the bytes of restored buffers
    #: still referenced (by autograd, a view, or held ahead of use).
    restored_peak_bytes: int = 0


class ChunkState(enum.Enum):
    """Where a chunk's bytes live and who may touch them.

    OPEN: a pool slot reserved by this client; copies of saved tensors are
        queued into it; the daemon will not move it.
    SEALED: no more records go in; copies into it may still be in flight;
        published once their events completed.
    STORED: published; the daemon owns it and may spill it to NVMe.
    LEASED: a read lease was asked for (prefetch) or granted; copies from it
        to the compute device may be in flight.
    DELETED: the key is gone from the store (or the reservation aborted).

    OPEN -seal-> SEALED -published-> STORED -leased-> LEASED -released-> STORED
    -deleted-> DELETED; an OPEN chunk left empty is aborted (-> DELETED).
    """

    OPEN = "open"
    SEALED = "sealed"
    STORED = "stored"
    LEASED = "leased"
    DELETED = "deleted"


@dataclass(eq=False)
class Chunk:
    """One pool slot of records; its state changes only through the methods below."""

    key: str
    nbytes: int
    view: torch.Tensor | None = None      # pool bytes while OPEN/SEALED or granted
    state: ChunkState = ChunkState.OPEN
    used: int = 0
    records: set = field(default_factory=set)          # live records
    copies: list[InflightCopy] = field(default_factory=list)  # may touch the slot
    lease: LeaseBatch | None = None        # read lease asked for
    waiting: set = field(default_factory=set)  # live records not restored under the lease

    # ------------------------------------------------------------ transitions
    def _expect(self, transition: str, *states: ChunkState) -> None:
        if self.state not in states:
            raise StateError(f"activation chunk {self.key} is {self.state.value}: it cannot "
                             f"be {transition} (only when "
                             f"{' or '.join(s.value for s in states)})")

    def seal(self) -> None:
        """No more records go in."""
        self._expect("sealed", ChunkState.OPEN)
        self.state = ChunkState.SEALED

    def published(self) -> None:
        """The store took the bytes: the reserved view is no longer ours."""
        self._expect("published", ChunkState.SEALED)
        self.state, self.view = ChunkState.STORED, None

    def leased(self, batch: LeaseBatch) -> None:
        """A read lease was asked for in ``batch``; every live record waits for it."""
        self._expect("leased", ChunkState.STORED)
        self.state, self.lease, self.waiting = ChunkState.LEASED, batch, set(self.records)

    def released(self) -> None:
        """The read lease is given back (or was never granted)."""
        self._expect("released", ChunkState.LEASED)
        self.state, self.view, self.lease = ChunkState.STORED, None, None

    def deleted(self) -> None:
        self._expect("deleted", ChunkState.STORED)
        self.state = ChunkState.DELETED

    def aborted(self) -> None:
        """The reservation was given back unpublished."""
        self._expect("aborted", ChunkState.OPEN)
        self.state, self.view = ChunkState.DELETED, None

    # ------------------------------------------------------------ queries
    def pool_view(self) -> torch.Tensor:
        """The chunk's pool bytes; while LEASED waits for the grant."""
        self._expect("read", ChunkState.OPEN, ChunkState.SEALED, ChunkState.LEASED)
        if self.view is None:
            views = self.lease.views()
            if views is None:
                raise CapacityError(f"the pool has no room to bring activation chunk "
                                    f"{self.key} ({self.nbytes} bytes) back; give the daemon "
                                    "a larger pool or lower chunk_bytes/prefetch_bytes")
            self.view = views[self.key]
        return self.view

    def lease_granted(self) -> bool:
        """Wait for the lease's reply; True if granted (so it must be released)."""
        try:
            return self.lease.views() is not None
        except TierdError:   # the error reached load() already; nothing to release
            return False

    def copies_done(self) -> bool:
        """Drop finished copies (they hold their buffers); True if none is left."""
        self.copies = [c for c in self.copies if not c.done()]
        return not self.copies

    def wait_copies(self) -> None:
        for c in self.copies:
            c.synchronize()
        self.copies.clear()


class ChunkSet:
    """The chunks of one activation store and every store request about them.

    Example:
        >>> from tierd.client.store import LocalStore
        >>> chunks = ChunkSet(LocalStore(), "act/x", 1024, StoreStats())
        >>> chunk, offset = chunks.place(100); chunk.key, offset
        ('act/x/0', 0)
    """

    def __init__(self, store: Store, prefix: str, chunk_bytes: int, stats: StoreStats) -> None:
        self.store, self.prefix, self.stats = store, prefix, stats
        self.chunk_bytes = align_up(chunk_bytes)
        self._ids = itertools.count()
        self._open: Chunk | None = None
        self._sealed: list[Chunk] = []
        self._chunks: dict[str, Chunk] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def unpublished(self) -> bool:
        """True while a chunk is open or sealed (backward must flush first)."""
        return self._open is not None or bool(self._sealed)

    def any_records(self) -> bool:
        return any(c.records for c in self._chunks.values())

    # ------------------------------------------------------------- forward
    def place(self, nbytes: int) -> tuple[Chunk, int]:
        """Room for ``nbytes`` in the open chunk, or in a new one."""
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
        like = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        try:
            placed = self.store.reserve_async({key: like}).result()
        except CapacityError as exc:
            raise CapacityError(f"no room for activation chunk {key} ({nbytes} bytes): {exc}; "
                                "give the daemon a larger pool or NVMe tier, or tier "
                                "activations with policy='recompute'") from exc
        finally:
            self.stats.requests += 1
        self.stats.chunks += 1
        chunk = Chunk(key, nbytes, view=placed[0].tensor)
        self._chunks[key] = chunk
        return chunk

    def _seal(self, chunk: Chunk) -> None:
        chunk.seal()
        if self._open is chunk:
            self._open = None
        self._sealed.append(chunk)

    def publish_ready(self, *, block: bool) -> None:
        """Publish sealed chunks whose copies in have all landed (all if ``block``)."""
        ready = []
        for chunk in self._sealed:
            if block:
                chunk.wait_copies()
            if chunk.copies_done():
                ready.append(chunk)
        if not ready:
            return
        self._sealed = [c for c in self._sealed if c not in ready]
        self.store.publish_async([c.key for c in ready]).result()
        self.stats.requests += 1
        for chunk in ready:
            chunk.published()
        self.delete([c for c in ready if not c.records])

    def flush(self) -> None:
        """Seal the open chunk and publish every sealed one (backward begins)."""
        if self._open is not None:
            self._seal(self._open)
        self.publish_ready(block=True)

    # ------------------------------------------------------------ backward
    def lease(self, chunks: list[Chunk]) -> None:
        """Ask for read leases on the stored ones among ``chunks`` (one request)."""
        todo = [c for c in chunks if c.state is ChunkState.STORED]
        if not todo:
            return
        batch = LeaseBatch(self.store.lease_async([c.key for c in todo]))
        self.stats.requests += 1
        for chunk in todo:
            chunk.leased(batch)

    def release_ready(self, *, block: bool = False) -> None:
        """Release read leases no live record still waits for, after their copies."""
        done = []
        for chunk in self._chunks.values():
            if chunk.state is not ChunkState.LEASED or (chunk.waiting and not block):
                continue
            if block:
                chunk.wait_copies()
            if chunk.copies_done():
                done.append(chunk)
        granted = [c.key for c in done if c.lease_granted()]   # never release early
        for chunk in done:
            chunk.released()
        if granted:
            self.store.release(granted)
            self.stats.requests += 1
        self.delete([c for c in done if not c.records])

    # ------------------------------------------------------------ lifetime
    def drop_empty(self, emptied: list[Chunk]) -> None:
        """Chunks whose last record went: delete the stored ones now; leased
        ones are released (then deleted) once their copies are done."""
        self.delete([c for c in emptied if c.state is ChunkState.STORED and not c.records])
        for chunk in emptied:
            if chunk.state is ChunkState.LEASED and not chunk.records:
                chunk.waiting.clear()

    def delete(self, chunks: list[Chunk]) -> None:
        if not chunks:
            return
        for chunk in chunks:
            chunk.deleted()
            del self._chunks[chunk.key]
        keys = [c.key for c in chunks]
        try:
            self.store.delete(keys)
        except UnknownKey:
            # Deleted behind the store (a load has raised for them already).
            # The daemon deletes all of a request's keys or none: delete the rest.
            left = set(self.store.keys(self.prefix + "/"))
            log.warning("activation chunks %s were deleted by another caller",
                        [k for k in keys if k not in left][:5])
            self.store.delete([k for k in keys if k in left])
        self.stats.requests += 1

    def abort_open_if_empty(self) -> None:
        """Give back the open chunk's reservation if no record is left in it."""
        chunk = self._open
        if chunk is None or chunk.records:
            return
        chunk.wait_copies()
        self.store.abort([chunk.key])
        self.stats.requests += 1
        chunk.aborted()
        self._open = None
        del self._chunks[chunk.key]

    def delete_stored(self) -> None:
        """Delete every stored chunk, records or not (the store closes)."""
        left = [c for c in self._chunks.values() if c.state is ChunkState.STORED]
        for chunk in left:
            chunk.records.clear()
        self.delete(left)
