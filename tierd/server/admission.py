"""Admission: how many bytes the daemon has promised to keep, and whether a
new tensor still fits in pool + NVMe.

[Note: swap headroom]
Bringing a tensor in from NVMe when the pool is full
means writing a dirty victim out first, so NVMe needs free bytes of the
largest tensor's record (bytes, not one extent: a record may span several,
see [Note: records in several extents] in :mod:`tierd.backends.recordio`;
NVMe copies of tensors also in the pool give way). Admitting at most pool +
NVMe minus the largest tensor keeps that true: everything stored stays
readable. Superseded NVMe records that only a commit still names
(``held_only_bytes``) take room too.

A reserve first *checks* (:meth:`Admission.check`, which changes nothing),
then takes its pool slots, and only then *admits* the grant: a reserve refused
anywhere on the way (a tensor larger than the pool, a full pool) leaves the
accounting as it was, so a refused put never lowers what fits afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierd.errors import CapacityError
from tierd.server.records import Job


@dataclass(frozen=True)
class Grant:
    """What admitting a batch of tensors will change, once they have slots."""

    need: int          # stored bytes they add
    largest: int       # the daemon's largest tensor afterwards
    job_largest: int   # the job's largest tensor afterwards


class Admission:
    """Stored bytes of every tensor held (published or reserved), each counted
    once whichever tiers hold copies, against ``capacity`` = pool + NVMe."""

    def __init__(self, pool_bytes: int, nvme_bytes: int) -> None:
        self.pool_bytes = pool_bytes
        self.nvme_bytes = nvme_bytes
        self.stored_bytes = 0
        self.largest = 0
        self.held_only_bytes = 0   # NVMe records no tensor uses but a commit still names

    def check(self, job: Job, sizes: list[int]) -> Grant:
        """The grant for tensors of ``sizes`` stored bytes, or CapacityError."""
        need = sum(sizes)
        largest = max([self.largest, *sizes])
        limit = self.pool_bytes + self.nvme_bytes - largest - self.held_only_bytes
        if self.stored_bytes + need > limit:
            raise CapacityError(
                f"pool + NVMe full: {self.stored_bytes} B stored, {need} B more asked, "
                f"at most {limit} B fit (pool {self.pool_bytes} B + NVMe {self.nvme_bytes} B, "
                f"less {largest} B kept free for swapping and {self.held_only_bytes} B of "
                f"older versions kept for the last commits); delete tensors, commit, or "
                f"start the daemon with a larger --pool or --nvme-size")
        job_largest = max([job.largest, *sizes])
        if job.pool_quota or job.nvme_quota:
            job_limit = ((job.pool_quota or self.pool_bytes) + (job.nvme_quota or self.nvme_bytes)
                         - job_largest)
            if job.stored_bytes + need > job_limit:
                raise CapacityError(
                    f"job {job.name!r} over quota: {job.stored_bytes} B stored, {need} B more "
                    f"asked, its quotas allow {job_limit} B (pool {job.pool_quota or 'none'}, "
                    f"NVMe {job.nvme_quota or 'none'}, less {job_largest} B for swapping); delete "
                    f"tensors or raise the job's quota in the config file")
        return Grant(need, largest, job_largest)

    def admit(self, job: Job, grant: Grant) -> None:
        """The checked tensors got their slots: count them."""
        self.largest, job.largest = grant.largest, grant.job_largest
        self.add(job, grant.need)

    def add(self, job: Job, size: int) -> None:
        self.stored_bytes += size
        job.stored_bytes += size

    def remove(self, job: Job | None, size: int) -> None:
        """A tensor (or an unpublished reserve) is gone; ``job`` None when the
        job itself is already gone."""
        self.stored_bytes -= size
        if job is not None:
            job.stored_bytes -= size

    def recovered(self, job: Job, size: int) -> None:
        """A committed tensor rebuilt at start; it was admitted before the restart."""
        self.add(job, size)
        job.largest = max(job.largest, size)
        self.largest = max(self.largest, size)
