"""Reads ahead by a job's access plan ([Note: the job's access plan] in
tierd.server.readahead): a real daemon, and what a client streaming frozen
weights through a pool smaller than them asks of it: the forward leases
each unit in order, the backward in reverse, one at a time."""

from __future__ import annotations

import pytest
import torch

import tierd
from tierd.errors import ProtocolError
from tierd.server.readahead import AccessPlan

KiB, MiB = 1 << 10, 1 << 20
POOL = 8 * MiB


def _zigzag(n: int) -> list[int]:
    return list(range(n)) + list(range(n - 1, -1, -1))


def _steps(c, keys: list[str], steps: int, *, plan: bool,
           state: bool = False) -> list[tuple[int, int, int]]:
    """(bytes read from NVMe, of them read ahead, bytes written to NVMe) per
    step; ``state``: a 512 KiB tensor no plan names is stored anew each step
    (an optimizer's), as well."""
    order = _zigzag(len(keys))
    if plan:
        c.use_plan_async("m", [(keys[u],) for u in order])
    out, at = [], 0
    for _ in range(steps):
        before = c.stats()
        for u in order:
            if plan:
                c.use_at_async("m", at)
            at += 1
            got = c.lease([keys[u]])
            assert float(got[0].tensor[0]) == u, keys[u]
            c.release([keys[u]])
        if state:
            c.put("state", torch.full((128 * KiB,), float(at)))
        after = c.stats()
        out.append((after["bytes_to_pool"] - before["bytes_to_pool"],
                    after["bytes_read_ahead"] - before["bytes_read_ahead"],
                    after["bytes_to_nvme"] - before["bytes_to_nvme"]))
    return out


def _run(daemon_factory, key_bytes: int, *, plan: bool, steps: int = 4, nvme: str = "96MiB",
         state: bool = False) -> list[tuple[int, int, int]]:
    d = daemon_factory(pool="8MiB", nvme_size=nvme, extra=("--segment-size", "4MiB"))
    keys = [f"weights/{i:03d}" for i in range(12 * MiB // key_bytes)]   # 1.5x the pool
    with tierd.connect(d.socket) as c:
        for i, k in enumerate(keys):
            c.put(k, torch.full((key_bytes // 4,), float(i)))
        got = _steps(c, keys, steps, plan=plan, state=state)
        for i, k in enumerate(keys):
            assert float(c.get(k)[0]) == i, k
        return got


# segment-sized keys (over an eighth of a segment) are evicted a segment at a time
@pytest.mark.parametrize("key_bytes", [256 * KiB, 1 * MiB], ids=["small-keys", "segment-sized-keys"])
def test_a_planned_zigzag_reads_its_misses_ahead_and_no_more_than_without(daemon_factory,
                                                                           key_bytes):
    planned = _run(daemon_factory, key_bytes, plan=True)
    unplanned = _run(daemon_factory, key_bytes, plan=False)
    beyond = 12 * MiB - POOL   # what the pool cannot keep, read again each pass
    for (read, ahead, _), (lru_read, lru_ahead, _) in zip(planned[-2:], unplanned[-2:]):
        assert lru_ahead == 0
        # (a read begun in one step may land in the next: a key either way)
        assert read <= lru_read + key_bytes, (planned, unplanned)
        assert 2 * beyond <= read <= 2 * beyond + 2 * key_bytes, (planned, beyond)
        assert ahead >= read - key_bytes, planned   # misses read before their lease asks


def test_read_ahead_passes_say_how_far_they_reached_and_why_they_stopped(daemon_factory):
    """The counters a slow step is diagnosed with: one pass per use told,
    how far its horizon reached, and why passes stopped short of it."""
    d = daemon_factory(pool="8MiB", nvme_size="96MiB", extra=("--segment-size", "4MiB"))
    keys = [f"weights/{i:03d}" for i in range(48)]   # 256 KiB each: 1.5x the pool
    with tierd.connect(d.socket) as c:
        for i, k in enumerate(keys):
            c.put(k, torch.full((64 * KiB,), float(i)))
        before = c.stats()
        _steps(c, keys, 2, plan=True)
        after = c.stats()
    passes = after["read_ahead_passes"] - before["read_ahead_passes"]
    assert passes == 2 * 2 * len(keys)
    # the pool holds about 32 of the keys: horizons reach well past now
    assert 8 * passes <= after["read_ahead_reach"] - before["read_ahead_reach"] <= 48 * passes
    stops = {k: after[k] - before[k] for k in ("read_ahead_no_room", "read_ahead_waits")}
    # each stop ends a pass, and here the room the misses need is held by
    # reads begun earlier, not missing: the passes stop to wait, never for want of room
    assert 0 < stops["read_ahead_waits"] < passes and stops["read_ahead_no_room"] == 0, stops


@pytest.mark.parametrize("key_bytes", [256 * KiB, 1 * MiB], ids=["small-keys", "segment-sized-keys"])
def test_reading_ahead_through_a_file_the_size_of_the_spill_writes_nothing(daemon_factory,
                                                                           key_bytes):
    """[Note: what reading ahead writes]: the weights are read-only, so a
    step need write nothing but the state; Belady's order alone wrote 4 MiB
    of weights a step here, whose NVMe copies the file had no room to keep."""
    nvme = "8MiB"   # the 4 MiB the pool cannot hold, its slack, little more
    planned = _run(daemon_factory, key_bytes, plan=True, steps=5, nvme=nvme, state=True)
    unplanned = _run(daemon_factory, key_bytes, plan=False, steps=5, nvme=nvme, state=True)
    for (read, ahead, written), (lru_read, _, _) in zip(planned[-3:], unplanned[-3:]):
        assert written <= 512 * KiB, planned           # at most the state
        assert read <= lru_read + 4 * key_bytes, (planned, unplanned)
        assert ahead >= read // 2, planned


def test_a_plan_naming_keys_that_do_not_exist_is_only_a_hint(daemon):
    with tierd.connect(daemon.socket) as c:
        c.put("real", torch.ones(4))
        c.use_plan_async("m", [("missing",), ("real",)])
        c.use_at_async("m", 0)
        c.use_at_async("m", 5)
        c.use_at_async("m", 1)   # a count that restarts
        c.use_at_async("other", 1)   # no such plan
        c.use_plan_async("m", [])   # forgotten
        c.use_at_async("m", 2)
        assert torch.equal(c.get("real"), torch.ones(4))
        stats = c.stats()
    # the three uses of the plan while it was known each ran a read-ahead pass
    assert stats["read_ahead_passes"] == 3 and stats["read_ahead_reach"] >= 0
    assert stats["read_ahead_no_room"] == stats["read_ahead_waits"] == 0


@pytest.mark.parametrize("positions,why", [
    ([["k"] * 3] * 30_000, "more than"),   # over the keys a request may carry
    ([[""]], "non-empty"),
    ([[1]], "key"),
])
def test_a_malformed_plan_is_refused_and_the_connection_stays_usable(daemon, positions, why):
    with tierd.connect(daemon.socket) as c:
        c.put("kept", torch.ones(2))
        with pytest.raises(ProtocolError, match=why):
            c.use_plan_async("m", positions).result()
        assert torch.equal(c.get("kept"), torch.ones(2))


def test_an_empty_plan_is_refused_where_it_is_built():
    with pytest.raises(ValueError, match="at least one position"):
        AccessPlan([])
