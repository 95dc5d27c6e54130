"""Pool slots and NVMe extents: the two places a key's bytes can be, each with
one lifecycle enum changed only by the transition methods below.

[Note: pins]
A pool slot or NVMe extent is never freed or overwritten while
something may read it. Every lease and every in-flight transfer that reads a
slot or extent is counted in its ``readers``; a slot being written (a client
before publish, a write lease, a swap-in) has one writer and no readers.
Deleting or replacing a key only *retires* its old slot or extent; the bytes go
back to the allocator when the last reader or writer has gone. An NVMe extent
named by a commit also carries a hold (see [Note: commits] in
:mod:`tierd.server.commits`) and is freed only once no commit names it.

A transition begins by checking the states it accepts and raises StateError
naming the key and the state otherwise. One that ends in ``FREED`` returns
True: the caller (the catalog's :class:`~tierd.server.tiers.Tiers`) then gives
the bytes back to the pool or the NVMe allocator, which the records here do
not know.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tierd.backends.extents import Spans
from tierd.backends.hostpool import Segment
from tierd.backends.recordio import spans_len
from tierd.errors import StateError


class SlotState(enum.Enum):
    """Where a pool slot's bytes are in their life (``readers``: see each)."""

    RESERVED = "reserved"          # a client fills it before publishing; no entry, no readers
    FILLING = "filling"            # an NVMe -> pool read lands in it; nobody may read it yet
    READY = "ready"                # an entry's bytes; ``readers`` leases and write-backs read it
    WRITE_LEASED = "write_leased"  # one client changes the entry's bytes in place; no readers
    RETIRED = "retired"            # no entry names it; freed when ``readers`` (any holder) is 0
    FREED = "freed"                # back in the pool's allocator


_WRITING = (SlotState.RESERVED, SlotState.FILLING, SlotState.WRITE_LEASED)


@dataclass(eq=False)
class PoolSlot:
    """A slot of a pool segment holding one version of ``key``.

    Born RESERVED (for a client's reserve) or FILLING (for a swap-in)::

        RESERVED --published--> READY <--end_write-- WRITE_LEASED
        FILLING ---filled-----> READY ---lease_write--^
        RESERVED | FILLING --abandon--> FREED
        READY | WRITE_LEASED | FILLING --retire--> RETIRED (or FREED when idle)
        RETIRED --last holder gone--> FREED
    """

    segment: Segment
    offset: int
    nbytes: int
    key: str
    state: SlotState = SlotState.RESERVED
    readers: int = 0   # READY: leases and write-backs reading it; RETIRED: every holder

    def __post_init__(self) -> None:
        if self.state not in (SlotState.RESERVED, SlotState.FILLING):
            raise StateError(f"{self.key}: a new pool slot is RESERVED or FILLING, "
                             f"not {self.state.name}")

    @property
    def job(self) -> str:
        return self.segment.job

    @property
    def idle(self) -> bool:
        """READY with nobody reading: it may be evicted or write-leased."""
        return self.state is SlotState.READY and not self.readers

    @property
    def leased(self) -> bool:
        """Someone reads or writes the entry's bytes (a lease or a write-back)."""
        return self.state is SlotState.WRITE_LEASED or (
            self.state is SlotState.READY and self.readers > 0)

    def _expect(self, *states: SlotState) -> None:
        if self.state not in states:
            raise StateError(f"{self.key}: pool slot is {self.state.name}, expected "
                             f"{' or '.join(s.name for s in states)}")

    def published(self) -> None:
        self._expect(SlotState.RESERVED)
        self.state = SlotState.READY

    def filled(self) -> bool:
        """A swap-in into it has landed; True when a retired slot is now free."""
        self._expect(SlotState.FILLING, SlotState.RETIRED)
        if self.state is SlotState.RETIRED:
            return self._drop_holder()
        self.state = SlotState.READY
        return False

    def add_reader(self) -> None:
        self._expect(SlotState.READY)
        self.readers += 1

    def end_read(self) -> bool:
        """A lease or write-back reading it is done; True when now free."""
        self._expect(SlotState.READY, SlotState.RETIRED)
        if self.readers <= 0:
            raise StateError(f"{self.key}: pool slot has no reader to release")
        if self.state is SlotState.RETIRED:
            return self._drop_holder()
        self.readers -= 1
        return False

    def lease_write(self) -> None:
        self._expect(SlotState.READY)
        if self.readers:
            raise StateError(f"{self.key}: leased for reading by another holder; a write "
                             f"lease needs the tensor to itself")
        self.state = SlotState.WRITE_LEASED

    def end_write(self) -> bool:
        """A write lease is released; True when a retired slot is now free."""
        self._expect(SlotState.WRITE_LEASED, SlotState.RETIRED)
        if self.state is SlotState.RETIRED:
            return self._drop_holder()
        self.state = SlotState.READY
        return False

    def abandon(self) -> bool:
        """Bytes that never became an entry's (an aborted reserve, a failed
        swap-in): nobody else holds it, so it is free at once."""
        self._expect(SlotState.RESERVED, SlotState.FILLING)
        self.state = SlotState.FREED
        return True

    def retire(self) -> bool:
        """No entry names it any more; True when free at once (nobody held it)."""
        self._expect(SlotState.READY, SlotState.WRITE_LEASED, SlotState.FILLING)
        holders = self.readers if self.state is SlotState.READY else 1
        self.readers = holders
        self.state = SlotState.RETIRED if holders else SlotState.FREED
        return not holders

    def _drop_holder(self) -> bool:
        self.readers -= 1
        if self.readers:
            return False
        self.state = SlotState.FREED
        return True


class ExtentState(enum.Enum):
    """Where an NVMe extent's record is in its life."""

    WRITING = "writing"    # a write-back writes the record; nothing names it yet
    CURRENT = "current"    # an entry's clean copy; swap-ins read it, commits may hold it
    HELD = "held"          # no entry names it, a commit does: kept, counted against admission
    DRAINING = "draining"  # nothing names it; freed when the last swap-in reading it ends
    FREED = "freed"        # back in the NVMe allocator


@dataclass(eq=False)
class DiskExtent:
    """The extents of the NVMe file holding one record of ``key`` (its
    ``spans``, in order: see [Note: records in several extents] in
    :mod:`tierd.backends.recordio`)::

        WRITING --written--> CURRENT --retire--> HELD | DRAINING | FREED
        WRITING --abandon--> FREED
        HELD --unhold (last)--> DRAINING | FREED;  DRAINING --end_read (last)--> FREED
    """

    spans: Spans
    job: str
    key: str
    state: ExtentState = ExtentState.WRITING
    readers: int = 0   # in-flight swap-ins reading it
    holds: int = 0     # commits naming it (the last one and one being made)

    @property
    def offset(self) -> int:
        """Where the record starts (its header): what messages name."""
        return self.spans[0][0]

    @property
    def nbytes(self) -> int:
        """Bytes of the file it takes, all spans together."""
        return spans_len(self.spans)

    def __post_init__(self) -> None:
        if not self.spans:
            raise StateError(f"{self.key}: an NVMe record needs at least one extent")
        if self.state not in (ExtentState.WRITING, ExtentState.CURRENT):
            raise StateError(f"{self.key}: a new NVMe extent is WRITING or CURRENT (recovered "
                             f"from a commit), not {self.state.name}")

    def _expect(self, *states: ExtentState) -> None:
        if self.state not in states:
            raise StateError(f"{self.key}: NVMe extent at {self.offset} is {self.state.name}, "
                             f"expected {' or '.join(s.name for s in states)}")

    def written(self) -> None:
        self._expect(ExtentState.WRITING)
        self.state = ExtentState.CURRENT

    def abandon(self) -> bool:
        """The write-back failed or its tensor is gone: free at once."""
        self._expect(ExtentState.WRITING)
        self.state = ExtentState.FREED
        return True

    def add_reader(self) -> None:
        self._expect(ExtentState.CURRENT)
        self.readers += 1

    def end_read(self) -> bool:
        """A swap-in from it is done; True when now free."""
        self._expect(ExtentState.CURRENT, ExtentState.HELD, ExtentState.DRAINING)
        if self.readers <= 0:
            raise StateError(f"{self.key}: NVMe extent at {self.offset} has no reader")
        self.readers -= 1
        return self._settle()

    def hold(self) -> None:
        self._expect(ExtentState.CURRENT)
        self.holds += 1

    def unhold(self) -> bool:
        """A commit naming it is replaced or failed; True when now free."""
        self._expect(ExtentState.CURRENT, ExtentState.HELD)
        if self.holds <= 0:
            raise StateError(f"{self.key}: NVMe extent at {self.offset} has no hold")
        self.holds -= 1
        return self._settle()

    def retire(self) -> bool:
        """No entry names it any more (changed, deleted); True when free at once."""
        self._expect(ExtentState.CURRENT)
        self.state = ExtentState.HELD
        return self._settle()

    def _settle(self) -> bool:
        if self.state is ExtentState.HELD and not self.holds:
            self.state = ExtentState.DRAINING
        if self.state is ExtentState.DRAINING and not self.readers:
            self.state = ExtentState.FREED
            return True
        return False
