"""[Note: leases asked ahead] in tierd.updates.fused: with keys leased per
use, the daemon's grant of a bucket's keys is asked for before its fetch;
[Note: growth told ahead] in tierd.backends.hostpool: the pool segments of
the first step's gradients and state are made before it asks."""

from __future__ import annotations

import copy

import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tests.client.models import assert_same_weights, batches, gpt2, train


def test_leases_of_the_next_buckets_are_asked_for_before_their_fetch(daemon, monkeypatch):
    # [Note: leases asked ahead]: keys leased per use (nothing held); the
    # grant of a bucket's keys is asked for while earlier buckets are fetched
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), hold_fraction=0.0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, prefetch_bytes=1 << 20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    assert train(model, opt, data[:2]) == train(ref, ref_opt, data[:2])   # learns, then fuses
    session, fused = session_of(model), opt._fused[0]
    assert session.stats()["held_bytes"] == 0
    events = []
    lease_async, fetch = session.client.lease_async, fused._fetch

    def leasing(keys, **kw):
        events.append(("lease", set(keys)))
        return lease_async(keys, **kw)

    def fetching(b):
        events.append(("fetch", b))
        return fetch(b)

    monkeypatch.setattr(session.client, "lease_async", leasing)
    monkeypatch.setattr(fused, "_fetch", fetching)
    assert train(model, opt, data[2:]) == train(ref, ref_opt, data[2:])
    assert_same_weights(model, ref)
    fetches = [b for kind, b in events if kind == "fetch"]
    early = []
    for b in fetches:
        moment = fused.opt.state_keys(b.tps[0])[1]   # (the mover leases a fp32 master too)
        asked = next(i for i, (kind, x) in enumerate(events) if kind == "lease" and moment in x)
        at = events.index(("fetch", b))
        if any(kind == "fetch" for kind, _ in events[asked:at]):
            early.append(b.index)   # another bucket was fetched while its grant came
    assert early
    assert not fused._ahead   # what no fetch took was released as the backward ended


def test_an_optimizer_tells_the_daemon_the_first_steps_growth(daemon_factory):
    # the gradients (4 B/param) and the state made in the first step (a fp32
    # model: two moments) are announced when the optimizer is built; the
    # daemon makes their segments then, and the step trains as torch does
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", "2", "--segment-size", "4MiB"))
    ref = gpt2()
    client = tierd.connect(d)
    model = attach(copy.deepcopy(ref), client=client)
    params = sum(p.numel() for p in ref.parameters())
    before = client.stats()
    assert before["pool_spare_bytes"] <= 2 * (4 << 20)   # the usual two made ahead
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    grown = client.stats()
    told = 3 * 4 * params                                 # gradients and two moments
    assert grown["pool_spare_bytes"] >= told, (grown, told)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(2)
    assert train(model, opt, data[:1]) == train(ref, ref_opt, data[:1])
    after = client.stats()
    # the first step took what was made for it: the pool grew by little else
    assert after["pool_mapped_bytes"] <= grown["pool_mapped_bytes"] + 4 * (4 << 20), (
        grown, after)
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert_same_weights(model, ref)
