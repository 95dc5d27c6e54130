"""Eviction by next use ([Note: eviction by next use] in tierd.server.eviction):
a real daemon whose pool is smaller than a working set touched in the same
order every step, as training does."""

from __future__ import annotations

import pytest
import torch

import tierd
from tierd.errors import UnknownKey

KEYS = [f"state/{i:02d}" for i in range(48)]   # 48 x 256 KiB = 12 MiB through an 8 MiB pool


def _bytes_read_per_cycle(c, *, demote: bool, cycles: int = 4) -> float:
    read = []
    for _ in range(cycles):
        before = c.stats()["bytes_to_pool"]
        for k in KEYS:          # one "update": read, change in place, write back
            (view,) = c.lease([k], write=True)
            view.tensor.add_(1)
            c.release([k], written=True)
            if demote:
                c.demote_async([k]).result()
        read.append(c.stats()["bytes_to_pool"] - before)
    return sum(read[1:]) / (cycles - 1)   # the first cycle fills the pool


@pytest.mark.parametrize("demote", [False, True])
def test_demoted_state_cycles_only_what_the_pool_cannot_hold(daemon_factory, demote):
    d = daemon_factory(pool="8MiB", nvme_size="64MiB", extra=("--segment-size", "4MiB"))
    with tierd.connect(d.socket) as c:
        for k in KEYS:
            c.put(k, torch.zeros(1 << 16))
        per_cycle = _bytes_read_per_cycle(c, demote=demote)
        for k in KEYS:
            assert torch.equal(c.get(k), torch.full((1 << 16,), 4.0)), k
    working_set = 48 * (256 << 10)
    if demote:
        # only what exceeds the pool (4 MiB, and the slack eviction keeps) comes back
        assert per_cycle < 0.5 * working_set
    else:
        # least recently used: the tensor used longest ago is the next one needed
        assert per_cycle >= 0.9 * working_set


def test_demote_names_unknown_keys_and_changes_nothing(daemon):
    with tierd.connect(daemon.socket) as c:
        c.put("a", torch.ones(4))
        with pytest.raises(UnknownKey, match="nope"):
            c.demote_async(["a", "nope"]).result()
        assert torch.equal(c.get("a"), torch.ones(4))


def test_a_tensor_unused_for_longer_than_the_cycle_goes_before_demoted_state(tmp_path):
    """[Note: cold tensors go first], on the catalog itself: the job's cycle
    comes from keys demoted twice (the longest: a key demoted twice a step
    does not shorten it); a tensor not used for longer leaves first, and
    among the rest the last demoted does."""
    from tierd.backends.hostpool import HostPool
    from tierd.backends.nvme import NvmeStore
    from tierd.protocol import TensorSpec
    from tierd.server import eviction
    from tierd.server.catalog import Blocked, Catalog, Residency

    MiB = 1 << 20
    nvme, pool = NvmeStore(tmp_path, 32 * MiB), HostPool(8 * MiB, segment_size=8 * MiB)
    cat = Catalog(pool, nvme)
    try:
        s = cat.open_session(1, "job", pid=10, uid=0)

        def put(key: str) -> None:
            """Reserve (retried once the evictions' writes land, as the daemon
            does) and publish a 1 MiB tensor."""
            while isinstance(cat.reserve(s, (TensorSpec(key, "uint8", (MiB,), MiB),)),
                             Blocked):
                for t in cat.take_started():
                    view = t.slot.segment.view(t.slot.offset, t.nbytes)
                    cat.nvme.write_record(t.disk.spans, t.entry.meta(), view)
                    view.release()
                    cat.finish(t, None)
            cat.publish(s, (key,))

        state = [f"s{i}" for i in range(7)]   # with "weights": the pool is full
        for k in ["weights", *state]:
            put(k)
        cat.lease(s, ("weights",), True)   # used once, then never again
        cat.release(s, ("weights",), True)
        def cycle() -> int:
            return eviction.job_cycle(cat.tiers.job_entries("job"), cat.tiers.now)

        assert cycle() == 0   # nothing demoted yet
        for _ in range(3):   # three updating steps, all in the pool
            for k in state:
                # s6 is a bucket updated in two parts: demoted twice a step
                for _ in range(2 if k == "s6" else 1):
                    cat.lease(s, (k,), True)
                    cat.release(s, (k,), True)
                    cat.demote(s, (k,))
        assert cycle() > 0
        put("new")   # one must go
        where = {k: cat.entries[("job", k)].state for k in ["weights", *state]}
        assert where["weights"] is Residency.ON_NVME
        assert all(where[k] is Residency.IN_POOL for k in state), where
        put("more")   # then the last demoted
        assert cat.entries[("job", "s6")].state is Residency.ON_NVME
        assert all(cat.entries[("job", k)].state is Residency.IN_POOL for k in state[:6])
    finally:
        pool.close()
        nvme.close()
