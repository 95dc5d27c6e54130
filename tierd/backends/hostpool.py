"""The host tier: a byte budget of shared memory, carved into per-job segments.

Each segment is its own memfd. The daemon maps every segment; a client maps
only the segments of its own job, whose file descriptors it receives over the
control socket after the daemon checked its credentials. So a job's bytes are
never in memory another job can map, and there is no named ``/dev/shm`` file to
leak or to open by guessing its name: the kernel frees a segment when the last
mapping and descriptor of it are gone.

[Note: segment lifetime]
A segment handed to a client stays mapped in that
client until it disconnects; it can't be revoked. So a segment is never given
to a second job: when a job's segment empties and the budget is needed
elsewhere, the segment is closed and a fresh memfd is made for the next job.

[Note: segments made ahead]
Growing the pool costs an allocation and a first touch of every page. The
daemon allocates a new segment's pages at once (``posix_fallocate``; see
``_make_memfd``), about 5 GB/s on one thread on the 2-core CI machine; the
kernel zeroes a page allocated so only at its first touch, in whichever
process touches it first: a client's copy, or its ``cudaHostRegister`` (one
thread in the driver). A first touch is what cost on the H200 host
(``pin_memory()`` 0.5 s/GiB against 0.05 s/GiB registering touched pages;
an 8B attach at ~1 GB/s "bound by first touches"). Done in
the reserve that needs the segment, that ran on the event loop, one segment
after another, while the writing client waited: an attach or an optimizer's
zeroed states (a job growing by hundreds of segments) paid it in series
with its own copies. So while a job grows, the next ``ahead`` segments are
made on threads of their own (one memfd each: fallocates of one memfd take
its inode lock in turn, those of several memfds ran 1.7x one on 2 cores)
and a reserve takes a finished one. A spare was never handed to a client, so
any job may take it ([Note: segment lifetime] holds). Spares count
against the budget (``mapped_bytes``) and are the first thing given back
when the budget is needed; none is made unless ``ahead`` more segments would
still fit (so a pool at its budget does not make and drop them in turn), and
only segments of the standard size are made ahead.
With at least ``POPULATE_THREADS`` threads (cores to spare) the daemon
also zeroes the pages it makes (MADV_POPULATE_WRITE: allocate, zero, map),
so the first touches happen on its threads, ahead, and a client's copy or
registration only maps pages. A larger tensor gets its own exact segment,
made in its reserve: with that many threads its pages are populated by all
of them in 64 MiB pieces (faults of one memfd run in parallel), else
allocated by one fallocate; an 8B Llama's embedding and head (2.1 GB each
in fp32) are such tensors. On the CI machine (2 cores: one thread, so
fallocate) populating ran 1.7 GB/s on one thread and 3.2 GB/s on two,
fallocate 4.7 GB/s, and a client's copy into populated pages was 10 %
faster than into fallocated ones (its page faults cost there, not zeroing).

[Note: growth told ahead]
``ahead`` spares cover a job that grows steadily. A training job's first
step grows it at once: every gradient goes to the pool, then the optimizer
makes its masters and moments (16 B per parameter with AdamW, 21 GB for a
1.3B model), faster than ``ahead`` threads keep up; on the H200 the capped
1.3B's first step waited 2.1 s on leases while the daemon made segments
(`first_step_diag` in the placement bench). The client knows those sizes
when its optimizer is built, before the first forward, and tells the daemon
(:meth:`HostPool.expect`): the standard segments they fill are made ahead
as spares, beyond ``ahead``, and each tensor larger than a segment gets its
exact segment made ahead too, all on the same threads while the forward
runs; a reserve of that size takes it. The budget's rule for spares holds
(room for ``ahead`` more segments besides), and spares are still the first
thing given back when the budget is needed, so an expectation that does not
come true costs nothing but pages the budget allows.

[Note: segments mapped ahead]
Made ahead, a segment still had to be mapped in the client when a lease
first named it: page tables and ``cudaHostRegister``, on the thread waiting
for the lease. On the H200 the capped 1.3B's first step spent 5.3 s of its
5.5 s of lease waits mapping 12.2 GB of segments made ahead (0.43 s/GiB),
inside backward and the first ``step()``. So what a job told ahead is also
handed to it ahead: :meth:`HostPool.claim` gives the job the segments made
for its expectation that are ready now, as empty segments of its own, and
says how many more are being made; the client claims and maps them as they
come, before its first step (``ControlChannel.map_ahead`` in
tierd.client.control, from ``Client.expect``). Before, not during: mapped
on a helper thread during the first forward, the same 16 GB took 10.8 s
and held that forward for as long (the driver registers one range at a
time under a lock each launch and copy of the step also takes), where on
an idle GPU registering costs 0.055 s/GiB and the page tables 0.1 s/GiB
(``tierd.bench.pinning``; ``benchmarks/results/HISTORY.md``).
An empty segment of a job is what the budget gives back first after the
spares (``release_empty``), so a claim keeps no other job out; the job's
reserves then fill the claimed segments first. A segment larger than the
standard one holds only a tensor larger than the standard one (it was made
for one), so small tensors do not split it.

[Note: a reserve waits for its segment off the loop]
A reserve runs on the daemon's event loop. One that needs a new segment
took the oldest spare, and waited for it there when it was still being
made: every other request meanwhile waited too, the control channel's
maps among them. An attach writes in batches, reserving the next ones
while it copies the first, so its first copy waited behind the segments
the next batches' reserves were waiting for (2 cores: the first copy at
0.63 s of a 2.2 s attach, the map that preceded it 0.38-0.57 s instead of
~5 ms; the H200 run at 6f9910a spent 2.76 s of its 5.19 s attach making
segments inside reserves). So before a reserve runs, the daemon asks
:meth:`HostPool.making_for` which segment it would wait for (a spare among
the standard segments it needs beyond the job's free room, or the exact
segment of a larger tensor, begun on the threads then if none is being
made and the budget has room; the standard segments it needs that are
not being made are begun too) and awaits it off the loop, then asks again;
the reserve runs once none is, the session's later requests held behind
it ([Note: a session's requests keep their order] in tierd.server.daemon).
The job's free room is its standard
segments' free bytes, fragmentation aside: a reserve that still finds no
hole takes a spare as before, waiting there if it must.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import time
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

from tierd.backends.extents import PAGE, ExtentAllocator, align_up
from tierd.errors import CapacityError

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._:@+=/-]")


@dataclass(eq=False)
class Segment:
    """One memfd of the pool, owned by one job, mapped by the daemon.

    [Note: zero slots]
    A new memfd's pages are zero, and the extent allocator hands out the
    lowest free extent that fits, so a segment's bytes past the end of the
    highest extent it ever handed out (``touched``) were never written. A
    slot allocated there is zero already: a reserve that asks for zeros
    (the optimizer's first moments, gradients) needs no write for it, by
    the daemon or the client. Only a slot that reuses bytes below
    ``touched`` is written with zeros (:meth:`HostPool.zero`: ``memset`` in
    64 MiB pieces, the reserve's slots at once, on threads of their own
    where the daemon populates on threads; 0.09 s per GB on one thread of the CI machine,
    0.05 on its two).
    """

    id: int
    job: str
    size: int
    fd: int
    mm: mmap.mmap
    #: its pages were zeroed and mapped by the daemon, so a client maps its
    #: page tables too ([Note: mapping a segment with its page tables] in
    #: tierd.client.control); else the first touch zeroes each page
    populated: bool = False
    extents: ExtentAllocator = field(init=False)
    touched: int = field(init=False, default=0)   # end of the highest extent handed out
    _fresh: set[int] = field(init=False, default_factory=set)   # live extents past it when made

    def __post_init__(self) -> None:
        self.extents = ExtentAllocator(self.size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.mm)[offset:offset + nbytes]

    def handed_out(self, offset: int, nbytes: int) -> None:
        """The allocator gave ``[offset, offset + nbytes)`` out; note whether
        its bytes are still the memfd's zeros."""
        if offset >= self.touched:
            self._fresh.add(offset)
        self.touched = max(self.touched, offset + self.extents.extent_size(nbytes))

    def returned(self, offset: int) -> None:
        self._fresh.discard(offset)

    def used_before(self, offset: int) -> bool:
        """Whether the slot just handed out at ``offset`` may hold bytes
        written before (else it still reads the memfd's zeros); asked once:
        whoever has the slot writes it from then on."""
        if offset in self._fresh:
            self._fresh.discard(offset)
            return False
        return True

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # An I/O thread still holds a view; the mapping goes when it drops it.
            log.warning("segment %d closed while a view was alive", self.id)
        os.close(self.fd)


_MADV_POPULATE_READ = 22    # Linux 5.14
_MADV_POPULATE_WRITE = 23
POPULATE_PIECE = 64 << 20
#: MADV_POPULATE_WRITE on one thread allocated 1.7 GB/s on the CI machine,
#: fallocate 4.7 GB/s, two threads 3.2 GB/s: so this many threads at least
POPULATE_THREADS = 4


def populate_pages(mm: mmap.mmap, size: int, threads: ThreadPoolExecutor | None = None, *,
             write: bool = True) -> None:
    """Fill the page tables of mapping ``mm`` (its first ``size`` bytes),
    in pieces on ``threads`` (page faults of one memfd run in parallel,
    where fallocates of it take its inode lock in turn), or on this thread,
    without the GIL. ``write``: MADV_POPULATE_WRITE, which also allocates and
    zeroes pages not there yet; else MADV_POPULATE_READ, which maps the
    pages that are (read faults of a shared mapping: each maps the ready
    pages around it), what ``MAP_POPULATE`` does but with the GIL let go.
    OSError as fallocate's would be (ENOMEM; EINVAL before Linux 5.14)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    export = ctypes.c_char.from_buffer(mm)   # the address; let go before the mapping closes
    base = ctypes.addressof(export)

    def piece(offset: int) -> None:
        # ctypes lets go of the GIL for the call
        if libc.madvise(base + offset, min(POPULATE_PIECE, size - offset), advice) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    try:
        if threads is None:
            for at in range(0, size, POPULATE_PIECE):
                piece(at)
            return
        pieces = [threads.submit(piece, at) for at in range(0, size, POPULATE_PIECE)]
        for p in pieces:
            p.exception()   # all of them done before the export goes
        for p in pieces:
            p.result()
    finally:
        del export


def _write_zeros(mm: mmap.mmap, offset: int, nbytes: int) -> None:
    """``memset`` bytes of ``mm`` to zero; ctypes lets go of the GIL for it."""
    export = (ctypes.c_char * nbytes).from_buffer(mm, offset)
    try:
        ctypes.memset(export, 0, nbytes)
    finally:
        del export


def _make_memfd(label: str, size: int, populate: bool = False,
                threads: ThreadPoolExecutor | None = None) -> tuple[int, mmap.mmap, bool]:
    """A memfd of ``size`` bytes with every page allocated, its mapping, and
    whether its pages were zeroed: with ``populate`` they are, now
    (:func:`populate_pages`, on ``threads`` or this one), else they are allocated
    by one ``posix_fallocate``, which leaves the zeroing to the first touch,
    in a client.

    Allocating now (prefaulting) makes a full machine fail here with a clear
    error instead of SIGBUS at a first touch later. Runs on the preparing
    threads too: the calls it makes release the GIL.
    """
    try:
        fd = os.memfd_create(label, os.MFD_CLOEXEC)
    except OSError as exc:
        raise CapacityError(f"cannot create a pool segment: {exc.strerror}; the daemon "
                            f"may be out of file descriptors (raise ulimit -n)") from None
    mm = None
    try:
        os.fchmod(fd, 0o600)   # a memfd is 0777 whatever the umask: [Note: group access]
        os.ftruncate(fd, size)
        if not populate:
            os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if populate:
            try:
                populate_pages(mm, size, threads)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.posix_fallocate(fd, 0, size)   # a kernel without MADV_POPULATE_WRITE
                populate = False
    except OSError as exc:
        if mm is not None:
            mm.close()
        os.close(fd)
        raise CapacityError(f"cannot allocate a {size} B pool segment: {exc.strerror}; "
                            f"lower --pool or free memory") from None
    return fd, mm, populate


def _close_memfd(made: Future) -> None:
    """Close a spare's memfd once made (or forget it if it was never made)."""
    if made.cancel():
        return
    try:
        fd, mm, _ = made.result()
    except CapacityError:
        return
    mm.close()
    os.close(fd)


class HostPool:
    """Shared-memory segments totalling at most ``budget`` bytes.

    ``ahead`` > 0 makes up to that many standard segments ahead on threads
    while jobs grow ([Note: segments made ahead]); 0 makes each in the
    reserve that needs it.

    >>> pool = HostPool(64 << 20, segment_size=16 << 20)
    >>> seg, off = pool.allocate("job-a", 1000)
    >>> pool.free(seg, off)
    """

    def __init__(self, budget: int, segment_size: int, ahead: int = 0) -> None:
        if budget < PAGE:
            raise CapacityError(f"pool size {budget} B is below one page ({PAGE} B)")
        if ahead < 0:
            raise ValueError(f"ahead={ahead}: the number of segments made ahead is >= 0")
        self.budget = align_up(budget)
        self.segment_size = min(align_up(segment_size), self.budget)
        self.segments: dict[int, Segment] = {}
        self._segment_bytes = 0   # sum of their sizes, kept as they come and go
        self._next_id = 1
        self.ahead = ahead
        self._spares: deque[Future] = deque()   # (fd, mmap) of standard segments, oldest first
        #: standard segments jobs said they will take soon ([Note: growth told ahead])
        self._wanted = 0
        #: of those, and of the larger ones (by size), what each job may still
        #: claim ([Note: segments mapped ahead])
        self._expected: dict[str, int] = {}
        self._expected_large: dict[str, dict[int, int]] = {}
        self._large: dict[int, deque[Future]] = {}   # larger segments made ahead, by size
        self._preparer = (ThreadPoolExecutor(ahead, thread_name_prefix="tierd-pool")
                          if ahead else None)
        # a segment larger than the standard one is made in its reserve, by
        # these threads when there are enough to beat one fallocate
        self._populate = ahead >= POPULATE_THREADS   # zero pages here, on threads
        self._populaters = (ThreadPoolExecutor(ahead, thread_name_prefix="tierd-populate")
                            if self._populate else None)
        # zeroes reused slots ([Note: zero slots]); its own, so that a
        # reserve does not queue behind the growth made ahead
        self._zeroers = (ThreadPoolExecutor(ahead, thread_name_prefix="tierd-zero")
                         if self._populate else None)
        # closing a populated segment frees its pages, ~0.02 s/GiB on the H200
        # host: a 60 GB job's end held the daemon's loop past a client's
        # 2 s handshake, so with threads the closes run on one of their own
        self._closer = (ThreadPoolExecutor(1, thread_name_prefix="tierd-pool-close")
                        if ahead else None)
        #: seconds reserves spent making segments or waiting for spares: time
        #: the daemon answered nothing else, and a writing client waited
        self.segment_wait_s = 0.0
        #: segments a reserve made, or waited for while they were made, on
        #: its own thread ([Note: a reserve waits for its segment off the
        #: loop]: the daemon's reserves wait before they run)
        self.segment_waits = 0
        #: bytes reserves asked to read zero that were used before, and the
        #: seconds writing their zeros held the daemon's loop ([Note: zero slots])
        self.zeroed_bytes = 0
        self.zero_s = 0.0

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the budget in segments: the jobs' and the spares made ahead."""
        # a running total: allocation asks this for each segment it might
        # drop, and a sum over ~400 segments each time cost a 113 GB pool's
        # daemon seconds a step ([Note: the catalog's cost on the loop])
        return self._segment_bytes + self.spare_bytes

    @property
    def spare_bytes(self) -> int:
        """Bytes of the segments made (or being made) ahead, not yet any job's."""
        return (len(self._spares) * self.segment_size
                + sum(size * len(q) for size, q in self._large.items()))

    @property
    def spare_count(self) -> int:
        """Segments made (or being made) ahead, not yet any job's."""
        return len(self._spares)

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
        large = align_up(max(nbytes, 1)) > self.segment_size
        for seg in self.job_segments(job):
            if seg.size > self.segment_size and not large:
                continue   # made for one large tensor: [Note: segments mapped ahead]
            off = seg.extents.alloc(nbytes)
            if off is not None:
                seg.handed_out(off, nbytes)
                return seg, off
        size = max(min(self.segment_size, limit), align_up(nbytes))
        if self.mapped_bytes - self._spare_bytes(size) + size > self.budget:
            self.release_empty(exclude=None, need=size)
        if self.mapped_bytes - self._spare_bytes(size) + size > self.budget:
            size = align_up(nbytes)  # a last, exact-size segment may still fit
            if self.mapped_bytes + size > self.budget:
                self.release_empty(exclude=None, need=size)
            if self.mapped_bytes + size > self.budget:
                return None
        seg = self._create(job, size)
        self._prepare()
        off = seg.extents.alloc(nbytes)
        seg.handed_out(off, nbytes)
        return seg, off

    def zero(self, slots: list[tuple[Segment, int, int]]) -> int:
        """Make the slots just handed out, ``(segment, offset, nbytes)`` each,
        read zeros; the bytes that took a write ([Note: zero slots])."""
        dirty = [(seg, off, n) for seg, off, n in slots if n and seg.used_before(off)]
        if not dirty:
            return 0
        began = time.perf_counter()
        pieces = [(seg.mm, at, min(POPULATE_PIECE, off + n - at))
                  for seg, off, n in dirty for at in range(off, off + n, POPULATE_PIECE)]
        if self._zeroers is None or len(pieces) == 1:
            for piece in pieces:
                _write_zeros(*piece)
        else:
            done = [self._zeroers.submit(_write_zeros, *piece) for piece in pieces]
            for d in done:
                d.exception()   # every piece ended before any error is raised
            for d in done:
                d.result()
        written = sum(n for _, _, n in dirty)
        self.zeroed_bytes += written
        self.zero_s += time.perf_counter() - began
        return written

    def _spare_bytes(self, size: int) -> int:
        """Budget a new segment of ``size`` takes from the spares: one spare's,
        when there is one of its size."""
        if size == self.segment_size:
            return self.segment_size if self._spares else 0
        return size if self._large.get(size) else 0

    def free(self, seg: Segment, offset: int) -> None:
        seg.extents.free(offset)
        seg.returned(offset)

    def release_empty(self, exclude: str | None, need: int) -> None:
        """Close spares, then empty segments (of jobs other than ``exclude``),
        until ``need`` bytes of budget are free."""
        for q in self._large.values():
            while q and self.budget - self.mapped_bytes < need:
                self._off_loop(_close_memfd, q.pop())
        while self._spares and self.budget - self.mapped_bytes < need:
            self._off_loop(_close_memfd, self._spares.pop())   # the newest: perhaps not begun
        if self.budget - self.mapped_bytes >= need:
            return
        for seg in [s for s in self.segments.values() if s.job != exclude and s.extents.used == 0]:
            self.drop_segment(seg)
            if self.budget - self.mapped_bytes >= need:
                return

    def drop_job(self, job: str) -> None:
        for seg in self.job_segments(job):
            self.drop_segment(seg)

    def drop_segment(self, seg: Segment) -> None:
        del self.segments[seg.id]
        self._segment_bytes -= seg.size
        self._off_loop(seg.close)

    def _off_loop(self, close, *args) -> None:
        """Run a close that frees pages on the closing thread, if there is one."""
        if self._closer is None:
            close(*args)
        else:
            self._closer.submit(close, *args)

    def close(self) -> None:
        while self._spares:
            _close_memfd(self._spares.pop())
        for q in self._large.values():
            while q:
                _close_memfd(q.pop())
        for threads in (self._preparer, self._populaters, self._zeroers, self._closer):
            if threads is not None:
                threads.shutdown(wait=True)
        self._closer = None   # the rest close here
        for seg in list(self.segments.values()):
            self.drop_segment(seg)

    def expect(self, sizes, job: str | None = None) -> int:
        """A job will store tensors of ``sizes`` bytes soon ([Note: growth
        told ahead]): begin making the segments they need as spares, within
        the budget's room; the bytes begun (0 without threads, ``ahead`` 0).
        With ``job``, that job may claim them once made ([Note: segments
        mapped ahead])."""
        if self._preparer is None:
            return 0
        before, small = self.spare_bytes, 0
        for n in sizes:
            n = align_up(max(int(n), 1))
            if n <= self.segment_size:
                small += n
            elif self._room_ahead(n):
                self._large.setdefault(n, deque()).append(self._preparer.submit(
                    _make_memfd, "tierd-pool", n, self._populate, self._populaters))
                if job is not None:
                    large = self._expected_large.setdefault(job, {})
                    large[n] = large.get(n, 0) + 1
        standard = -(-small // self.segment_size)
        self._wanted += standard
        if job is not None and standard:
            self._expected[job] = self._expected.get(job, 0) + standard
        self._prepare()
        return self.spare_bytes - before

    def making_for(self, job: str, sizes: Iterable[int]) -> Future | None:
        """A segment being made that a reserve of tensors of ``sizes`` bytes
        for ``job`` would wait for, or None ([Note: a reserve waits for its
        segment off the loop]). The segments it needs that are not being
        made yet are begun now, on the threads, where the budget has room
        for them and ``ahead`` more: the standard ones beyond the job's free
        room, and a larger tensor's exact one where the job has no empty one
        of its size (claimed: [Note: segments mapped ahead])."""
        if self._preparer is None:
            return None
        sizes = [align_up(max(int(n), 1)) for n in sizes]
        small = sum(n for n in sizes if n <= self.segment_size)
        large = [n for n in sizes if n > self.segment_size]
        if not large and (not small or (len(self._spares) * self.segment_size >= small
                                        and all(f.done() for f in self._spares))):
            return None   # made spares cover it, whatever the job's room
        free, empty = 0, Counter()
        for seg in self.job_segments(job):
            if seg.size == self.segment_size:
                free += seg.size - seg.extents.used
            elif not seg.extents.used:
                empty[seg.size] += 1
        for n in large:
            if empty[n]:
                empty[n] -= 1
                continue
            q = self._large.get(n)
            if not q and self._room_ahead(n):
                q = self._large.setdefault(n, deque())
                q.append(self._preparer.submit(_make_memfd, "tierd-pool", n, self._populate,
                                               self._populaters))
            if q and not q[0].done():
                return q[0]
        need = -(-max(0, small - free) // self.segment_size)
        while len(self._spares) < need and self._room_ahead(self.segment_size):
            self._spares.append(self._preparer.submit(_make_memfd, "tierd-pool",
                                                      self.segment_size, self._populate))
        return next((f for f in islice(self._spares, need) if not f.done()), None)

    def claim(self, job: str, limit: int) -> tuple[list[Segment], int]:
        """The segments made for what ``job`` expects ([Note: segments mapped
        ahead]) that are ready now, at most ``limit``, made the job's (empty),
        and how many more it may claim (0: none is being made for it)."""
        got = []
        for size, count in list(self._expected_large.get(job, {}).items()):
            q = self._large.get(size)
            while count and q and q[0].done() and len(got) < limit:
                got.append(self._create(job, size))
                count -= 1
                q = self._large.get(size)
        while (self._expected.get(job, 0) and self._spares and self._spares[0].done()
               and len(got) < limit):
            got.append(self._create(job, self.segment_size))
        if got:
            self._prepare()
        more = min(self._expected.get(job, 0), len(self._spares)) + sum(
            min(n, len(self._large.get(size, ()))) for size, n in
            self._expected_large.get(job, {}).items())
        return got, more

    def forget(self, job: str) -> None:
        """A job gone: nothing more is made or claimed for it."""
        self._wanted = max(0, self._wanted - self._expected.pop(job, 0))
        self._expected_large.pop(job, None)

    def _room_ahead(self, size: int) -> bool:
        """Whether a spare of ``size`` leaves the budget room for ``ahead``
        more segments besides: a pool near its budget (spilling to NVMe)
        would give each spare back soon after making it."""
        return self.mapped_bytes + size + self.ahead * self.segment_size <= self.budget

    def _prepare(self) -> None:
        """Begin making spares up to ``ahead``, or the standard segments jobs
        said they will take ([Note: growth told ahead]), within the room."""
        while (len(self._spares) < max(self.ahead, self._wanted)
               and self._room_ahead(self.segment_size)):
            self._spares.append(self._preparer.submit(_make_memfd, "tierd-pool",
                                                      self.segment_size, self._populate))

    def _take_spare(self) -> tuple[int, mmap.mmap, bool] | None:
        """The oldest spare (waiting for it to be made), or None: none, or
        making it failed (the caller makes one itself and reports why)."""
        if not self._spares:
            return None
        try:
            return self._spares.popleft().result()
        except CapacityError as exc:
            log.warning("a pool segment made ahead failed (%s); making it in the reserve", exc)
            return None

    def _take_large(self, size: int) -> tuple[int, mmap.mmap, bool] | None:
        """A segment of ``size`` made ahead ([Note: growth told ahead]), or None."""
        q = self._large.get(size)
        if not q:
            return None
        made = q.popleft()
        if not q:
            del self._large[size]
        try:
            return made.result()
        except CapacityError as exc:
            log.warning("a pool segment made ahead failed (%s); making it in the reserve", exc)
            return None

    def _create(self, job: str, size: int) -> Segment:
        began = time.perf_counter()
        q = self._spares if size == self.segment_size else self._large.get(size, ())
        done = bool(q) and q[0].done()
        if size == self.segment_size:
            made = self._take_spare()
            self._wanted = max(0, self._wanted - 1)
            if self._expected.get(job):
                self._expected[job] -= 1
        else:
            made = self._take_large(size)
            expected = self._expected_large.get(job, {})
            if expected.get(size):
                expected[size] -= 1
                if not expected[size]:
                    del expected[size]
        if made is None or not done:
            self.segment_waits += 1
        if made is None:
            # The name only labels /proc/<pid>/fd links; a job name (perhaps from
            # an old manifest) is reduced to safe characters and cut short, as the
            # kernel refuses NUL and names over 249 bytes.
            big = self._populate and size > self.segment_size
            made = _make_memfd(f"tierd-{_UNSAFE.sub('_', job)[:64]}", size, big,
                               self._populaters if big else None)
        self.segment_wait_s += time.perf_counter() - began
        fd, mm, populated = made
        seg = Segment(self._next_id, job, size, fd, mm, populated)
        self._next_id += 1
        self.segments[seg.id] = seg
        self._segment_bytes += seg.size
        return seg
