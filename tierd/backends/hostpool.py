"""The host tier: a byte budget of shared memory, carved into per-job segments.

Each segment is its own memfd. The daemon maps every segment; a client maps
only the segments of its own job, whose file descriptors it receives over the
control socket after the daemon checked its credentials. So a job's bytes are
never in memory another job can map, and there is no named ``/dev/shm`` file to
leak or to open by guessing its name: the kernel frees a segment when the last
mapping and descriptor of it are gone.

[Note: segment lifetime] A segment handed to a client stays mapped in that
client until it disconnects; it can't be revoked. So a segment is never given
to a second job: when a job's segment empties and the budget is needed
elsewhere, the segment is closed and a fresh memfd is made for the next job.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from dataclasses import dataclass, field

from tierd.backends.extents import PAGE, ExtentAllocator, align_up
from tierd.errors import CapacityError

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=/-]")


def available_memory() -> int:
    """MemAvailable from /proc/meminfo in bytes (a large number where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


@dataclass(eq=False)
class Segment:
    """One memfd of the pool, owned by one job, mapped by the daemon."""

    id: int
    job: str
    size: int
    fd: int
    mm: mmap.mmap
    extents: ExtentAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.extents = ExtentAllocator(self.size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[offset:offset + nbytes]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # An I/O thread still holds a view; the mapping goes when it drops it.
            log.warning("segment %d closed while a view was alive", self.id)
        os.close(self.fd)


class HostPool:
    """Shared-memory segments totalling at most ``budget`` bytes.

    >>> pool = HostPool(64 << 20, segment_size=16 << 20)
    >>> seg, off = pool.allocate("job-a", 1000)
    >>> pool.free(seg, off)
    """

    def __init__(self, budget: int, segment_size: int) -> None:
        if budget < PAGE:
            raise CapacityError(f"pool size {budget} B is below one page ({PAGE} B)")
        self.budget = align_up(budget)
        self.segment_size = min(align_up(segment_size), self.budget)
        self.segments: dict[int, Segment] = {}
        self._next_id = 1

    @property
    def mapped_bytes(self) -> int:
        return sum(s.size for s in self.segments.values())

    @property
    def used_bytes(self) -> int:
        return sum(s.extents.used for s in self.segments.values())

    def job_segments(self, job: str) -> list[Segment]:
        return [s for s in self.segments.values() if s.job == job]

    def job_used_bytes(self, job: str) -> int:
        return sum(s.extents.used for s in self.job_segments(job))

    def allocate(self, job: str, nbytes: int, quota: int = 0) -> tuple[Segment, int] | None:
        """A slot of ``nbytes`` in one of ``job``'s segments, growing the job
        by a new segment while the budget (and the job's ``quota`` of used
        bytes, 0 for none) allows; None when full."""
        limit = min(quota or self.budget, self.budget)
        if align_up(max(nbytes, 1)) > limit:
            which = "the job's pool quota" if limit < self.budget else "the pool"
            raise CapacityError(
                f"a tensor of {nbytes} B can never fit in {which} of {limit} B; "
                f"raise it (--pool / quota in the config file)")
        if quota and self.job_used_bytes(job) + align_up(max(nbytes, 1)) > quota:
            return None
        for seg in self.job_segments(job):
            off = seg.extents.alloc(nbytes)
            if off is not None:
                return seg, off
        size = max(min(self.segment_size, limit), align_up(nbytes))
        if self.mapped_bytes + size > self.budget:
            self.release_empty(exclude=None, need=size)
        if self.mapped_bytes + size > self.budget:
            size = align_up(nbytes)  # a last, exact-size segment may still fit
            if self.mapped_bytes + size > self.budget:
                return None
        seg = self._create(job, size)
        return seg, seg.extents.alloc(nbytes)

    def free(self, seg: Segment, offset: int) -> None:
        seg.extents.free(offset)

    def release_empty(self, exclude: str | None, need: int) -> None:
        """Close empty segments (of jobs other than ``exclude``) until ``need``
        bytes of budget are free."""
        for seg in list(self.segments.values()):
            if self.budget - self.mapped_bytes >= need:
                return
            if seg.job != exclude and seg.extents.used == 0:
                self.drop_segment(seg)

    def drop_job(self, job: str) -> None:
        for seg in self.job_segments(job):
            self.drop_segment(seg)

    def drop_segment(self, seg: Segment) -> None:
        del self.segments[seg.id]
        seg.close()

    def close(self) -> None:
        for seg in list(self.segments.values()):
            self.drop_segment(seg)

    def _create(self, job: str, size: int) -> Segment:
        # The name only labels /proc/<pid>/fd links; a job name (perhaps from an
        # old manifest) is reduced to safe characters and cut short, as the
        # kernel refuses NUL and names over 249 bytes.
        label = _UNSAFE.sub("_", job)[:64]
        try:
            fd = os.memfd_create(f"tierd-{label}", os.MFD_CLOEXEC)
        except OSError as exc:
            raise CapacityError(f"cannot create a pool segment: {exc.strerror}; the daemon "
                                f"may be out of file descriptors (raise ulimit -n)") from None
        try:
            os.ftruncate(fd, size)
            # Allocate every page now (prefault), so a full machine fails here
            # with a clear error instead of SIGBUS on first touch later.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise CapacityError(f"cannot allocate a {size} B pool segment: {exc.strerror}; "
                                f"lower --pool or free memory") from None
        seg = Segment(self._next_id, job, size, fd, mm)
        self._next_id += 1
        self.segments[seg.id] = seg
        return seg
