"""The host pool's segments, with segments made ahead on threads."""

from __future__ import annotations

import os
import threading

import pytest

from tierd.backends.hostpool import HostPool
from tierd.errors import CapacityError

MiB = 1 << 20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_growing_job_takes_segments_made_ahead_within_the_budget():
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=2)
    try:
        got = []
        for i in range(8):   # 8 segments' worth: the whole budget
            seg, off = pool.allocate("a", 2 * MiB)
            assert pool.mapped_bytes <= pool.budget
            got.append((seg, off))
            # spares while two more segments would still fit beside them
            assert pool.spare_count == (2 if i < 4 else 1 if i == 4 else 0), i
        assert pool.spare_count == 0 and pool.mapped_bytes == pool.budget
        assert len({seg.id for seg, _ in got}) == 8
        assert pool.allocate("a", 2 * MiB) is None   # full: no spare is kept back
    finally:
        pool.close()


def test_fresh_slots_read_zero_and_keep_what_is_written():
    pool = HostPool(8 * MiB, segment_size=2 * MiB, ahead=2)
    try:
        slots = [pool.allocate("a", 2 * MiB) for _ in range(3)]   # two from spares
        for i, (seg, off) in enumerate(slots):
            view = seg.view(off, 2 * MiB)
            assert view.tobytes() == bytes(2 * MiB)
            view[:] = bytes([i + 1]) * (2 * MiB)
        for i, (seg, off) in enumerate(slots):
            assert seg.view(off, 2 * MiB).tobytes() == bytes([i + 1]) * (2 * MiB)
    finally:
        pool.close()


def test_spares_give_way_to_a_large_tensor_and_to_other_jobs():
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=3)
    try:
        pool.allocate("a", MiB)
        assert pool.spare_count == 3 and pool.mapped_bytes == 8 * MiB
        seg, _ = pool.allocate("b", 10 * MiB)   # needs one spare's budget, exact size
        assert seg.size == 10 * MiB and seg.job == "b" and pool.spare_count == 2
        assert pool.mapped_bytes == 16 * MiB
        seg, _ = pool.allocate("c", 2 * MiB)    # a spare, no new budget
        assert seg.job == "c" and pool.spare_count == 1 and pool.mapped_bytes == 16 * MiB
        with pytest.raises(CapacityError, match="can never fit"):
            pool.allocate("c", 17 * MiB)
    finally:
        pool.close()


def test_a_spare_goes_to_whichever_job_grows_next():
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        pool.allocate("a", 2 * MiB)
        assert pool.spare_count == 1
        seg, _ = pool.allocate("b", MiB)
        assert seg.job == "b" and pool.job_segments("a") != pool.job_segments("b")
    finally:
        pool.close()


def test_dropping_jobs_and_closing_give_every_descriptor_back():
    before = _fds()
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=4)
    pool.allocate("a", 3 * MiB)
    pool.drop_job("a")
    pool.release_empty(exclude=None, need=pool.budget)
    assert pool.mapped_bytes == 0 and pool.spare_count == 0
    pool.allocate("a", MiB)
    pool.close()
    assert pool.mapped_bytes == 0
    assert _fds() == before


def test_growth_told_ahead_is_made_as_spares_and_taken_by_the_reserves():
    """[Note: growth told ahead]: 5 MiB of small tensors (3 segments) and a
    5 MiB one (its exact segment) are made before any reserve asks, within
    the room for ``ahead`` more; the reserves then make nothing themselves."""
    before = _fds()
    pool = HostPool(32 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        begun = pool.expect([MiB] * 5 + [5 * MiB + 1])
        large = 5 * MiB + 4096   # page-aligned
        assert begun == 3 * 2 * MiB + large == pool.spare_bytes
        assert pool.spare_count == 3 and pool.mapped_bytes == begun
        seg, _ = pool.allocate("a", 5 * MiB + 1)
        assert seg.size == large and pool.spare_bytes == 3 * 2 * MiB   # the one made ahead
        for _ in range(5):
            pool.allocate("a", MiB)
        # three spares taken; one made ahead again as the job grows (ahead=1)
        assert len(pool.job_segments("a")) == 4 and pool.spare_count == 1
        assert pool.mapped_bytes == large + 4 * 2 * MiB
    finally:
        pool.close()
    assert _fds() == before


def test_growth_told_ahead_stays_within_the_budget_and_gives_way():
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=2)
    try:
        pool.expect([2 * MiB] * 20 + [20 * MiB])   # more than the whole pool
        # spares while two more segments fit beside them; the large one never fits
        assert pool.spare_count == 6 and pool.mapped_bytes == 12 * MiB
        seg, _ = pool.allocate("b", 10 * MiB)   # spares give their budget back
        assert seg.size == 10 * MiB and pool.mapped_bytes <= pool.budget
        assert pool.spare_count == 3
    finally:
        pool.close()
    without = HostPool(16 * MiB, segment_size=2 * MiB, ahead=0)
    try:
        assert without.expect([2 * MiB] * 4) == 0 and without.mapped_bytes == 0
    finally:
        without.close()


def test_ahead_must_not_be_negative():
    with pytest.raises(ValueError, match="ahead=-1"):
        HostPool(8 * MiB, segment_size=2 * MiB, ahead=-1)


@pytest.mark.parametrize("ahead", [0, "threads"])
def test_zero_writes_only_bytes_that_were_used_before(monkeypatch, ahead):
    from tierd.backends import hostpool
    monkeypatch.setattr(hostpool, "POPULATE_PIECE", MiB // 2)   # several pieces a slot
    pool = HostPool(8 * MiB, segment_size=4 * MiB,
                    ahead=hostpool.POPULATE_THREADS if ahead else 0)
    try:
        seg, off = pool.allocate("a", MiB)
        assert pool.zero([(seg, off, MiB)]) == 0           # a new memfd's pages
        seg.view(off, MiB)[:] = b"\x05" * MiB
        pool.free(seg, off)
        again, off2 = pool.allocate("a", MiB + 1)
        assert (again, off2) == (seg, off)                 # the same bytes, used
        _, past = pool.allocate("a", MiB)
        assert past >= off2 + MiB + 1
        seg.view(past, MiB)[:] = b"\x06" * MiB            # its writer's, once handed out
        # one reserve's slots: the used one written (every piece), the fresh one not
        assert pool.zero([(seg, off2, MiB + 1), (seg, past, MiB)]) == MiB + 1
        assert seg.view(off2, MiB + 1).tobytes() == bytes(MiB + 1)
        assert seg.view(past, MiB).tobytes() == b"\x06" * MiB
        assert pool.zeroed_bytes == MiB + 1
    finally:
        pool.close()


@pytest.mark.parametrize("advice", [None, 9999], ids=["populated", "fallback"])
def test_a_segment_larger_than_the_standard_one_is_allocated_by_threads(monkeypatch, advice):
    from tierd.backends import hostpool
    monkeypatch.setattr(hostpool, "POPULATE_PIECE", MiB)   # 5 pieces
    if advice is not None:   # an advice the kernel refuses (EINVAL): fallocate instead
        monkeypatch.setattr(hostpool, "_MADV_POPULATE_WRITE", advice)
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=hostpool.POPULATE_THREADS)
    try:
        seg, off = pool.allocate("a", 5 * MiB - 100)
        assert seg.size == 5 * MiB and off == 0
        assert os.fstat(seg.fd).st_blocks * 512 >= 5 * MiB   # every page allocated
        assert seg.view(0, 5 * MiB).tobytes() == bytes(5 * MiB)
        seg.view(0, 5 * MiB)[:] = b"\x03" * (5 * MiB)
        assert seg.view(0, 5 * MiB).tobytes() == b"\x03" * (5 * MiB)
    finally:
        pool.close()


def _mapped_kib(mm) -> int:
    """Resident KiB of this process's mapping ``mm`` (pages its tables map)."""
    import ctypes
    export = ctypes.c_char.from_buffer(mm)
    start = ctypes.addressof(export)
    del export
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        span = line.split()[0]   # "start-end" on a mapping's first line, "Name:" after
        if not span.endswith(":") and int(span.split("-")[0], 16) == start:
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError("mapping not found")


@pytest.mark.parametrize("ahead, zeroed", [(1, False), (4, True)])
def test_with_threads_to_spare_segments_made_ahead_are_zeroed_by_the_daemon(ahead, zeroed):
    from tierd.backends import hostpool
    assert hostpool.POPULATE_THREADS == 4
    pool = HostPool(64 * MiB, segment_size=2 * MiB, ahead=ahead)
    try:
        pool.allocate("a", 2 * MiB)                # made in the reserve, fallocated
        seg, _ = pool.allocate("b", MiB)           # a spare
        assert seg.job == "b"
        assert _mapped_kib(seg.mm) == (2 * MiB // 1024 if zeroed else 0)
        assert os.fstat(seg.fd).st_blocks * 512 >= 2 * MiB
        assert seg.view(0, 2 * MiB).tobytes() == bytes(2 * MiB)
    finally:
        pool.close()


def _made(pool: HostPool) -> None:
    """Wait until every segment being made ahead is made."""
    for f in list(pool._spares) + [f for q in pool._large.values() for f in q]:
        f.result()


def test_a_job_claims_what_it_expects_once_made_and_fills_it_first():
    """[Note: segments mapped ahead]: a claim hands over the segments made
    for the job's expectation, no more, as empty segments of its own; its
    reserves fill them (a small tensor never splits the large one) and make
    nothing new."""
    pool = HostPool(64 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        pool.expect([MiB] * 6 + [5 * MiB], job="a")   # 3 standard + one of 5 MiB
        _made(pool)
        assert pool.claim("b", 100) == ([], 0)        # another job expected nothing
        got, more = pool.claim("a", 2)                # at most the limit ...
        assert len(got) == 2 and more == 2
        rest, more = pool.claim("a", 100)             # ... then the rest, no more
        got += rest
        assert more == 0 and pool.claim("a", 100) == ([], 0)
        assert sorted(s.size for s in got) == [2 * MiB] * 3 + [5 * MiB]
        assert all(s.job == "a" and s.extents.used == 0 for s in got)
        mapped = pool.mapped_bytes
        small = [pool.allocate("a", MiB)[0] for _ in range(6)]
        big, _ = pool.allocate("a", 5 * MiB)
        assert {s.id for s in small} | {big.id} == {s.id for s in got}
        assert big.size == 5 * MiB
        assert pool.mapped_bytes == mapped   # nothing made for them
    finally:
        pool.close()


def test_claimed_empty_segments_give_way_and_a_forgotten_job_claims_nothing():
    pool = HostPool(8 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        pool.expect([2 * MiB] * 3, job="a")
        _made(pool)
        got, _ = pool.claim("a", 100)
        assert len(got) == 3
        seg, _ = pool.allocate("b", 8 * MiB)    # the whole budget: a's empty ones go
        assert seg.job == "b" and not pool.job_segments("a")
        pool.free(seg, 0)
        pool.expect([2 * MiB] * 2, job="c")
        pool.forget("c")
        _made(pool)
        assert pool.claim("c", 100) == ([], 0)
    finally:
        pool.close()


@pytest.fixture
def gate(monkeypatch):
    """Segments are made only while the returned event is set."""
    from tierd.backends import hostpool
    opened = threading.Event()
    made = hostpool._make_memfd

    def slow(*args, **kwargs):
        opened.wait(10)
        return made(*args, **kwargs)

    monkeypatch.setattr(hostpool, "_make_memfd", slow)
    yield opened
    opened.set()


def test_a_claim_takes_only_segments_already_made(gate):
    """The daemon's loop never waits in a claim: a spare still being made
    is counted as more to come, not waited for."""
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        pool.expect([2 * MiB] * 2, job="a")
        assert pool.claim("a", 100) == ([], 2)
        gate.set()
        _made(pool)
        got, more = pool.claim("a", 100)
        assert len(got) == 2 and more == 0
    finally:
        gate.set()
        pool.close()


def test_a_reserve_is_told_which_segment_being_made_it_would_wait_for(gate):
    """[Note: a reserve waits for its segment off the loop]: the spare among
    the segments a reserve needs beyond the job's free room, or a larger
    tensor's exact segment (begun then), while it is being made; None once
    made, or when the job's segments have the room; the reserve then takes
    what was made without waiting."""
    pool = HostPool(32 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        first = pool.making_for("a", [MiB])     # the job's first segment, begun
        assert first is not None and not first.done()
        gate.set()
        _made(pool)
        assert pool.making_for("a", [MiB]) is None
        pool.allocate("a", MiB)          # takes it; a spare begun
        _made(pool)
        gate.clear()
        pool.allocate("a", MiB)          # the free half: no spare taken
        pool.allocate("a", 2 * MiB)   # the spare; the next one begun, held
        assert pool.making_for("a", [MiB]) is not None          # no room left in "a"
        assert pool.making_for("a", []) is None
        assert pool.making_for("b", [0]) is not None            # a page of a new job's
        large = pool.making_for("a", [5 * MiB])                  # begun for it now
        assert large is not None and not large.done() and pool.spare_bytes == 2 * MiB + 5 * MiB
        assert pool.making_for("a", [5 * MiB]) is large          # not begun twice
        gate.set()
        _made(pool)
        large.result(10)
        assert pool.making_for("a", [MiB, 5 * MiB]) is None
        before = pool.mapped_bytes
        big, _ = pool.allocate("a", 5 * MiB)
        assert big.size == 5 * MiB and pool.mapped_bytes == before   # the one made for it
        assert pool.segment_waits == 0
    finally:
        gate.set()
        pool.close()


def test_a_pool_without_threads_makes_nothing_ahead_for_a_reserve():
    pool = HostPool(16 * MiB, segment_size=2 * MiB)
    try:
        assert pool.making_for("a", [MiB, 5 * MiB]) is None and pool.spare_bytes == 0
    finally:
        pool.close()


def test_a_dropped_segment_is_closed_off_the_callers_thread(monkeypatch):
    """Closing a populated segment frees its pages (seconds for a large job):
    with threads, dropping returns at once and the close runs on its own
    thread; the pool's close waits for it."""
    import threading
    from tierd.backends import hostpool
    gate, closed = threading.Event(), []
    real = hostpool.Segment.close

    def slow(seg):
        gate.wait(10)
        real(seg)
        closed.append(seg.id)

    monkeypatch.setattr(hostpool.Segment, "close", slow)
    before = _fds()
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=1)
    seg, off = pool.allocate("a", MiB)
    pool.free(seg, off)
    pool.drop_job("a")                  # returns while the close waits
    assert not pool.job_segments("a") and closed == []
    gate.set()
    pool.close()
    assert closed == [seg.id] and _fds() == before


def test_the_mapped_bytes_follow_segments_made_dropped_and_given_way():
    """``mapped_bytes`` is a running total ([Note: the catalog's cost on the
    loop] in tierd.server.catalog): after segments of both sizes are made,
    emptied and dropped for another job, and a job dropped, it still equals
    the segments' sizes plus the spares'."""
    pool = HostPool(16 * MiB, segment_size=2 * MiB, ahead=1)
    try:
        def counted() -> int:
            return sum(s.size for s in pool.segments.values()) + pool.spare_bytes

        slots = [pool.allocate("a", MiB) for _ in range(6)]   # three standard segments
        big = pool.allocate("a", 5 * MiB)                       # one of its own size
        assert big is not None and pool.mapped_bytes == counted()
        for seg, off in slots:
            pool.free(seg, off)
        assert pool.allocate("b", 9 * MiB) is not None          # a's empty segments give way
        assert pool.mapped_bytes == counted() <= pool.budget
        pool.drop_job("a")
        assert pool.mapped_bytes == counted()
        pool.drop_job("b")
        assert pool.mapped_bytes == pool.spare_bytes
    finally:
        pool.close()
