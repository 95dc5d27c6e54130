"""The bench's host profile names where a step's host time goes."""

import time

from tierd.bench.host_profile import host_profile


def _slow():
    time.sleep(0.02)


def _fast():
    return sum(range(10))


def test_the_host_profile_ranks_the_call_that_blocks_first():
    out = host_profile(lambda: (_slow(), _fast()), steps=3, top=5)
    assert out["steps"] == 3 and out["wall_s"] >= 0.02
    name, calls, own_s, _ = out["own"][0]
    assert "sleep" in name and calls == 1 and 0.015 < own_s < 0.2   # per step, not summed
    assert out["tierd_cumulative"] == []   # nothing of tierd's ran


def test_tierds_own_functions_are_ranked_by_cumulative_time():
    from tierd.client.planner import PrefetchPlanner

    def step():
        planner = PrefetchPlanner({i: 1 << 20 for i in range(64)}, 4 << 20, ())
        planner.begin_step()
        for i in range(64):
            planner.on_use(i)

    out = host_profile(step, steps=2, top=50)
    names = [name for name, *_ in out["tierd_cumulative"]]
    assert any(n.startswith("tierd/client/planner.py:") and n.endswith(" on_use") for n in names)
    assert all(n.startswith("tierd/") for n in names)
