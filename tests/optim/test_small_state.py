"""[Note: small state stays on the device] (tierd.updates.fused): a unit's
small parameters (biases, norm weights) form one bucket whose state stays on
the device while the unit's weights do; only the large tensors' state
streams. On by default on a device; here forced on the in-process store
(CPU), where the same buckets run, against plain torch."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
import tierd.updates.fused as fused_mod
from tierd.client.attach import attach, detach, session_of
from tierd.client.placement import Place, UnitBytes, plan_placement
from tierd.client.store import LocalStore
from tierd.updates.buckets import BucketState
from tests.client.models import assert_same_weights, batches, gpt2, train


@pytest.fixture
def keep_small(monkeypatch):
    monkeypatch.setattr(fused_mod, "keeps_small_state", lambda session: True)


def _fused(model):
    (f,) = session_of(model).optimizers
    return f


def _cap(make) -> int:
    """A plan that keeps some units' weights only and streams others."""
    probe = attach(make(), client=LocalStore(), device="cpu")
    units = session_of(probe).units
    cap = max(u.nbytes for u in units) * 4 * 21 // 20
    detach(probe)
    return cap


def _placed(make, cap):
    ref = make()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return model, ref, opt, ref_opt


def test_a_units_small_parameters_share_one_bucket(keep_small):
    model = attach(gpt2(n_layer=2), client=LocalStore(), device="cpu")
    f = _fused_after_build(model)
    session = session_of(model)
    for unit in session.units:
        mine = [b for b in f.buckets if b.unit == unit.index]
        largest = max(tp.param.numel() for b in mine for tp in b.tps)
        (small,) = [b for b in mine if b.small]
        assert {tp.name.rsplit(".", 1)[-1] for tp in small.tps} == {"bias", "weight"}
        assert all(tp.param.numel() * fused_mod.SMALL_SHARE <= largest for tp in small.tps)
        assert all(tp.param.numel() * fused_mod.SMALL_SHARE > largest
                   for b in mine if not b.small for tp in b.tps)
        if ".h." in small.tps[0].name:   # a block's biases and norms: most of its tensors
            assert len(small.tps) == 8 and sum(len(b.tps) for b in mine if not b.small) == 4


def _fused_after_build(model):
    tierd.optim.AdamW(model.parameters(), lr=1e-3)
    return _fused(model)


def test_on_the_cpu_buckets_stay_one_per_module():
    model = attach(gpt2(n_layer=2), client=LocalStore(), device="cpu")
    f = _fused_after_build(model)
    assert not any(b.small for b in f.buckets)
    assert all(len(b.tps) <= 2 for b in f.buckets if b.unit is not None)


def test_weights_units_keep_small_state_and_train_bitwise_like_torch(keep_small):
    make = lambda: gpt2(n_layer=6)
    model, ref, opt, ref_opt = _placed(make, _cap(make))
    data = batches(5)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session, f = session_of(model), _fused(model)
    plan = session.placer.plan
    weights = set(plan.units_at(Place.WEIGHTS))
    assert weights and set(plan.units_at(Place.STREAM))
    for b in f.buckets:
        if b.unit in weights and b.small:
            assert b.pinned and b.state is BucketState.RESIDENT
        elif b.unit is not None and plan.places[b.unit] is not Place.RESIDENT:
            assert not b.pinned and b.state is not BucketState.RESIDENT
    # placement counts the kept state with the weights, and streams the rest
    units = {u.index: u for u in session.placer.unit_bytes()}
    for i in weights:
        kept = sum(f.opt.state_nbytes(tp) for b in f.buckets
                   if b.unit == i and b.small for tp in b.tps)
        assert 0 < kept == units[i].weights_state_bytes < units[i].state_bytes
        assert units[i].device_bytes(Place.WEIGHTS) == units[i].param_bytes + kept
    assert plan.device_bytes <= session.placer.cap
    assert_same_weights(model, ref)   # state_dict writes the kept state back first


@pytest.mark.parametrize("kept", ["small", "by-size"])
def test_kept_small_state_reaches_a_commit_and_a_resumed_job_trains_on(keep_small, kept):
    """The state kept on the device lives only there between commits (a
    unit's small state, or [Note: parameters resident by size keep their
    state on the device]): a commit writes it, and a job resumed from it
    trains on as one that never stopped."""
    make = lambda seed=0: gpt2(n_layer=6, seed=seed)
    data = batches(6)
    options = ({"gpu_memory_bytes": _cap(make)} if kept == "small"
               else {"resident_below_bytes": 1024})

    def run(store, **kw):
        model = attach(make(**kw), client=store, job="run1", device="cpu",
                       resume="seed" in kw, **options)
        return model, tierd.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = run(LocalStore(job="run1"))
    want = train(model, opt, data)
    store = LocalStore(job="run1")
    model, opt = run(store)
    got = train(model, opt, data[:3])
    kept_now = [b for b in _fused(model).buckets
                if b.small and (b.unit is None) == (kept == "by-size")]
    resident = [b.state is BucketState.RESIDENT for b in kept_now]
    assert any(resident) and (kept == "small" or all(resident))   # small: the WEIGHTS units'
    tierd.commit(model, opt, 3)
    store.restart()
    object.__delattr__(model, "_tierd_session")
    again, opt = run(store, seed=5)
    assert got + train(again, opt, data[3:]) == want


def test_a_new_length_streams_small_state_again_with_its_newest_values(keep_small):
    make = lambda: gpt2(n_layer=6)
    model, ref, opt, ref_opt = _placed(make, _cap(make))
    short, long = batches(3, seq=8), batches(3, seq=16, seed=4)
    assert train(model, opt, short) == train(ref, ref_opt, short)
    assert any(b.small and b.pinned for b in _fused(model).buckets)
    # a new length streams every unit (small state written back), then places again
    assert train(model, opt, long) == train(ref, ref_opt, long)
    assert_same_weights(model, ref)


def test_the_planner_counts_state_kept_with_the_weights():
    unit = UnitBytes(0, 200, 1200, weights_state_bytes=120)
    assert unit.device_bytes(Place.WEIGHTS) == 320
    assert unit.streamed(Place.WEIGHTS) == 2 * 1080
    assert unit.device_bytes(Place.RESIDENT) == 1400
    units = [UnitBytes(i, 200, 1200, weights_state_bytes=120) for i in range(4)]
    # room for three units' weights alone, not for their kept state too
    plan = plan_placement(units, 3 * 200 + 100)
    assert plan.device_bytes <= 700 and len(plan.units_at(Place.WEIGHTS)) == 2


def _state_keys(session, opt, tps) -> set[str]:
    names = ("exp_avg", "exp_avg_sq")
    keys = {opt.state_key(tp, n) for tp in tps for n in names}
    return keys & set(session.client.keys(session.keys.all))


@pytest.mark.parametrize("capped", [True, False], ids=["placed", "placement-off"])
def test_parameters_resident_by_size_keep_their_state_on_the_device(keep_small, capped):
    """[Note: parameters resident for good keep their state on the device]:
    below ``resident_below_bytes`` (the norms and the attention's biases
    here) the state stays with the weights from the first update on, with or
    without a plan, and the placer counts it as the model's own."""
    make = lambda: gpt2(n_layer=6)
    ref = make()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   resident_below_bytes=1024, gpu_memory_bytes=_cap(make) if capped else None)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    session, f = session_of(model), _fused(model)
    by_size = [b for b in f.buckets if b.unit is None]
    assert by_size and all(b.small and b.pinned for b in by_size)
    assert all(tp.resident_for_good for b in by_size for tp in b.tps)
    assert {tp.name.rsplit(".", 1)[-1] for b in by_size for tp in b.tps} == {"weight", "bias"}
    data = batches(5)
    assert train(model, opt, data[:3]) == train(ref, ref_opt, data[:3])
    assert all(b.state is BucketState.RESIDENT for b in by_size)
    kept = [tp for b in by_size for tp in b.tps]
    assert not _state_keys(session, opt, kept)   # the store keeps no copy of it
    assert f.resident_bytes() == sum(b.nbytes for b in f.buckets
                                     if b not in by_size and b.state is BucketState.RESIDENT)
    if capped:
        assert session.placer.plan.device_bytes <= session.placer.cap
    assert_same_weights(model, ref)    # state_dict writes it back first
    assert train(model, opt, data[3:]) == train(ref, ref_opt, data[3:])
    assert_same_weights(model, ref)


def test_on_the_cpu_parameters_resident_by_size_stream_their_state():
    model = attach(gpt2(n_layer=2), client=LocalStore(), device="cpu", resident_below_bytes=1024)
    f = _fused_after_build(model)
    by_size = [b for b in f.buckets if b.unit is None]
    assert by_size and not any(b.small or b.pinned for b in by_size)
