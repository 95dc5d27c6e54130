"""The catalog: what each key holds, in which tier, and who may touch it.

Plain code with no event loop or sockets: the daemon calls these methods on
its loop thread and carries out the transfers they return. A method that
cannot finish now (a swap-in or write-back must happen first) returns
:class:`Blocked` naming the transfers to start and the ones to wait for; the
caller retries the same call once they are done.

[Note: pins] A pool slot or NVMe extent is never freed or overwritten while
something may read it: every lease and every in-flight transfer that reads a
slot holds a pin on it. Deleting or replacing a key only marks its old slot
``orphan``; the bytes are freed when the last pin goes. An NVMe extent named
by a commit also carries a hold (see the Note on commits in
:mod:`tierd.server.commits`) and is freed only once no commit names it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from tierd.backends.hostpool import HostPool
from tierd.backends.manifest import Manifest, ManifestStore
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError, StateError, UnknownKey
from tierd.protocol import Placement, TensorSpec
from tierd.server import commits, eviction
from tierd.server.records import (Blocked, Direction, DiskExtent, Entry, Job, PoolSlot,
                                  Residency, Session, TierCounters, Transfer, spec_nbytes,
                                  stored_size)

__all__ = ["Blocked", "Catalog", "Direction", "Entry", "Job", "Residency", "Session",
           "Transfer"]


class Catalog:
    """Keys, their tiers, sessions and jobs. See the module docstring."""

    def __init__(self, pool: HostPool, nvme: NvmeStore, allow_root_join: bool = True,
                 quotas: Callable[[str], tuple[int, int]] = lambda job: (0, 0),
                 manifests: ManifestStore | None = None) -> None:
        self.pool = pool
        self.nvme = nvme
        self.manifests = manifests
        self.allow_root_join = allow_root_join
        self.quotas = quotas   # job name -> (pool quota, NVMe quota), 0 for none
        self.entries: dict[tuple[str, str], Entry] = {}
        self.sessions: dict[int, Session] = {}
        self.jobs: dict[str, Job] = {}
        self.counters = TierCounters()
        self._clock = itertools.count(1)
        self._started: list[Transfer] = []
        # Bytes of every tensor held (published or reserved), each counted once
        # whichever tiers hold copies; see ``_admit``.
        self.stored_bytes = 0
        self._largest = 0
        # NVMe bytes of records no tensor uses any more but a commit still names.
        self.held_only_bytes = 0

    def take_started(self) -> list[Transfer]:
        """Transfers begun since the last call; the daemon must run each one and
        call :meth:`finish` (also when the call that began them raised)."""
        started, self._started = self._started, []
        return started

    # ------------------------------------------------------------ sessions
    def open_session(self, sid: int, job: str | None, pid: int, uid: int) -> Session:
        name = job if job is not None else f"pid-{pid}"
        j = self.jobs.get(name)
        if j is None:
            pool_quota, nvme_quota = self.quotas(name)
            j = self.jobs[name] = Job(name, uid, ephemeral=job is None,
                                      pool_quota=pool_quota, nvme_quota=nvme_quota)
        elif j.owner_uid != uid and not (uid == 0 and self.allow_root_join):
            raise StateError(f"job {name!r} belongs to uid {j.owner_uid}; uid {uid} may not "
                             f"join it; pick another job name")
        j.sessions.add(sid)
        session = self.sessions[sid] = Session(sid, name, pid, uid)
        return session

    def close_session(self, sid: int) -> None:
        """Give back everything the session held: leases and unpublished slots."""
        s = self.sessions.pop(sid, None)
        if s is None:
            return
        for records in s.leases.values():
            for entry, slot, write in records:
                self._unpin(slot, write)
        for spec, slot in s.reserved.values():
            self._give_up_reserved(spec, slot)
        job = self.jobs[s.job]
        job.sessions.discard(sid)
        if job.ephemeral and not job.sessions:
            self.drop_job(job.name)

    def drop_job(self, name: str) -> None:
        """Delete every tensor of the job; forget the job once no session is in it."""
        job = self.jobs.get(name)
        if job is None:
            raise UnknownKey(f"no job {name!r}")
        if job.committing:
            raise StateError(f"job {name!r} is being committed; drop it once the commit "
                             f"has returned")
        for entry in [e for (j, _), e in self.entries.items() if j == name]:
            self._drop_entry(entry)
        if job.manifest is not None and self.manifests is not None:
            self.manifests.remove(name)
        commits.release(self, job, [])
        job.manifest = None
        if not job.sessions:
            del self.jobs[name]
            self.pool.release_empty(exclude=None, need=self.pool.budget)

    # ------------------------------------------------------------ requests
    def reserve(self, s: Session, specs: tuple[TensorSpec, ...]) -> list[Placement] | Blocked:
        for spec in specs:
            if spec_nbytes(spec) != spec.nbytes:
                raise StateError(f"{spec.key}: nbytes {spec.nbytes} does not match "
                                 f"{spec.dtype}{list(spec.shape)} ({spec_nbytes(spec)} B)")
            if spec.key in s.reserved:
                raise StateError(f"{spec.key}: already reserved by this client; "
                                 f"publish or abort it first")
        if len({spec.key for spec in specs}) != len(specs):
            raise StateError("a key appears twice in one reserve")
        need = self._admit(self.jobs[s.job], specs)
        blocked = Blocked()
        got: list[PoolSlot] = []
        for spec in specs:
            slot = self._alloc_slot(s.job, spec.nbytes, blocked, protect=())
            if slot is None:
                for g in got:
                    self.pool.free(g.segment, g.offset)
                return blocked
            got.append(slot)
        self.stored_bytes += need
        self.jobs[s.job].stored_bytes += need
        out = []
        for spec, slot in zip(specs, got):
            slot.writer = True
            s.reserved[spec.key] = (spec, slot)
            old = self.entries.get((s.job, spec.key))
            version = old.version + 1 if old else 1
            out.append(Placement(spec.key, slot.segment.id, slot.offset, spec.nbytes,
                                 spec.dtype, spec.shape, version))
        return out

    def publish(self, s: Session, keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in s.reserved]
        if missing:
            raise StateError(f"publish of keys this client has not reserved: {missing[:5]}")
        for key in keys:
            spec, slot = s.reserved.pop(key)
            slot.writer = False
            old = self.entries.get((s.job, key))
            if old is not None:
                self._drop_entry(old)
            self.entries[(s.job, key)] = Entry(
                key, s.job, spec, old.version + 1 if old else 1, Residency.IN_POOL, slot,
                last_use=next(self._clock))

    def abort(self, s: Session, keys: tuple[str, ...]) -> None:
        for key in keys:
            item = s.reserved.pop(key, None)
            if item is not None:
                self._give_up_reserved(*item)

    def _give_up_reserved(self, spec: TensorSpec, slot: PoolSlot) -> None:
        size = stored_size(spec.key, slot.segment.job, spec.nbytes)
        self.stored_bytes -= size
        self.jobs[slot.segment.job].stored_bytes -= size
        slot.orphan = True
        self._unpin(slot, write=True)

    def _admit(self, job: Job, specs: tuple[TensorSpec, ...]) -> int:
        """Bytes the specs will hold, or CapacityError when pool + NVMe could not
        hold them and still swap any tensor in.

        [Note: swap headroom] Bringing a tensor in from NVMe when the pool is
        full means writing a dirty victim out first, so NVMe needs a free extent
        of the largest tensor's size. Admitting at most pool + NVMe minus the
        largest tensor keeps that true: everything stored stays readable.
        """
        sizes = [stored_size(spec.key, job.name, spec.nbytes) for spec in specs]
        need = sum(sizes)
        largest = max([self._largest, *sizes])
        limit = self.pool.budget + self.nvme.size - largest - self.held_only_bytes
        if self.stored_bytes + need > limit:
            raise CapacityError(
                f"pool + NVMe full: {self.stored_bytes} B stored, {need} B more asked, "
                f"at most {limit} B fit (pool {self.pool.budget} B + NVMe {self.nvme.size} B, "
                f"less {largest} B kept free for swapping and {self.held_only_bytes} B of "
                f"older versions kept for the last commits); delete tensors, commit, or "
                f"start the daemon with a larger --pool or --nvme-size")
        job_largest = max([job.largest, *sizes])
        if job.pool_quota or job.nvme_quota:
            job_limit = ((job.pool_quota or self.pool.budget) + (job.nvme_quota or self.nvme.size)
                         - job_largest)
            if job.stored_bytes + need > job_limit:
                raise CapacityError(
                    f"job {job.name!r} over quota: {job.stored_bytes} B stored, {need} B more "
                    f"asked, its quotas allow {job_limit} B (pool {job.pool_quota or 'none'}, "
                    f"NVMe {job.nvme_quota or 'none'}, less {job_largest} B for swapping); delete "
                    f"tensors or raise the job's quota in the config file")
        self._largest, job.largest = largest, job_largest
        return need

    def lease(self, s: Session, keys: tuple[str, ...], write: bool) -> list[Placement] | Blocked:
        entries = [self._entry(s, k) for k in keys]
        if write and len(set(keys)) != len(keys):
            raise StateError("a key appears twice in one write lease")
        blocked = Blocked()
        for e in entries:
            match e.state:
                case Residency.IN_POOL:
                    self._check_lease_conflict(e, write)
                case Residency.WRITING_BACK:
                    if write:
                        blocked.wait.append(e.transfer)
                    else:
                        self._check_lease_conflict(e, write)
                case Residency.READING_IN:
                    blocked.wait.append(e.transfer)
                case Residency.ON_NVME:
                    self._start_swap_in(e, blocked, protect=entries)
        if blocked.wait:
            return blocked
        tick = next(self._clock)
        for e in entries:
            if write:
                e.slot.writer = True
            else:
                e.slot.pins += 1
            e.last_use = tick
            s.leases.setdefault(e.key, []).append((e, e.slot, write))
        return [e.placement() for e in entries]

    def release(self, s: Session, keys: tuple[str, ...], written: bool) -> None:
        not_held = [k for k in keys if not s.leases.get(k)]
        if not_held:
            raise StateError(f"release of keys this client does not lease: {not_held[:5]}")
        if written:
            read_only = [k for k in keys if not s.leases[k][0][2]]
            if read_only:
                raise StateError(f"released as written, but these leases are read-only: "
                                 f"{read_only[:5]}; lease with write=True to change a tensor")
        for key in keys:
            records = s.leases[key]
            entry, slot, write = records.pop(0)
            if not records:
                del s.leases[key]
            if written and self.entries.get((s.job, key)) is entry and entry.slot is slot:
                entry.version += 1
                self._mark_dirty(entry)
            self._unpin(slot, write)

    def prefetch(self, s: Session, keys: tuple[str, ...]) -> None:
        """Start swap-ins of the keys on NVMe; the transfers come out of
        :meth:`take_started`. Stops quietly where the pool is full: a hint."""
        entries = [self._entry(s, k) for k in keys]
        blocked = Blocked()
        for e in entries:
            if e.state is Residency.ON_NVME:
                try:
                    self._start_swap_in(e, blocked, protect=entries)
                except CapacityError:
                    break

    def evict(self, s: Session, keys: tuple[str, ...]) -> None | Blocked:
        entries = [self._entry(s, k) for k in keys]
        leased = [e.key for e in entries if e.state is Residency.IN_POOL
                  and (e.slot.pins or e.slot.writer)]
        if leased:
            raise StateError(f"cannot evict leased tensors {leased[:5]}; release them first")
        blocked = Blocked()
        for e in entries:
            match e.state:
                case Residency.IN_POOL:
                    if e.dirty:
                        blocked.wait.append(self._start_writeback(e))
                    else:
                        self._drop_slot(e)
                case Residency.WRITING_BACK | Residency.READING_IN:
                    blocked.wait.append(e.transfer)
        return blocked if blocked.wait else None

    def delete(self, s: Session, keys: tuple[str, ...]) -> None:
        entries = [self._entry(s, k) for k in keys]
        for e in entries:
            if e.slot is not None and e.slot.writer and e.state is Residency.IN_POOL:
                raise StateError(f"{e.key}: cannot delete while write-leased")
        for e in entries:
            if self.entries.get((e.job, e.key)) is e:
                self._drop_entry(e)

    def keys(self, s: Session, prefix: str) -> list[str]:
        return sorted(k for (j, k) in self.entries if j == s.job and k.startswith(prefix))

    def stats(self) -> dict:
        per_job = {}
        for name, job in self.jobs.items():
            per_job[name] = {"owner_uid": job.owner_uid, "ephemeral": job.ephemeral,
                             "sessions": len(job.sessions), "tensors": 0,
                             "pool_used_bytes": 0, "nvme_used_bytes": 0}
        for (jname, _), e in self.entries.items():
            row = per_job[jname]
            row["tensors"] += 1
            if e.slot is not None:
                row["pool_used_bytes"] += e.slot.nbytes
            if e.disk is not None:
                row["nvme_used_bytes"] += e.disk.nbytes
        c = self.counters
        return {
            "pool_bytes": self.pool.budget,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_mapped_bytes": self.pool.mapped_bytes,
            "nvme_bytes": self.nvme.size,
            "nvme_used_bytes": self.nvme.extents.used,
            "nvme_direct_io": self.nvme.direct,
            "tensors": len(self.entries),
            "sessions": len(self.sessions),
            "bytes_to_nvme": c.bytes_to_nvme,
            "bytes_to_pool": c.bytes_to_pool,
            "evictions": c.evictions,
            "io_errors": c.io_errors,
            "jobs": per_job,
        }

    # ------------------------------------------------------------- commits
    def prepare_commit(self, s: Session, tag: str) -> "commits.CommitPlan | Blocked":
        """See :func:`tierd.server.commits.prepare`."""
        return commits.prepare(self, s, tag)

    def finish_commit(self, plan: "commits.CommitPlan", error: Exception | None) -> None:
        commits.finish(self, plan, error)

    def recover(self, manifests: list[Manifest]) -> list[str]:
        """Rebuild committed jobs after a restart; one log line per job."""
        return [commits.recover(self, m) for m in manifests]

    def commit_tags(self, s: Session) -> list[str]:
        m = self.jobs[s.job].manifest
        return m.tags() if m is not None else []

    # ----------------------------------------------------------- transfers
    def finish(self, t: Transfer, error: Exception | None) -> None:
        """Account for a transfer the daemon has carried out (or failed)."""
        t.done, t.error = True, error
        e = t.entry
        live = self.entries.get((e.job, e.key)) is e
        if error is not None:
            self.counters.io_errors += 1
        if t.direction is Direction.TO_NVME:
            t.slot.pins -= 1
            if error is not None or not live:
                self._free_disk(t.disk)
            if not live:
                self._free_slot_if_idle(t.slot)
                return
            e.to_in_pool()
            if error is not None:
                return
            self.counters.bytes_to_nvme += t.nbytes
            e.disk, e.dirty = t.disk, False
            if t.drop_slot and not t.slot.pins and not t.slot.writer:
                self._drop_slot(e)
        else:
            t.slot.writer = False
            t.disk.pins -= 1
            if error is not None or not live:
                t.slot.orphan = True
                self._free_slot_if_idle(t.slot)
                if not live:
                    self._free_disk_if_idle(t.disk)
                    return
                e.to_on_nvme()
                return
            self.counters.bytes_to_pool += t.nbytes
            e.dirty = False
            e.to_in_pool()

    # ----------------------------------------------------------- internals
    def _entry(self, s: Session, key: str) -> Entry:
        e = self.entries.get((s.job, key))
        if e is None:
            raise UnknownKey(f"no tensor under key {key!r} in job {s.job!r}")
        return e

    @staticmethod
    def _check_lease_conflict(e: Entry, write: bool) -> None:
        if e.slot.writer or (write and e.slot.pins):
            raise StateError(f"{e.key}: leased for {'writing' if e.slot.writer else 'reading'} "
                             f"by another holder; a write lease needs the tensor to itself")

    def _start_swap_in(self, e: Entry, blocked: Blocked, protect) -> None:
        slot = self._alloc_slot(e.job, e.spec.nbytes, blocked, protect)
        if slot is None:
            return
        slot.writer = True
        e.disk.pins += 1
        t = Transfer(Direction.TO_POOL, e, slot, e.disk)
        e.to_reading_in(t)
        self._started.append(t)
        blocked.wait.append(t)

    def _start_writeback(self, e: Entry, drop_slot: bool = True) -> Transfer:
        """Write the entry's pool bytes to a new NVMe extent: never over the
        extent of an older version, which a commit may still name."""
        job = self.jobs[e.job]
        size = e.meta().record_len()
        if job.nvme_quota and job.nvme_used + size > job.nvme_quota:
            raise CapacityError(
                f"job {job.name!r} reached its NVMe quota ({job.nvme_used} of "
                f"{job.nvme_quota} B used), cannot write {e.key} ({size} B); "
                f"delete tensors or raise the job's quota in the config file")
        off = self.nvme.extents.alloc(size)
        if off is None:
            raise CapacityError(
                f"NVMe tier full: {self.nvme.extents.used} of {self.nvme.size} B used "
                f"({self.held_only_bytes} B by older versions the last commits name), "
                f"cannot write {e.key} ({size} B); delete tensors, commit, or start the "
                f"daemon with a larger --nvme-size")
        e.slot.pins += 1
        disk = DiskExtent(off, self.nvme.extents.extent_size(size), e.job)
        job.nvme_used += disk.nbytes
        t = Transfer(Direction.TO_NVME, e, e.slot, disk, drop_slot)
        e.to_writing_back(t)
        self.counters.evictions += drop_slot
        self._started.append(t)
        return t

    def _alloc_slot(self, job: str, nbytes: int, blocked: Blocked, protect) -> PoolSlot | None:
        """A pool slot for ``job``, or None after planning evictions into ``blocked``."""
        while True:
            got = self.pool.allocate(job, nbytes, self.jobs[job].pool_quota)
            if got is not None:
                seg, off = got
                return PoolSlot(seg, off, seg.extents.extent_size(nbytes))
            if not self._plan_eviction(job, nbytes, blocked, protect):
                break
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

    def _plan_eviction(self, job: str, nbytes: int, blocked: Blocked, protect) -> bool:
        """Free or start freeing about ``nbytes`` of pool for ``job`` (see the
        Note in :mod:`tierd.server.eviction`). True when something was freed at
        once (retry allocating); otherwise what to wait for is in ``blocked``."""
        pending = sum(t.slot.nbytes for t in blocked.wait if t.direction is Direction.TO_NVME)
        for t in self._writebacks_in_flight(job):
            if t not in blocked.wait:
                blocked.wait.append(t)
                pending += t.slot.nbytes
        if pending >= nbytes:
            return False
        quota = self.jobs[job].pool_quota
        at_quota = quota and self.pool.job_used_bytes(job) + nbytes > quota
        if not at_quota and self.pool.mapped_bytes + nbytes > self.pool.budget:
            usage = {name: self.pool.job_used_bytes(name) for name in self.jobs}
            other = eviction.job_to_take_from(self.pool.budget, usage, job)
            if other is not None:
                freed = self._evict_segment(other, blocked)
                if freed is not None:
                    return freed
        protected = {id(p) for p in protect}
        victims = eviction.least_recently_used(
            e for (j, _), e in self.entries.items()
            if j == job and e.state is Residency.IN_POOL and not e.slot.pins
            and not e.slot.writer and id(e) not in protected)
        for e in victims:
            if pending >= nbytes:
                break
            if not e.dirty and e.disk is not None:
                self._drop_slot(e)
                self.counters.evictions += 1
                return True
            try:
                blocked.wait.append(self._start_writeback(e))
            except CapacityError:
                # NVMe is full: only a clean victim (one with a copy there) can
                # make room now; the swap headroom Note guarantees one exists.
                clean = next((v for v in victims if not v.dirty and v.disk is not None), None)
                if clean is not None:
                    self._drop_slot(clean)
                    self.counters.evictions += 1
                    return True
                if pending:
                    break
                raise
            pending += e.slot.nbytes
        return False

    def _evict_segment(self, job: str, blocked: Blocked) -> bool | None:
        """Empty the coldest fully evictable segment of ``job`` so the pool can
        hand its memory to another job. True: emptied at once; False: write-backs
        to wait for are in ``blocked``; None: nothing of ``job`` can go."""
        in_flight = self._writebacks_in_flight(job)
        if in_flight:
            blocked.wait.extend(t for t in in_flight if t not in blocked.wait)
            return False
        by_segment: dict[int, list[Entry]] = {}
        for (j, _), e in self.entries.items():
            if j == job and e.slot is not None:
                by_segment.setdefault(e.slot.segment.id, []).append(e)
        movable = {
            sid: ents for sid, ents in by_segment.items()
            if all(e.state is Residency.IN_POOL and not e.slot.pins and not e.slot.writer
                   for e in ents)
            and sum(e.slot.nbytes for e in ents) == self.pool.segments[sid].extents.used}
        sid = eviction.coldest_segment(movable)
        if sid is None:
            return None
        started = False
        for e in movable[sid]:
            if not e.dirty and e.disk is not None:
                self._drop_slot(e)
                self.counters.evictions += 1
            else:
                blocked.wait.append(self._start_writeback(e))
                started = True
        return not started

    def _writebacks_in_flight(self, job: str) -> list[Transfer]:
        return [e.transfer for (j, _), e in self.entries.items()
                if j == job and e.state is Residency.WRITING_BACK and e.transfer.drop_slot]

    def _drop_slot(self, e: Entry) -> None:
        slot = e.slot
        e.to_on_nvme()
        slot.orphan = True
        self._free_slot_if_idle(slot)

    def _mark_dirty(self, e: Entry) -> None:
        e.dirty = True
        if e.disk is not None:
            self._free_disk_if_idle(e.disk, orphan=True)
            e.disk = None

    def _drop_entry(self, e: Entry) -> None:
        del self.entries[(e.job, e.key)]
        size = stored_size(e.key, e.job, e.spec.nbytes)
        self.stored_bytes -= size
        if e.job in self.jobs:
            self.jobs[e.job].stored_bytes -= size
        if e.slot is not None:
            e.slot.orphan = True
            self._free_slot_if_idle(e.slot)
        if e.disk is not None:
            self._free_disk_if_idle(e.disk, orphan=True)

    def _unpin(self, slot: PoolSlot, write: bool) -> None:
        if write:
            slot.writer = False
        else:
            slot.pins -= 1
        self._free_slot_if_idle(slot)

    def _free_slot_if_idle(self, slot: PoolSlot) -> None:
        if slot.orphan and not slot.pins and not slot.writer and not slot.freed:
            slot.freed = True
            if slot.segment.id in self.pool.segments:
                self.pool.free(slot.segment, slot.offset)

    def _free_disk_if_idle(self, disk: DiskExtent, orphan: bool = False) -> None:
        disk.orphan |= orphan
        if not disk.orphan or disk.freed:
            return
        if disk.holds and not disk.held_only:
            disk.held_only = True
            self.held_only_bytes += disk.nbytes
        if not disk.pins and not disk.holds:
            if disk.held_only:
                self.held_only_bytes -= disk.nbytes
            disk.freed = True
            self.nvme.extents.free(disk.offset)
            if disk.job in self.jobs:
                self.jobs[disk.job].nvme_used -= disk.nbytes

    def _free_disk(self, disk: DiskExtent) -> None:
        self._free_disk_if_idle(disk, orphan=True)
