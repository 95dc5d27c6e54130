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
