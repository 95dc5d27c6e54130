"""The prefetch planner on its own: learn, follow, diverge, re-learn."""

from __future__ import annotations

from hypothesis import given, strategies as st

from tierd.client.planner import PlanState, PrefetchPlanner

SIZES = {i: 10 for i in range(8)}


def test_learns_in_the_first_step_then_prefetches_within_depth():
    p = PrefetchPlanner(SIZES, depth_bytes=25)
    assert p.begin_step() == []
    assert [p.on_use(u) for u in (0, 1, 2, 3)] == [[], [], [], []]
    assert p.begin_step() == [0, 1]          # 20 bytes fit in 25
    assert p.on_use(0) == [2]
    assert p.on_use(1) == [3]
    assert p.on_use(2) == []                 # nothing left in the trace
    assert p.on_use(3) == []
    assert p.begin_step() == [0, 1] and p.steps_followed == 1


def test_divergence_stops_prefetch_and_relearns():
    p = PrefetchPlanner(SIZES, depth_bytes=100)
    p.begin_step()
    for u in (0, 1, 2):
        p.on_use(u)
    p.begin_step()
    p.on_use(0)
    assert p.on_use(2) == [] and p.state is PlanState.DIVERGED
    assert p.on_use(1) == []
    assert p.begin_step() == [0, 2, 1]       # the new order is the new trace
    assert p.trace == (0, 2, 1)


def test_a_step_that_ends_early_counts_as_divergence():
    p = PrefetchPlanner(SIZES, depth_bytes=100)
    p.begin_step()
    for u in (0, 1, 2):
        p.on_use(u)
    p.begin_step()
    p.on_use(0)
    p.begin_step()
    assert p.divergences == 1 and p.trace == (0,)


def test_repeated_units_are_announced_per_position():
    p = PrefetchPlanner(SIZES, depth_bytes=20)
    p.begin_step()
    for u in (0, 1, 0, 1):      # e.g. a module called twice
        p.on_use(u)
    assert p.begin_step() == [0, 1]
    assert p.on_use(0) == [0]
    assert p.on_use(1) == [1]


@given(st.lists(st.integers(0, 7), max_size=30), st.lists(st.integers(0, 7), max_size=30),
       st.integers(0, 100))
def test_announcements_are_always_units_of_the_trace_ahead(first, second, depth):
    p = PrefetchPlanner(SIZES, depth_bytes=depth)
    p.begin_step()
    for u in first:
        p.on_use(u)
    announced = p.begin_step()
    for u in second:
        announced += p.on_use(u)
    trace = list(first)
    assert len(announced) <= len(trace)
    assert announced == trace[:len(announced)]   # in order, each position once


def test_a_unit_new_to_the_trace_joins_it_without_a_divergence():
    # [Note: units new to the trace]: a unit placement streams again after
    # the trace was learned without it
    p = PrefetchPlanner(SIZES, depth_bytes=20, trace=(0, 2, 2, 0))
    assert p.begin_step() == [0, 2]
    assert p.on_use(0) == [2]
    assert p.on_use(1) == [] and p.state is PlanState.FOLLOWING   # fetched on demand
    assert p.on_use(2) == [0]
    assert p.on_use(2) == [] and p.on_use(1) == [] and p.on_use(0) == []
    assert p.divergences == 0
    assert p.begin_step() == [0, 1] and p.steps_followed == 1
    assert p.trace == (0, 1, 2, 2, 1, 0)


def test_a_known_unit_out_of_order_still_diverges():
    p = PrefetchPlanner(SIZES, depth_bytes=20, trace=(0, 2))
    p.begin_step()
    p.on_use(1)   # new: followed on
    assert p.on_use(2) == [] and p.state is PlanState.DIVERGED
    p.begin_step()
    assert p.trace == (1, 2) and p.divergences == 1
