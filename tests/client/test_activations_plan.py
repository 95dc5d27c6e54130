"""The ``auto`` planner, driven directly (plain code, no daemon)."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tierd.client.activations_plan import (BlockMode, BlockProfile, choose_plan,
                                           plan_memory, plan_seconds)

K, O, R = BlockMode.KEEP, BlockMode.OFFLOAD, BlockMode.RECOMPUTE
MB = 1 << 20


def _blocks(n: int, saved: int = 100 * MB, inputs: int = 10 * MB, fwd: float = 0.01):
    return [BlockProfile(f"h.{i}", saved, inputs, fwd) for i in range(n)] + \
        [BlockProfile("rest", 50 * MB, 0, 0.002, recomputable=False)]


def test_no_budget_keeps_everything():
    plan = choose_plan(_blocks(4), budget=None, bandwidth=1e9, overlap=True)
    assert plan.modes == (K,) * 5 and plan.extra_s == 0.0 and plan.fits


def test_fast_bus_with_overlap_offloads_for_free():
    # 100 MB at 50 GB/s = 2 ms per block, hidden behind 10 ms of forward each
    blocks = _blocks(4)
    plan = choose_plan(blocks, budget=200 * MB, bandwidth=50e9, overlap=True)
    assert R not in plan.modes and O in plan.modes
    assert plan.extra_s == 0.0 and plan.memory <= 200 * MB


def test_slow_bus_recomputes_instead():
    # 100 MB at 1 GB/s without overlap = 200 ms per block; recompute is 10 ms
    blocks = _blocks(4)
    plan = choose_plan(blocks, budget=200 * MB, bandwidth=1e9, overlap=False)
    assert O not in plan.modes[:4] and R in plan.modes
    assert plan.memory <= 200 * MB


def test_gpt2_13b_on_h200_recomputes_rather_than_offloads():
    """The H200 case (bench/results/...-activations-be71e8a): 24 blocks saving
    1.48 GB each at B=8 with ~3 ms of forward each, 50 GB/s of copies. Half
    the saved bytes must go: offloading them (18 GB each way) cannot hide
    behind 72 ms of forward, recomputing 12 blocks costs ~36 ms."""
    blocks = [BlockProfile(f"h.{i}", saved=1_480_000_000, inputs=16_000_000,
                           forward_s=0.003) for i in range(24)]
    blocks.append(BlockProfile("rest", saved=1_000_000_000, recomputable=False))
    budget = sum(b.saved for b in blocks) // 2
    plan = choose_plan(blocks, budget=budget, bandwidth=50e9, overlap=True)
    assert plan.fits
    moved = sum(b.saved for b, m in zip(blocks, plan.modes) if m is BlockMode.OFFLOAD)
    assert moved / 50e9 <= 24 * 0.003   # only what hides behind the forward
    assert plan.modes.count(BlockMode.RECOMPUTE) >= 11
    assert plan.extra_s < 0.05


def test_offloads_earliest_blocks_and_keeps_the_last():
    blocks = _blocks(4)
    plan = choose_plan(blocks, budget=360 * MB, bandwidth=50e9, overlap=True)
    assert plan.modes[0] is O and plan.modes[3] is K


def test_impossible_budget_gives_the_smallest_plan_and_says_so():
    blocks = _blocks(3)
    plan = choose_plan(blocks, budget=1, bandwidth=1e9, overlap=True)
    assert not plan.fits
    assert plan.memory == min(plan_memory(blocks, list(m)) for m in
                              itertools.product((K, O, R), repeat=3) for m in [(*m, O)])
    assert "does NOT fit" in plan.describe(blocks, 1)


def test_describe_groups_runs():
    blocks = _blocks(4)
    plan = choose_plan(blocks, budget=None, bandwidth=1e9, overlap=True)
    assert "h.0..h.3: keep" in plan.describe(blocks, None)
    assert "rest: keep" in plan.describe(blocks, None)


def test_seconds_model():
    blocks = _blocks(2)
    # CPU: every byte moved out and back costs its time
    assert plan_seconds(blocks, [O, K, K], 1e9, overlap=False) == 2 * 100 * MB / 1e9
    # overlap hides copies up to the forward (out) and 2x it (in)
    assert plan_seconds(blocks, [O, K, K], 1e12, overlap=True) == 0.0
    assert plan_seconds(blocks, [R, R, K], 1e9, overlap=True) == 0.02


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 20),
                          st.floats(0.001, 0.1)), min_size=1, max_size=5),
       st.integers(0, 400), st.floats(1e6, 1e11), st.booleans())
def test_plan_fits_when_any_plan_fits_and_is_near_the_best(specs, budget, bw, overlap):
    blocks = [BlockProfile(f"b{i}", s * MB, min(x, s) * MB, f)
              for i, (s, x, f) in enumerate(specs)]
    budget *= MB
    plan = choose_plan(blocks, budget=budget, bandwidth=bw, overlap=overlap)
    fitting = [(plan_seconds(blocks, list(m), bw, overlap=overlap), m)
               for m in itertools.product((K, O, R), repeat=len(blocks))
               if plan_memory(blocks, list(m)) <= budget]
    assert plan.fits == bool(fitting)
    if fitting:
        assert plan.memory <= budget
        assert plan.extra_s <= min(s for s, _ in fitting) + 1e-9   # the best plan
    greedy = choose_plan(blocks, budget=budget, bandwidth=bw, overlap=overlap,
                         exhaustive_max_blocks=0)
    assert greedy.fits == bool(fitting)          # the greedy search still fits when it can
    if fitting:
        assert greedy.memory <= budget
