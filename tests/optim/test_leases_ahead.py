"""[Note: leases asked ahead] in tierd.updates.fused: with keys leased per
use, the daemon's grant of a bucket's keys is asked for before its fetch."""

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
