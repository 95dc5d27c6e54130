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


def _steps(c, keys: list[str], steps: int, *, plan: bool) -> list[tuple[int, int]]:
    """(bytes read from NVMe, of them read ahead) per step."""
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
        after = c.stats()
        out.append((after["bytes_to_pool"] - before["bytes_to_pool"],
                    after["bytes_read_ahead"] - before["bytes_read_ahead"]))
    return out


def _run(daemon_factory, key_bytes: int, *, plan: bool, steps: int = 4
         ) -> list[tuple[int, int]]:
    d = daemon_factory(pool="8MiB", nvme_size="96MiB", extra=("--segment-size", "4MiB"))
    keys = [f"weights/{i:03d}" for i in range(12 * MiB // key_bytes)]   # 1.5x the pool
    with tierd.connect(d.socket) as c:
        for i, k in enumerate(keys):
            c.put(k, torch.full((key_bytes // 4,), float(i)))
        return _steps(c, keys, steps, plan=plan)


# segment-sized keys (over an eighth of a segment) are evicted a segment at a time
@pytest.mark.parametrize("key_bytes", [256 * KiB, 1 * MiB], ids=["small-keys", "segment-sized-keys"])
def test_a_planned_zigzag_reads_its_misses_ahead_and_no_more_than_without(daemon_factory,
                                                                           key_bytes):
    planned = _run(daemon_factory, key_bytes, plan=True)
    unplanned = _run(daemon_factory, key_bytes, plan=False)
    beyond = 12 * MiB - POOL   # what the pool cannot keep, read again each pass
    for (read, ahead), (lru_read, lru_ahead) in zip(planned[-2:], unplanned[-2:]):
        assert lru_ahead == 0
        # (a read begun in one step may land in the next: a key either way)
        assert read <= lru_read + key_bytes, (planned, unplanned)
        assert 2 * beyond <= read <= 2 * beyond + 2 * key_bytes, (planned, beyond)
        assert ahead >= read - key_bytes, planned   # misses read before their lease asks


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
