"""Commits: a named job's tensors made durable as one consistent version.

Plain code over the catalog's :class:`~tierd.server.tiers.Tiers`, like the
catalog itself (which calls these functions; this module never imports it):
the daemon calls :func:`prepare` until it stops returning Blocked, writes the plan's
manifest in an I/O thread (data file fsync, then the manifest, see [Note:
manifest format] in :mod:`tierd.backends.manifest`), then calls :func:`finish`.

[Note: commits]
A commit names one NVMe record per tensor of the job. Making
one: every tensor whose pool bytes are newer than its NVMe record (dirty, or
never written) is written back, keeping its pool slot; tensors already clean on
NVMe cost nothing. So a commit writes the changed bytes once, plus an fsync and
a small manifest. The records a commit names carry a *hold*: the catalog frees
an extent only when no pin and no hold remain, and a write-back always goes to
a freshly allocated extent (copy-on-write), so the last commit's bytes are
never freed or overwritten until a newer manifest has replaced it, whatever
the job does meanwhile (overwrite, delete, evict). While a commit is being
made its records carry a second hold, dropped if it fails; so a failed commit
(disk full, EIO, a crash) leaves the previous one whole. Superseded records
that only a commit holds (``HELD`` extents) count against admission
(``held_only_bytes``) so the swap headroom Note stays true. Ephemeral (per-process) jobs are never
committed: they end with their process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tierd.backends.manifest import CommittedTensor, Manifest, next_manifest
from tierd.errors import IntegrityError, StateError
from tierd.protocol import TensorSpec
from tierd.server.records import Blocked, Entry, Job, Residency, Session, stored_size
from tierd.server.slots import DiskExtent, ExtentState, SlotState
from tierd.server.tiers import Tiers


@dataclass(eq=False)
class CommitPlan:
    """A commit whose records are all on NVMe; the manifest is next."""

    job: Job
    manifest: Manifest
    records: list[DiskExtent] = field(default_factory=list)
    written_bytes: int = 0

    def summary(self) -> dict:
        m = self.manifest
        return {"tag": m.tag, "seq": m.seq, "tensors": len(m.tensors),
                "bytes": sum(t.nbytes for t in m.tensors), "written_bytes": self.written_bytes}


def prepare(tiers: Tiers, s: Session, tag: str) -> CommitPlan | Blocked:
    """Start the write-backs the commit needs (Blocked on them), or the plan
    once every tensor of the job is clean on NVMe."""
    job = tiers.jobs[s.job]
    if job.ephemeral:
        raise StateError(f"job {job.name!r} is this process's ephemeral job and is never "
                         f"committed; connect with job=NAME to commit")
    entries = tiers.job_entries(job.name)
    writing = [e.key for e in entries
               if e.state is Residency.IN_POOL and e.slot.state is SlotState.WRITE_LEASED]
    if writing:
        raise StateError(f"cannot commit job {job.name!r} while these keys are write-leased: "
                         f"{writing[:5]}; release them first")
    blocked = Blocked()
    for e in entries:
        if e.state is Residency.WRITING_BACK:
            blocked.wait.append(e.transfer)
        elif e.state is Residency.IN_POOL and (e.dirty or e.disk is None):
            # No reclaiming: freeing the job's own clean records here would only
            # make the next round write them again.
            t = tiers.start_writeback(e, drop_slot=False, reclaim=False)
            job.commit_written += t.nbytes
            blocked.wait.append(t)
    if blocked.wait:
        return blocked
    tensors = tuple(CommittedTensor(e.key, e.spec.dtype, e.spec.shape, e.spec.nbytes,
                                    e.version, e.disk.spans) for e in entries)
    plan = CommitPlan(job, next_manifest(job.manifest, job.name, job.owner_uid, tag, tensors),
                      [e.disk for e in entries], job.commit_written)
    job.commit_written = 0
    job.committing = True
    for d in plan.records:
        d.hold()
    return plan


def finish(tiers: Tiers, plan: CommitPlan, error: Exception | None) -> None:
    """The manifest is durable (``error`` None): it replaces the job's last
    commit, whose records lose their hold. Or it failed: drop the new holds."""
    job = plan.job
    job.committing = False
    if error is not None:
        _unhold(tiers, plan.records)
        return
    release(tiers, job, plan.records)
    job.manifest = plan.manifest


def release(tiers: Tiers, job: Job, records: list[DiskExtent]) -> None:
    """Make ``records`` the job's committed set, dropping the old set's holds."""
    old, job.committed = job.committed, records
    _unhold(tiers, old)


def _unhold(tiers: Tiers, records: list[DiskExtent]) -> None:
    for d in records:
        tiers.unhold(d)


def recover(tiers: Tiers, m: Manifest, quotas: Callable[[str], tuple[int, int]]) -> str:
    """Rebuild a job's last commit after a restart: its tensors on NVMe, its
    extents allocated and held. Returns the log line."""
    if m.job in tiers.jobs:
        raise IntegrityError(f"two commit manifests name job {m.job!r}")
    job = tiers.jobs[m.job] = Job(m.job, m.owner_uid, ephemeral=False)
    job.pool_quota, job.nvme_quota = quotas(m.job)
    for t in m.tensors:
        try:
            tiers.nvme.extents.claim_spans(t.spans)
        except ValueError as exc:
            raise IntegrityError(
                f"commit {m.tag!r} of job {m.job!r}: record of {t.key!r} at {t.offset} "
                f"({t.extent_len} B in {len(t.spans)} extents) cannot be claimed ({exc}); if "
                f"--nvme-size shrank, restart with the old size, else move the job's "
                f"manifest aside") from None
        disk = DiskExtent(t.spans, m.job, t.key, ExtentState.CURRENT)
        disk.hold()
        spec = TensorSpec(t.key, t.dtype, t.shape, t.nbytes)
        tiers.entries[(m.job, t.key)] = Entry(t.key, m.job, spec, t.version,
                                              Residency.ON_NVME, None, disk, dirty=False)
        job.committed.append(disk)
        job.nvme_used += disk.nbytes
        tiers.admission.recovered(job, stored_size(t.key, m.job, t.nbytes))
    job.manifest = m
    return (f"recovered job {m.job!r}: commit {m.tag!r} (#{m.seq}), {len(m.tensors)} tensors, "
            f"{sum(t.nbytes for t in m.tensors)} B")

