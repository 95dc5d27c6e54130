"""The catalog's bytes: which slot and extent each key uses, the transfers
between them, and the room eviction makes.

Plain code under :class:`~tierd.server.catalog.Catalog` (which handles
sessions and requests) and :mod:`tierd.server.commits`: both change slots,
extents and entries only through the methods here, and this module imports
neither. Slots and extents change state only through their own transitions
(see [Note: pins] in :mod:`tierd.server.slots`); a transition that frees
one returns True and the bytes go back to their allocator here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from tierd.backends.hostpool import HostPool
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError
from tierd.protocol import TensorSpec
from tierd.server import eviction
from tierd.server.admission import Admission
from tierd.server.readahead import JobPlans
from tierd.server.records import (Blocked, Direction, Entry, Job, Residency, TierCounters,
                                  Transfer, stored_size)
from tierd.server.slots import DiskExtent, ExtentState, PoolSlot, SlotState


class Tiers:
    """Entries of every job, their pool slots and NVMe extents, and the
    transfers begun between them (the daemon runs those and calls :meth:`finish`)."""

    def __init__(self, pool: HostPool, nvme: NvmeStore, admission: Admission) -> None:
        self.pool = pool
        self.nvme = nvme
        self.admission = admission
        self.jobs: dict[str, Job] = {}
        self.entries: dict[tuple[str, str], Entry] = {}
        self.plans: dict[str, JobPlans] = {}   # job -> [Note: the job's access plan]
        self.counters = TierCounters()
        self.clock = itertools.count(1)   # last_use ticks: leases, publishes, demotes
        self.now = 0                      # the last tick handed out
        self._started: list[Transfer] = []

    def tick(self) -> int:
        """The next tick of the clock that orders uses (see [Note: eviction by next use])."""
        self.now = next(self.clock)
        return self.now

    def demote(self, entries: list[Entry]) -> None:
        """Evict these before the job's other tensors, the last demoted first;
        a key demoted before measures its cycle ([Note: cold tensors go
        first] in :mod:`tierd.server.eviction`)."""
        tick = self.tick()
        for e in entries:
            if e.demoted_at:
                e.cycle = tick - e.demoted_at
            e.last_use, e.demoted_at = -tick, tick

    def take_started(self) -> list[Transfer]:
        started, self._started = self._started, []
        return started

    def job_entries(self, job: str) -> list[Entry]:
        return [e for (j, _), e in self.entries.items() if j == job]

    def holds_nothing(self, job: Job) -> bool:
        """No tensor, no commit and none being made: the job is only its name."""
        return job.manifest is None and not job.committing and not self.job_entries(job.name)

    # ------------------------------------------------- slots and extents
    def _free_slot(self, slot: PoolSlot) -> None:
        if slot.segment.id in self.pool.segments:   # a dropped job's segment is gone
            self.pool.free(slot.segment, slot.offset)

    def _change_extent(self, disk: DiskExtent, transition: Callable[[], bool]) -> None:
        """Run one of ``disk``'s transitions and account for where it went."""
        was_held = disk.state is ExtentState.HELD
        freed = transition()
        held = disk.state is ExtentState.HELD
        if held != was_held:
            self.admission.held_only_bytes += disk.nbytes if held else -disk.nbytes
        if freed:
            self.nvme.extents.free_spans(disk.spans)
            if disk.job in self.jobs:
                self.jobs[disk.job].nvme_used -= disk.nbytes

    def end_lease(self, slot: PoolSlot, write: bool) -> None:
        if slot.end_write() if write else slot.end_read():
            self._free_slot(slot)

    def abandon(self, slot: PoolSlot) -> None:
        """A RESERVED or FILLING slot whose bytes will never be an entry's."""
        if slot.abandon():
            self._free_slot(slot)

    def give_up_reserved(self, spec: TensorSpec, slot: PoolSlot) -> None:
        """An admitted, unpublished reserve is aborted or its client went away."""
        self.admission.remove(self.jobs.get(slot.job), stored_size(spec.key, slot.job,
                                                                    spec.nbytes))
        self.abandon(slot)

    def unhold(self, disk: DiskExtent) -> None:
        """A commit naming ``disk`` was replaced or failed."""
        self._change_extent(disk, disk.unhold)

    def drop_slot(self, e: Entry) -> None:
        """Let go of the entry's pool copy; its clean NVMe record stays."""
        slot = e.slot
        e.to_on_nvme()
        if slot.retire():
            self._free_slot(slot)

    def mark_dirty(self, e: Entry) -> None:
        """The pool bytes changed: the NVMe record (if any) is stale now."""
        e.dirty = True
        if e.disk is not None:
            self._change_extent(e.disk, e.disk.retire)
            e.disk = None

    def drop_entry(self, e: Entry) -> None:
        del self.entries[(e.job, e.key)]
        self.admission.remove(self.jobs.get(e.job), stored_size(e.key, e.job, e.spec.nbytes))
        if e.slot is not None and e.slot.retire():
            self._free_slot(e.slot)
        if e.disk is not None:
            self._change_extent(e.disk, e.disk.retire)

    # --------------------------------------------------------- transfers
    def start_swap_in(self, e: Entry, blocked: Blocked, protect: Iterable[Entry],
                      ahead_of: float | None = None) -> None:
        """Begin reading ``e`` into a new slot (or plan evictions into
        ``blocked``); ``ahead_of``: a read ahead whose horizon ends that many
        steps ahead, which evicts only what is used after it
        ([Note: the job's access plan] in tierd.server.readahead)."""
        slot = self.alloc_slot(e.job, e.key, e.spec.nbytes, blocked, protect, SlotState.FILLING,
                               ahead_of)
        if slot is None:
            return
        e.disk.add_reader()
        t = Transfer(Direction.TO_POOL, e, slot, e.disk)
        e.to_reading_in(t)
        self._started.append(t)
        blocked.wait.append(t)

    def start_writeback(self, e: Entry, drop_slot: bool = True,
                        reclaim: bool = True) -> Transfer:
        """Write the entry's pool bytes to a new NVMe record: never over the
        record of an older version, which a commit may still name. ``reclaim``:
        if the file is full, free the NVMe copies of tensors whose pool copy
        is current first (admission counts each tensor once)."""
        job = self.jobs[e.job]
        size = e.meta().record_len()
        if job.nvme_quota and job.nvme_used + size > job.nvme_quota:
            raise CapacityError(
                f"job {job.name!r} reached its NVMe quota ({job.nvme_used} of "
                f"{job.nvme_quota} B used), cannot write {e.key} ({size} B); "
                f"delete tensors or raise the job's quota in the config file")
        # Fails only on bytes, never on fragments (a record may span several extents).
        spans = self.nvme.extents.alloc_spans(size)
        if spans is None and reclaim and self._reclaim_nvme(size):
            spans = self.nvme.extents.alloc_spans(size)
        if spans is None:
            raise CapacityError(
                f"NVMe tier full: {self.nvme.extents.used} of {self.nvme.size} B used "
                f"({self.admission.held_only_bytes} B by older versions the last commits "
                f"name), cannot write {e.key} ({size} B); delete tensors, commit, or start "
                f"the daemon with a larger --nvme-size")
        disk = DiskExtent(spans, e.job, e.key)
        job.nvme_used += disk.nbytes
        t = Transfer(Direction.TO_NVME, e, e.slot, disk, drop_slot)
        e.to_writing_back(t)
        e.slot.add_reader()
        self.counters.evictions += drop_slot
        self._started.append(t)
        return t

    def finish(self, t: Transfer, error: Exception | None) -> None:
        """Account for a transfer the daemon has carried out (or failed)."""
        t.done, t.error = True, error
        live = self.entries.get((t.entry.job, t.entry.key)) is t.entry
        if error is not None:
            self.counters.io_errors += 1
        if t.direction is Direction.TO_NVME:
            self._finish_writeback(t, live, error)
        else:
            self._finish_swap_in(t, live, error)

    def _finish_writeback(self, t: Transfer, live: bool, error: Exception | None) -> None:
        e = t.entry
        if t.slot.end_read():
            self._free_slot(t.slot)
        if error is not None or not live:
            self._change_extent(t.disk, t.disk.abandon)
            if live:
                e.to_in_pool()   # still readable and dirty; a later write-back retries
            return
        t.disk.written()
        e.to_in_pool()
        self.counters.bytes_to_nvme += t.nbytes
        if e.disk is not None:
            self._change_extent(e.disk, e.disk.retire)
        e.disk, e.dirty = t.disk, False
        if t.drop_slot and e.slot.idle:
            self.drop_slot(e)

    def _finish_swap_in(self, t: Transfer, live: bool, error: Exception | None) -> None:
        e = t.entry
        self._change_extent(t.disk, t.disk.end_read)
        if not live:
            if t.slot.filled():    # retired when the entry went
                self._free_slot(t.slot)
            return
        if error is not None:
            self.abandon(t.slot)
            e.to_on_nvme()
            return
        t.slot.filled()
        self.counters.bytes_to_pool += t.nbytes
        e.dirty = False
        e.to_in_pool()

    # --------------------------------------------------------------- room
    def alloc_slot(self, job: str, key: str, nbytes: int, blocked: Blocked,
                   protect: Iterable[Entry], state: SlotState,
                   ahead_of: float | None = None) -> PoolSlot | None:
        """A new pool slot for ``job``, or None after planning evictions into
        ``blocked`` (``ahead_of``: see :meth:`start_swap_in`)."""
        while True:
            got = self.pool.allocate(job, nbytes, self.jobs[job].pool_quota)
            if got is not None:
                seg, off = got
                return PoolSlot(seg, off, seg.extents.extent_size(nbytes), key, state)
            if not self._plan_eviction(job, nbytes, blocked, protect, ahead_of):
                break
        if not blocked.wait:
            # Swap-ins a prefetch began hold room that is evictable once they
            # land: wait for them rather than refuse.
            blocked.wait.extend(e.transfer for e in self.job_entries(job)
                                if e.state is Residency.READING_IN)
        if blocked.wait:
            return None
        quota = self.jobs[job].pool_quota
        if quota and self.pool.job_used_bytes(job) + nbytes > quota:
            raise CapacityError(
                f"job {job!r} is at its pool quota ({self.pool.job_used_bytes(job)} of {quota} B "
                f"used) with nothing evictable for {nbytes} B more (all leased); release "
                f"leases or raise the job's pool quota")
        raise CapacityError(
            f"pool full: {self.pool.used_bytes} of {self.pool.budget} B in use and nothing "
            f"evictable for {nbytes} B more (leased or in this request); release leases, "
            f"lease smaller batches, or start the daemon with a larger --pool")

    def _victims(self, job: str, nbytes: int, protect: Iterable[Entry],
                 ahead_of: float | None = None) -> list[Entry]:
        """The job's pool entries that may leave, in eviction order (for a read
        ahead to ``ahead_of`` steps ahead, only those used after that).

        [Note: room for a large tensor]
        Freeing the least recently used tensors makes room for a small one,
        but a tensor near the segment size needs one contiguous hole, which
        scattered evictions rarely leave (a 235 MB fp32 matrix of an 8B model
        in 256 MiB segments); above the segment size it needs whole segments
        unmapped. So a tensor over an eighth of a segment empties segments
        first: those whose every slot is an idle entry (nothing leased,
        reserved or in transfer pins them), coldest first, each wholly; the
        other idle entries follow, least recently used first."""
        protected = {id(p) for p in protect}
        entries = self.job_entries(job)
        idle = [e for e in entries
                if e.state is Residency.IN_POOL and e.slot.idle and id(e) not in protected]
        now, cycle, plans = self.now, eviction.job_cycle(entries, self.now), self.plans.get(job)
        if ahead_of is not None:
            idle = [e for e in idle if eviction.used_after(e, ahead_of, now, cycle, plans)]
        if 8 * nbytes <= self.pool.segment_size:
            return eviction.by_next_use(idle, now, cycle, plans)
        by_segment: dict[int, list[Entry]] = {}
        for e in idle:
            by_segment.setdefault(e.slot.segment.id, []).append(e)
        clearable = {sid: es for sid, es in by_segment.items()
                     if sum(e.slot.nbytes for e in es) == self.pool.segments[sid].extents.used}
        first = [e for sid in eviction.segments_by_next_use(clearable, now, cycle, plans)
                 for e in eviction.by_next_use(clearable[sid], now, cycle, plans)]
        chosen = {id(e) for e in first}   # then the rest, should a hole open there
        return first + eviction.by_next_use((e for e in idle if id(e) not in chosen), now,
                                            cycle, plans)

    def _reclaim_kept(self, job: str, victim: Entry, ahead_of: float) -> bool:
        """Make room in the NVMe file for ``victim``'s record, which a read
        ahead to ``ahead_of`` steps evicts: free the copies of the job's
        tensors in the pool that the read ahead keeps (its plan uses them
        before then) and whose uses lie closer together than the victim's,
        those closest together first; none if they all would not make it
        fit ([Note: what reading ahead writes] in tierd.server.readahead)."""
        extents, plans = self.nvme.extents, self.plans.get(job)
        need = extents.extent_size(victim.meta().record_len())
        if plans is None or plans.longest_gap(victim.key) is None:
            return False
        longest = plans.longest_gap(victim.key)
        kept = []
        for e in self.job_entries(job):
            if (e.state is Residency.IN_POOL and e.disk is not None and not e.dirty
                    and not e.disk.holds and not e.disk.readers):
                ahead = plans.steps_ahead(e.key)
                gap = plans.longest_gap(e.key)
                if ahead is not None and ahead <= ahead_of and gap < longest:
                    kept.append(((gap, ahead), e))
        if extents.free_bytes + sum(e.disk.nbytes for _, e in kept) < need:
            return False
        for _, e in sorted(kept, key=lambda k: k[0]):
            if extents.free_bytes >= need:
                break
            self.mark_dirty(e)
        return extents.free_bytes >= need

    def _reclaim_nvme(self, nbytes: int) -> bool:
        """Free the NVMe copies of tensors whose pool copy is current until a
        record of ``nbytes`` fits (free bytes suffice: records may span
        several extents); False if it still does not."""
        extents = self.nvme.extents
        for e in list(self.entries.values()):
            if extents.free_bytes >= extents.extent_size(nbytes):
                return True
            if (e.state is Residency.IN_POOL and e.disk is not None and not e.dirty
                    and not e.disk.holds and not e.disk.readers):   # a commit's record stays
                self.mark_dirty(e)
        return extents.free_bytes >= extents.extent_size(nbytes)

    def _plan_eviction(self, job: str, nbytes: int, blocked: Blocked,
                       protect: Iterable[Entry], ahead_of: float | None = None) -> bool:
        """Free or start freeing about ``nbytes`` of pool for ``job`` (see [Note:
        fair eviction] in :mod:`tierd.server.eviction`). True when something was freed at
        once (retry allocating); otherwise what to wait for is in ``blocked``. A
        read ahead (``ahead_of``) takes nothing from other jobs."""
        pending = sum(t.slot.nbytes for t in blocked.wait if t.direction is Direction.TO_NVME)
        for t in self.writebacks_in_flight(job):
            if t not in blocked.wait:
                blocked.wait.append(t)
                pending += t.slot.nbytes
        if pending >= nbytes:
            return False
        quota = self.jobs[job].pool_quota
        at_quota = quota and self.pool.job_used_bytes(job) + nbytes > quota
        if not at_quota and ahead_of is None and self.pool.mapped_bytes + nbytes > self.pool.budget:
            usage = {name: self.pool.job_used_bytes(name) for name in self.jobs}
            other = eviction.job_to_take_from(self.pool.budget, usage, job)
            if other is not None:
                freed = self._evict_segment(other, blocked)
                if freed is not None:
                    return freed
        victims = self._victims(job, nbytes, protect, ahead_of)
        for e in victims:
            if pending >= nbytes:
                break
            if not e.dirty and e.disk is not None:
                self.drop_slot(e)
                self.counters.evictions += 1
                return True
            try:   # a clean victim below costs no I/O: reclaim NVMe copies only then
                blocked.wait.append(self.start_writeback(e, reclaim=False))
            except CapacityError:
                # NVMe is full: a clean victim (one with a copy there) can make
                # room now; else the NVMe copies of tensors also in the pool
                # give way (the swap headroom Note counts each tensor once).
                clean = next((v for v in victims if not v.dirty and v.disk is not None), None)
                if clean is not None:
                    self.drop_slot(clean)
                    self.counters.evictions += 1
                    return True
                if pending or blocked.wait:   # retried once those land
                    break
                if ahead_of is not None:   # [Note: what reading ahead writes]
                    if not self._reclaim_kept(job, e, ahead_of):
                        raise
                    blocked.wait.append(self.start_writeback(e, reclaim=False))
                    pending += e.slot.nbytes
                    continue
                reading = [x.transfer for x in self.job_entries(job)
                           if x.state is Residency.READING_IN]
                if reading:   # they land with their NVMe copies: clean victims then
                    blocked.wait.extend(reading)
                    break
                if not self._reclaim_nvme(e.meta().record_len()):
                    raise
                blocked.wait.append(self.start_writeback(e))
            pending += e.slot.nbytes
        return False

    def _evict_segment(self, job: str, blocked: Blocked) -> bool | None:
        """Empty the coldest fully evictable segment of ``job`` so the pool can
        hand its memory to another job. True: emptied at once; False: write-backs
        to wait for are in ``blocked``; None: nothing of ``job`` can go."""
        in_flight = self.writebacks_in_flight(job)
        if in_flight:
            blocked.wait.extend(t for t in in_flight if t not in blocked.wait)
            return False
        by_segment: dict[int, list[Entry]] = {}
        for e in self.job_entries(job):
            if e.slot is not None:
                by_segment.setdefault(e.slot.segment.id, []).append(e)
        movable = {
            sid: ents for sid, ents in by_segment.items()
            if all(e.state is Residency.IN_POOL and e.slot.idle for e in ents)
            and sum(e.slot.nbytes for e in ents) == self.pool.segments[sid].extents.used}
        if not movable:
            return None
        cycle = eviction.job_cycle(self.job_entries(job), self.now)
        sid = eviction.segments_by_next_use(movable, self.now, cycle, self.plans.get(job))[0]
        started = False
        for e in movable[sid]:
            if not e.dirty and e.disk is not None:
                self.drop_slot(e)
                self.counters.evictions += 1
            else:
                blocked.wait.append(self.start_writeback(e))
                started = True
        return not started

    def writebacks_in_flight(self, job: str) -> list[Transfer]:
        return [e.transfer for e in self.job_entries(job)
                if e.state is Residency.WRITING_BACK and e.transfer.drop_slot]
