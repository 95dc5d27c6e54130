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
