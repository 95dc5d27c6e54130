from hypothesis import given, settings, strategies as st

from tierd.backends.extents import PAGE, ExtentAllocator


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE)), max_size=60))
def test_extents_never_overlap_and_coalesce_when_all_freed(ops):
    size = 32 * PAGE
    a = ExtentAllocator(size)
    live: dict[int, int] = {}
    for do_alloc, n in ops:
        if do_alloc or not live:
            off = a.alloc(n)
            if off is None:
                assert a.largest_free() < a.extent_size(n)
                continue
            assert off % PAGE == 0 and off + a.extent_size(n) <= size
            for o, ln in live.items():
                assert off + a.extent_size(n) <= o or o + ln <= off
            live[off] = a.extent_size(n)
        else:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        assert a.used == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.used == 0 and a.largest_free() == size


def test_double_free_is_refused():
    a = ExtentAllocator(4 * PAGE)
    off = a.alloc(1)
    a.free(off)
    try:
        a.free(off)
    except ValueError as exc:
        assert "not allocated" in str(exc)
    else:
        raise AssertionError("double free accepted")


def fragmented(size: int = 64 * PAGE, hole: int = 3 * PAGE) -> ExtentAllocator:
    """Every other ``hole`` free: half the bytes free, no extent over ``hole``."""
    a = ExtentAllocator(size)
    taken = [a.alloc(hole) for _ in range(size // hole)]
    a.alloc(a.largest_free())   # the short tail too
    for off in taken[::2]:
        a.free(off)
    return a


def assert_spans_ok(a: ExtentAllocator, spans, need: int, live: dict[int, int]) -> None:
    assert sum(n for _, n in spans) == need
    for start, n in spans:
        assert start % PAGE == 0 and n % PAGE == 0 and n > 0 and start + n <= a.size
        for o, ln in live.items():
            assert start + n <= o or o + ln <= start, (start, n, o, ln)


def test_a_record_larger_than_any_free_extent_is_placed_when_the_bytes_suffice():
    a = fragmented()
    free = a.free_bytes
    assert a.largest_free() == 3 * PAGE
    assert a.alloc(10 * PAGE) is None              # one extent: refused (first fit, today)
    spans = a.alloc_spans(10 * PAGE)
    assert_spans_ok(a, spans, 10 * PAGE, {})
    assert [n for _, n in spans] == [3 * PAGE] * 3 + [PAGE]   # the fewest extents
    assert a.free_bytes == free - 10 * PAGE
    assert a.alloc_spans(free - 10 * PAGE + 1) is None      # one byte more than is free
    assert a.free_bytes == free - 10 * PAGE                 # and a refusal takes nothing
    a.free_spans(spans)
    assert a.free_bytes == free and a.largest_free() == 3 * PAGE


def test_a_record_that_fits_one_extent_gets_the_smallest_that_fits():
    a = ExtentAllocator(16 * PAGE)
    offs = [a.alloc(PAGE) for _ in range(16)]
    for i in (1, 2, 3, 4, 6, 7, 9, 10, 11):     # free runs of 4, 2 and 3 pages
        a.free(offs[i])
    assert a.alloc_spans(2 * PAGE) == ((6 * PAGE, 2 * PAGE),)
    assert a.alloc_spans(3 * PAGE) == ((9 * PAGE, 3 * PAGE),)
    assert a.alloc_spans(4 * PAGE) == ((PAGE, 4 * PAGE),)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12 * PAGE)), max_size=80))
def test_spans_are_refused_only_when_the_free_bytes_do_not_suffice(ops):
    size = 48 * PAGE
    a = ExtentAllocator(size)
    live: dict[int, int] = {}              # every allocated extent
    records: list[tuple] = []
    for do_alloc, n in ops:
        if do_alloc or not records:
            need = a.extent_size(n)
            fits_one = a.largest_free() >= need
            spans = a.alloc_spans(n)
            if spans is None:
                assert a.free_bytes < need
                continue
            assert_spans_ok(a, spans, need, live)
            assert (len(spans) == 1) == fits_one
            live.update(spans)
            records.append(spans)
        else:
            spans = records.pop(n % len(records))
            a.free_spans(spans)
            for start, _ in spans:
                del live[start]
        assert a.used == sum(live.values())
    for spans in records:
        a.free_spans(spans)
    assert a.used == 0 and a.largest_free() == size


def test_claiming_a_record_takes_all_its_extents_or_none():
    a = ExtentAllocator(16 * PAGE)
    a.claim_spans(((8 * PAGE, 2 * PAGE), (0, PAGE)))
    assert a.used == 3 * PAGE
    try:
        a.claim_spans(((12 * PAGE, PAGE), (9 * PAGE, PAGE)))   # the second is taken
    except ValueError as exc:
        assert "not free" in str(exc)
    else:
        raise AssertionError("an overlapping claim was accepted")
    assert a.used == 3 * PAGE
    a.claim(12 * PAGE, PAGE)      # the first extent of the refused claim was let go
