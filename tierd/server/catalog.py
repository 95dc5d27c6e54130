"""The catalog: what each key holds, in which tier, and who may touch it.

Plain code with no event loop or sockets: the daemon calls these methods on
its loop thread and carries out the transfers they return. A method that
cannot finish now (a swap-in or write-back must happen first) returns
:class:`Blocked` naming the transfers to start and the ones to wait for; the
caller retries the same call once they are done.

The catalog handles sessions, jobs and requests; the bytes (entries, slots,
extents, transfers, eviction) are :class:`~tierd.server.tiers.Tiers`', whose
slots and extents follow [Note: pins] in :mod:`tierd.server.slots`, and
whether a tensor fits is :mod:`tierd.server.admission`'s.

[Note: the catalog's cost on the loop]
Every request is served on the daemon's one loop thread, and so is the
start of every transfer: while the catalog computes, no read is started
and no lease is answered. The daemon's stats count those seconds
(``catalog_s``). The 70B LoRA at 24 GB (80 blocks, each 7 weights, 2 norms
and 8 adapters, through a 113 GB pool of ~440 segments) spent 11.1-11.7 s
of a 38.8 s step there with read-ahead, 6.0 s without (H200, 9fa0cfe),
while its disk idled ~10 s a step. ``python -m tierd.bench.eviction_sim
--rank 16`` runs this catalog on those entries: 18.0-18.8 CPU s a step on
the 2-core development VM. Most of it was ``HostPool.mapped_bytes``, a sum
over every segment, asked for each segment an allocation might drop,
for every allocation the full pool refused: segments squared, hundreds of
times a step. It is a running total now: 4.3-4.6 s a step in the same
simulation (0.55 s without the adapters). What is left is the eviction
order: each clean victim an allocation drops makes it rank every idle
entry of the job by next use again (~1,500 here) to drop the next one.
Tried and dropped: making that order once per allocation (2.8 s a step,
but a clean victim taken out of order can change which segment ranks
first, so the order was not the one re-ranking gives, and a test of a
store too full for the first update then failed), remembering next uses
until the position moves, and ranking each entry once per order (no
effect). An index of entries by next use is the next step. The policy
itself keeps the disk busy: with a clock (``--disk-gbps 1.8 --layers
74``, the 74 streamed blocks) the simulated step is 20.7-21.5 s with the
disk busy 20.6-21.3 s of it (least recently used: 28.0 s), so the H200's
~10 s of idle disk a step lay outside it: the loop's time, or the client's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tierd import __version__

from tierd.backends.hostpool import HostPool
from tierd.backends.manifest import Manifest, ManifestStore
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError, StateError, UnknownKey
from tierd.protocol import Placement, TensorSpec
from tierd.server import commits
from tierd.server.admission import Admission
from tierd.server.readahead import JobPlans
from tierd.server.records import (Blocked, Direction, Entry, Job, Residency, Session, Transfer,
                                  spec_nbytes, stored_size)
from tierd.server.slots import PoolSlot, SlotState
from tierd.server.tiers import Tiers

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
        self.admission = Admission(pool.budget, nvme.size)
        self.tiers = Tiers(pool, nvme, self.admission)
        self.entries = self.tiers.entries   # (job, key) -> Entry
        self.jobs = self.tiers.jobs
        self.sessions: dict[int, Session] = {}
        self.started = time.monotonic()   # for stats' uptime

    @property
    def stored_bytes(self) -> int:
        """Bytes admitted (see :mod:`tierd.server.admission`)."""
        return self.admission.stored_bytes

    @property
    def held_only_bytes(self) -> int:
        """NVMe bytes of records only the last commits still name."""
        return self.admission.held_only_bytes

    def take_started(self) -> list[Transfer]:
        """Transfers begun since the last call; the daemon must run each one and
        call :meth:`finish` (also when the call that began them raised)."""
        return self.tiers.take_started()

    def finish(self, t: Transfer, error: Exception | None) -> None:
        """Account for a transfer the daemon has carried out (or failed)."""
        self.tiers.finish(t, error)

    # ------------------------------------------------------------ sessions
    def open_session(self, sid: int, job: str | None, pid: int, uid: int) -> Session:
        # See [Note: default jobs] in tierd.server.sessions: never a pid.
        name = job if job is not None else f"session-{sid}"
        j = self.jobs.get(name)
        if j is None:
            pool_quota, nvme_quota = self.quotas(name)
            j = self.jobs[name] = Job(name, uid, ephemeral=job is None,
                                      pool_quota=pool_quota, nvme_quota=nvme_quota)
            j.opened_by = sid
        elif j.owner_uid != uid and not (uid == 0 and self.allow_root_join):
            raise StateError(f"job {name!r} belongs to uid {j.owner_uid}; uid {uid} may not "
                             f"join it; pick another job name")
        else:
            j.opened_by = None   # joined by another session: a job someone knew
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
                self.tiers.end_lease(slot, write)
        for spec, slot in s.reserved.values():
            self.tiers.give_up_reserved(spec, slot)
        job = self.jobs[s.job]
        job.sessions.discard(sid)
        if not job.sessions and (job.ephemeral or self.tiers.holds_nothing(job)):
            self.drop_job(job.name)   # a named job with no tensor and no commit is only a name

    def drop_job(self, name: str) -> None:
        """Delete every tensor of the job; forget the job once no session is in it.

        UnknownKey for a job that did not exist before the caller's session
        opened it (it holds nothing and no other session was ever in it):
        ``tierd drop-job`` joins the job it drops, which creates an unknown one."""
        job = self.jobs.get(name)
        if job is None or (job.opened_by is not None and job.sessions == {job.opened_by}
                           and self.tiers.holds_nothing(job)):
            raise UnknownKey(f"no job {name!r} (no tensor, no commit and no other client in "
                             f"it); `tierd status --all` lists the jobs")
        if job.committing:
            raise StateError(f"job {name!r} is being committed; drop it once the commit "
                             f"has returned")
        for entry in self.tiers.job_entries(name):
            self.tiers.drop_entry(entry)
        if job.manifest is not None and self.manifests is not None:
            self.manifests.remove(name)
        commits.release(self.tiers, job, [])
        job.manifest = None
        if not job.sessions:
            del self.jobs[name]
            self.tiers.plans.pop(name, None)
            self.pool.forget(name)
            self.pool.release_empty(exclude=None, need=self.pool.budget)

    # ------------------------------------------------------------ requests
    def reserve(self, s: Session, specs: tuple[TensorSpec, ...],
                zero: bool = False) -> list[Placement] | Blocked:
        """A RESERVED slot per spec (all or none); with ``zero`` each reads
        zeros (see [Note: zero slots] in ``tierd.backends.hostpool``)."""
        for spec in specs:
            if spec_nbytes(spec) != spec.nbytes:
                raise StateError(f"{spec.key}: nbytes {spec.nbytes} does not match "
                                 f"{spec.dtype}{list(spec.shape)} ({spec_nbytes(spec)} B)")
            if spec.key in s.reserved:
                raise StateError(f"{spec.key}: already reserved by this client; "
                                 f"publish or abort it first")
            if spec.nbytes > self.pool.budget:   # every tensor passes through the pool
                raise CapacityError(f"{spec.key}: a tensor of {spec.nbytes} B is larger than "
                                    f"the pool ({self.pool.budget} B); it can never be stored: "
                                    f"split it, or start the daemon with a larger --pool")
        if len({spec.key for spec in specs}) != len(specs):
            raise StateError("a key appears twice in one reserve")
        job = self.jobs[s.job]
        job.opened_by = None   # it has held a tensor: a known job
        grant = self.admission.check(job, [stored_size(sp.key, job.name, sp.nbytes)
                                           for sp in specs])
        got = self._reserve_slots(job.name, specs)
        if isinstance(got, Blocked):
            return got
        self.admission.admit(job, grant)
        if zero:
            self.pool.zero([(slot.segment, slot.offset, spec.nbytes)
                            for spec, slot in zip(specs, got)])
        out = []
        for spec, slot in zip(specs, got):
            s.reserved[spec.key] = (spec, slot)
            old = self.entries.get((s.job, spec.key))
            version = old.version + 1 if old else 1
            out.append(Placement(spec.key, slot.segment.id, slot.offset, spec.nbytes,
                                 spec.dtype, spec.shape, version))
        return out

    def _reserve_slots(self, job: str, specs: tuple[TensorSpec, ...]) -> list[PoolSlot] | Blocked:
        """A RESERVED slot per spec, or none at all: Blocked on evictions, or
        the CapacityError of the one that can never fit (a refused reserve
        keeps nothing, see [Note: swap headroom] in :mod:`tierd.server.admission`)."""
        blocked = Blocked()
        got: list[PoolSlot] = []
        try:
            for spec in specs:
                slot = self.tiers.alloc_slot(job, spec.key, spec.nbytes, blocked, (),
                                             SlotState.RESERVED)
                if slot is None:
                    break
                got.append(slot)
        finally:
            if len(got) < len(specs):
                for slot in got:
                    self.tiers.abandon(slot)
        return got if len(got) == len(specs) else blocked

    def publish(self, s: Session, keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in s.reserved]
        if missing:
            raise StateError(f"publish of keys this client has not reserved: {missing[:5]}")
        for key in keys:
            spec, slot = s.reserved.pop(key)
            slot.published()
            old = self.entries.get((s.job, key))
            if old is not None:
                self.tiers.drop_entry(old)
            self.entries[(s.job, key)] = Entry(
                key, s.job, spec, old.version + 1 if old else 1, Residency.IN_POOL, slot,
                last_use=self.tiers.tick())

    def abort(self, s: Session, keys: tuple[str, ...]) -> None:
        for key in keys:
            item = s.reserved.pop(key, None)
            if item is not None:
                self.tiers.give_up_reserved(*item)

    def lease(self, s: Session, keys: tuple[str, ...], write: bool) -> list[Placement] | Blocked:
        entries = [self._entry(s, k) for k in keys]
        if write and len(set(keys)) != len(keys):
            raise StateError("a key appears twice in one write lease")
        blocked = Blocked()
        for e in entries:
            match e.state:
                case Residency.IN_POOL:
                    _check_lease_conflict(e, write)
                case Residency.WRITING_BACK:
                    if write:
                        blocked.wait.append(e.transfer)
                    else:
                        _check_lease_conflict(e, write)
                case Residency.READING_IN:
                    blocked.wait.append(e.transfer)
                case Residency.ON_NVME:
                    self.tiers.start_swap_in(e, blocked, protect=entries)
        if blocked.wait:
            return blocked
        tick = self.tiers.tick()
        for e in entries:
            if write:
                e.slot.lease_write()
            else:
                e.slot.add_reader()
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
                self.tiers.mark_dirty(entry)
            self.tiers.end_lease(slot, write)

    def prefetch(self, s: Session, keys: tuple[str, ...]) -> None:
        """Start swap-ins of the keys on NVMe; the transfers come out of
        :meth:`take_started`. Stops quietly where the pool is full: a hint."""
        entries = [self._entry(s, k) for k in keys]
        blocked = Blocked()
        for e in entries:
            if e.state is Residency.ON_NVME:
                try:
                    self.tiers.start_swap_in(e, blocked, protect=entries)
                except CapacityError:
                    break

    def evict(self, s: Session, keys: tuple[str, ...]) -> None | Blocked:
        entries = [self._entry(s, k) for k in keys]
        leased = [e.key for e in entries if e.state is Residency.IN_POOL and e.slot.leased]
        if leased:
            raise StateError(f"cannot evict leased tensors {leased[:5]}; release them first")
        blocked = Blocked()
        for e in entries:
            match e.state:
                case Residency.IN_POOL:
                    if e.dirty:
                        blocked.wait.append(self.tiers.start_writeback(e))
                    else:
                        self.tiers.drop_slot(e)
                case Residency.WRITING_BACK | Residency.READING_IN:
                    blocked.wait.append(e.transfer)
        return blocked if blocked.wait else None

    def use_plan(self, s: Session, name: str, positions: tuple[tuple[str, ...], ...]) -> None:
        """Plan ``name`` of the job ([Note: the job's access plan] in
        tierd.server.readahead); an empty one forgets it. Keys it names need
        not exist yet: a plan is a hint."""
        plans = self.tiers.plans.setdefault(s.job, JobPlans())
        plans.set(name, positions)
        if not plans:
            del self.tiers.plans[s.job]

    def use_at(self, s: Session, name: str, at: int) -> None:
        """The job uses position ``at`` of plan ``name`` now: read ahead from there."""
        plans = self.tiers.plans.get(s.job)
        plan = None if plans is None else plans.by_name.get(name)
        if plan is None:
            return
        plan.advance(at)
        job = self.jobs[s.job]

        def size(key: str) -> int:
            e = self.entries.get((s.job, key))
            return 0 if e is None else e.spec.nbytes

        # the pool's room for this plan's keys: what the job's other tensors
        # leave, less the largest position's bytes (the holes between slots)
        others = sum(e.slot.nbytes for e in self.tiers.job_entries(s.job)
                     if e.slot is not None and e.key not in plan)
        largest = max(sum(size(k) for k in keys) for keys in plan.positions)
        room = min(self.pool.budget, job.pool_quota or self.pool.budget) - others
        end = plan.horizon(size, room - largest)
        c = self.tiers.counters
        c.read_ahead_passes += 1
        c.read_ahead_reach += end - plan.now
        in_use = [e for e in (self.entries.get((s.job, k)) for k in plan.positions[at % plan.length])
                  if e is not None]   # leased right after this, if not already
        for position, keys in plan.ahead(end):
            for key in keys:
                e = self.entries.get((s.job, key))
                if e is None or e.state is not Residency.ON_NVME:
                    continue   # in the pool, being read, or gone
                try:
                    self.tiers.start_swap_in(e, Blocked(), protect=in_use,
                                             ahead_of=plan.steps_to(end))
                except CapacityError:
                    c.read_ahead_no_room += 1
                    return   # nothing used later to make room with: resume at the next use
                if e.state is not Residency.READING_IN:
                    c.read_ahead_waits += 1
                    return   # its room waits on transfers in flight: resume at the next use
                c.bytes_read_ahead += e.spec.nbytes
            plan.cursor = position + 1

    def demote(self, s: Session, keys: tuple[str, ...]) -> None:
        """Evict these before the job's other tensors, the last demoted first
        ([Note: eviction by next use] in tierd.server.eviction); the next
        lease makes them ordinary again."""
        self.tiers.demote([self._entry(s, k) for k in keys])

    def delete(self, s: Session, keys: tuple[str, ...]) -> None:
        entries = [self._entry(s, k) for k in keys]
        for e in entries:
            if e.state is Residency.IN_POOL and e.slot.state is SlotState.WRITE_LEASED:
                raise StateError(f"{e.key}: cannot delete while write-leased")
        for e in entries:
            if self.entries.get((e.job, e.key)) is e:
                self.tiers.drop_entry(e)

    def keys(self, s: Session, prefix: str) -> list[str]:
        return sorted(k for (j, k) in self.entries if j == s.job and k.startswith(prefix))

    def stats(self) -> dict:
        per_job = {}
        for name, job in self.jobs.items():
            per_job[name] = {"owner_uid": job.owner_uid, "ephemeral": job.ephemeral,
                             "sessions": len(job.sessions), "tensors": 0,
                             "pool_used_bytes": 0, "nvme_used_bytes": 0,
                             "gpu_resident_bytes": 0}
        for s in self.sessions.values():
            if s.job in per_job:
                per_job[s.job]["gpu_resident_bytes"] += s.gpu_resident_bytes
        for (jname, _), e in self.entries.items():
            row = per_job[jname]
            row["tensors"] += 1
            if e.slot is not None:
                row["pool_used_bytes"] += e.slot.nbytes
            if e.disk is not None:
                row["nvme_used_bytes"] += e.disk.nbytes
        c = self.tiers.counters
        return {
            "version": __version__,   # the daemon's: clients and probes compare it to theirs
            "uptime_s": round(time.monotonic() - self.started, 3),
            "pool_bytes": self.pool.budget,
            "pool_used_bytes": self.pool.used_bytes,
            "pool_mapped_bytes": self.pool.mapped_bytes,
            "pool_segment_wait_s": round(self.pool.segment_wait_s, 3),
            "pool_segment_waits": self.pool.segment_waits,
            "pool_zeroed_bytes": self.pool.zeroed_bytes,
            "pool_zero_s": round(self.pool.zero_s, 3),
            "pool_spare_bytes": self.pool.spare_bytes,
            "nvme_bytes": self.nvme.size,
            "nvme_used_bytes": self.nvme.extents.used,
            # how fragmented the free bytes are (a record may span several extents)
            "nvme_largest_free_bytes": self.nvme.extents.largest_free(),
            "nvme_direct_io": self.nvme.direct,
            # what admission counts (tierd.server.admission), for clients'
            # capacity checks: free = pool + NVMe - largest - held_only - stored
            "stored_bytes": self.admission.stored_bytes,
            "largest_bytes": self.admission.largest,
            "held_only_bytes": self.admission.held_only_bytes,
            "tensors": len(self.entries),
            "sessions": len(self.sessions),
            "bytes_to_nvme": c.bytes_to_nvme,
            "bytes_to_pool": c.bytes_to_pool,
            "bytes_read_ahead": c.bytes_read_ahead,
            "read_ahead_passes": c.read_ahead_passes,
            "read_ahead_no_room": c.read_ahead_no_room,
            "read_ahead_waits": c.read_ahead_waits,
            "read_ahead_reach": c.read_ahead_reach,
            "evictions": c.evictions,
            "io_errors": c.io_errors,
            "jobs": per_job,
        }

    # ------------------------------------------------------------- commits
    def prepare_commit(self, s: Session, tag: str) -> "commits.CommitPlan | Blocked":
        """See :func:`tierd.server.commits.prepare`."""
        return commits.prepare(self.tiers, s, tag)

    def finish_commit(self, plan: "commits.CommitPlan", error: Exception | None) -> None:
        commits.finish(self.tiers, plan, error)

    def recover(self, manifests: list[Manifest]) -> list[str]:
        """Rebuild committed jobs after a restart; one log line per job."""
        return [commits.recover(self.tiers, m, self.quotas) for m in manifests]

    def commit_tags(self, s: Session) -> list[str]:
        m = self.jobs[s.job].manifest
        return m.tags() if m is not None else []

    # ----------------------------------------------------------- internals
    def _entry(self, s: Session, key: str) -> Entry:
        e = self.entries.get((s.job, key))
        if e is None:
            raise UnknownKey(f"no tensor under key {key!r} in job {s.job!r}")
        return e


def _check_lease_conflict(e: Entry, write: bool) -> None:
    if e.slot.state is SlotState.WRITE_LEASED or (write and e.slot.readers):
        raise StateError(f"{e.key}: leased for "
                         f"{'writing' if e.slot.state is SlotState.WRITE_LEASED else 'reading'}"
                         f" by another holder; a write lease needs the tensor to itself")
