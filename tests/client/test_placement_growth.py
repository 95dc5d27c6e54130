"""Placement growth and kept weights on the in-process store (CPU), with
made-up measured peaks: a plan made with an assumed update window grows into
the room the first fused step leaves ([Note: growing the plan] in
``tierd.client.placer``); units keeping only their weights on the device
write them to the store when it is read ([Note: kept weights are written
when the store is read] in ``tierd.updates.resident``). Every change of plan
trains bitwise like the reference and detaches with the same values."""

from __future__ import annotations

import copy
import itertools
import time

import pytest
import torch

import tierd
import tierd.optim
import tierd.updates.engine as engine_mod
from tierd.client.attach import attach, detach, session_of
from tierd.client.placement import Place
from tierd.client.placer import Placer, PlacerState
from tierd.client.store import LocalStore
from tierd.client.activations.config import ActivationConfig
from tierd.errors import CapacityError
from tests.client.models import batches, gpt2, llama, train


def _unit_bytes(dtype):
    """(weights bytes, weights + optimizer state bytes) of llama() at ``dtype``."""
    probe = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=dtype)
    tierd.optim.AdamW(probe.parameters(), lr=1e-3)
    units = session_of(probe).placer.unit_bytes()
    detach(probe)
    return (sum(u.param_bytes for u in units),
            sum(u.param_bytes + u.state_bytes for u in units))


def _grow_from_weights(monkeypatch, dtype="bf16"):
    """A model whose first plan keeps every unit's weights only (an assumed
    update window takes the rest of the cap), and whose first fused step
    leaves room for everything: the plan grows WEIGHTS -> RESIDENT."""
    extra = 1 << 20
    weights, everything = _unit_bytes(dtype)
    cap = everything + 2 * extra
    window = cap - extra - weights          # budget of the first plan: the weights
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra, 1 << 40))
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: window)
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=dtype,
                   gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _streamed(dtype="bf16"):
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=dtype)
    return model, tierd.optim.AdamW(model.parameters(), lr=1e-3)


def test_grown_weights_to_resident_then_detach(monkeypatch):
    """bf16 units grown from WEIGHTS (compute copy older in the store) to
    RESIDENT (their values leave the store) train and detach as if streamed."""
    data = batches(5)
    model, opt = _grow_from_weights(monkeypatch)
    placer = session_of(model).placer
    got = train(model, opt, data[:2])
    assert set(placer.plan.places.values()) == {Place.WEIGHTS}
    got += train(model, opt, data[2:4])
    assert set(placer.plan.places.values()) == {Place.RESIDENT}   # grown
    ref, ref_opt = _streamed()
    want = train(ref, ref_opt, data[:4])
    assert got == want
    want_sd = detach(ref).state_dict()
    sd = detach(model).state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want_sd.items())


def test_grown_weights_to_resident_stale_flag_is_cleared(monkeypatch):
    """Once a kept weight's unit is RESIDENT its compute copy goes to the
    store with the bucket's write-back: no parameter of it stays flagged."""
    model, opt = _grow_from_weights(monkeypatch)
    session = session_of(model)
    train(model, opt, batches(4))
    assert set(session.placer.plan.places.values()) == {Place.RESIDENT}
    pinned = [tp for f in session.optimizers for b in f.buckets if b.pinned for tp in b.tps]
    assert pinned
    assert not [tp.name for tp in pinned if tp.stale_in_store]


def _sizes(make, dtype, placement):
    probe = attach(make(), client=LocalStore(), device="cpu", compute_dtype=dtype,
                   optimizer_placement=placement or "gpu-stream")
    tierd.optim.AdamW(probe.parameters(), lr=1e-3)
    units = session_of(probe).placer.unit_bytes()
    detach(probe)
    return (sum(u.param_bytes for u in units),
            sum(u.param_bytes + u.state_bytes for u in units))


@pytest.mark.parametrize("make,dtype,frac,placement,accumulate", [
    (m, d, f, p, a) for m, d, f, p, a in itertools.product(
        (llama, gpt2), ("fp32", "bf16"), (0.3, 1.0), ("gpu-stream", "auto", "cpu"), (1, 2))
    ])
def test_growth_then_new_shapes_then_detach(monkeypatch, make, dtype, frac, placement,
                                            accumulate):
    """Growth (any start), a new input shape after it, and detach, against a
    reference: torch (fp32) or the all-streamed tierd run (bf16)."""
    import tierd.updates.cpu_update as cpu_update
    monkeypatch.setattr(cpu_update, "probe_copy_rate", lambda device: 1e3)
    monkeypatch.setattr(cpu_update, "probe_host_rate", lambda: 1e12)
    extra = 1 << 20
    weights, everything = _sizes(make, dtype, placement)
    cap = everything + 2 * extra
    window = cap - extra - int(frac * weights)
    ref_model = make()
    if dtype == "fp32":
        ref = copy.deepcopy(ref_model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    else:
        ref = attach(copy.deepcopy(ref_model), client=LocalStore(), device="cpu",
                     compute_dtype=dtype, optimizer_placement=placement)
        ref_opt = tierd.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra, 1 << 40))
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: window)
    model = attach(copy.deepcopy(ref_model), client=LocalStore(), device="cpu",
                   compute_dtype=dtype, gpu_memory_bytes=cap, optimizer_placement=placement)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    placer = session_of(model).placer
    short, long = batches(6 * accumulate, seq=8), batches(3 * accumulate, seq=16, seed=4)
    got = train(model, opt, short, accumulate=accumulate)
    first = dict(placer.plan.places) if placer.plan else None
    # the plan grew to every unit (auto keeps its CPU ones)
    if placement != "cpu":
        assert placer._grown and Place.RESIDENT in first.values(), first
        assert Place.STREAM not in first.values() and Place.WEIGHTS not in first.values()
    got += train(model, opt, long, accumulate=accumulate)
    want = train(ref, ref_opt, short + long, accumulate=accumulate)
    assert got == want, (first, placer.plan and placer.plan.places)
    sd = model.state_dict()
    want_sd = ref.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want_sd.items())
    detach(model)
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want_sd.items())


def test_growth_sticks_under_gradient_accumulation(monkeypatch):
    """With a window of 2 backwards the plan grows after the fused micro-step;
    the next micro-step (no fused update, the window assumed again) is
    compared with the plan's own measurement, not the grown one's, so it does
    not read as a step that outgrew the plan."""
    extra = 1 << 20
    weights, everything = _sizes(llama, "fp32", None)
    cap = everything + 2 * extra
    window = cap - extra - weights
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra, 1 << 40))
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: window)
    model = attach(llama(), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    placer = session_of(model).placer
    train(model, opt, batches(8, seq=8), accumulate=2)
    assert placer.replans == 0
    assert set(placer.plan.places.values()) == {Place.RESIDENT}


def owns_parameters(module) -> bool:
    """A unit per module owning parameters (attach's ``unit_modules``): the
    granularity the caps below are set for (a block-sized unit would not fit)."""
    return any(p is not None for p in module._parameters.values())


def _cap_for_half(make):
    probe = attach(make(), client=LocalStore(), device="cpu", unit_modules=owns_parameters)
    cap = sum(u.nbytes for u in session_of(probe).units) // 2
    detach(probe)
    return cap


def test_a_failed_write_of_kept_weights_leaves_no_lease_behind(monkeypatch):
    """A commit that cannot write the kept weights (no room for the lease)
    raises, leaves no lease behind and keeps them marked: the retry writes them."""
    store = LocalStore(job="run1")
    model = attach(llama(), client=store, job="run1", device="cpu", compute_dtype="bf16",
                   gpu_memory_bytes=_cap_for_half(llama), unit_modules=owns_parameters)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    session = session_of(model)
    kept = [tp for tp in session.params.values() if tp.stale_in_store]
    assert kept
    leases = session.leases
    real = type(leases).views

    def no_room(self, keys):
        keys = list(keys)
        if any(k == kept[0].key for k in keys):
            raise CapacityError("made up: the pool has no room for the lease")
        return real(self, keys)

    refs = {tp.key: leases._refs.get(tp.key, 0) for tp in kept}
    monkeypatch.setattr(type(leases), "views", no_room)
    with pytest.raises(CapacityError):
        tierd.commit(model, opt, 3)
    monkeypatch.setattr(type(leases), "views", real)
    assert {tp.key: leases._refs.get(tp.key, 0) for tp in kept} == refs   # none left over
    assert all(tp.stale_in_store for tp in kept)   # not cleared: still to be written
    tierd.commit(model, opt, 3)   # room again: the retry goes through
    got = session.read([tp.key for tp in kept])
    assert all(torch.equal(got[tp.key], tp.param.data) for tp in kept)


@pytest.mark.parametrize("activations", [ActivationConfig(policy="offload", min_bytes=0),
                                         ActivationConfig(policy="auto", min_bytes=0)],
                         ids=["offload", "auto"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_growth_with_activation_tiering(monkeypatch, activations, dtype):
    """Growth with activation tiering (its plan is final before placing),
    against the all-streamed tierd run. With "auto" the first step on its
    final plan already runs the fused update, so the plan is made from a
    real update window and has nothing to grow into."""
    extra = 1 << 20
    weights, everything = _sizes(llama, dtype, None)
    cap = everything + 2 * extra
    window = cap - extra - int(0.3 * weights)
    ref = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=dtype,
                 activations=activations)
    ref_opt = tierd.optim.AdamW(ref.parameters(), lr=1e-3)
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra, 1 << 40))
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: window)
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=dtype,
                   gpu_memory_bytes=cap, activations=activations)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(10)
    got = train(model, opt, data)
    placer = session_of(model).placer
    assert placer._grown == (activations.policy == "offload") and placer.replans == 0
    assert Place.RESIDENT in placer.plan.places.values()
    assert got == train(ref, ref_opt, data)
    want = detach(ref).state_dict()
    sd = detach(model).state_dict()
    assert all(torch.equal(sd[k], v) for k, v in want.items())


def test_placement_waits_for_the_final_activation_plan(monkeypatch):
    """[Note: placement and activation tiering share one budget]: a step that
    began while activations="auto" still profiled (its plan is made as that
    backward ends) is not the step placement is made from."""
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + (1 << 20),
                                                         1 << 40))
    model = attach(llama(), client=LocalStore(), device="cpu", gpu_memory_bytes=1 << 30,
                   activations=ActivationConfig(policy="auto", min_bytes=0))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    session, began, after = session_of(model), [], []
    model.register_forward_pre_hook(lambda m, args: began.append(session.activations.stage.name))
    for ids in batches(4):
        train(model, opt, [ids])
        after.append(session.placer.state)
    assert began[0] == "PROFILE" and after[0] is PlacerState.MEASURING, (began, after)
    assert began[1:] == ["DONE"] * 3 and after[-1] is PlacerState.PLACED, (began, after)


def test_the_check_steps_peak_does_not_set_the_budget(monkeypatch):
    """activations="auto"'s CHECK step runs a plan it may reject: its peak
    (made up, large here) does not set the placement budget."""
    import tierd.client.activations.auto as auto
    # CHECK on the CPU: a reader of "allocated bytes" (constant) as CUDA's would be
    monkeypatch.setattr(auto, "_allocated_reader", lambda device: (lambda: 0))
    small, big = 1 << 20, 64 << 20
    began = {"stage": None}   # the stage the step being read began in
    monkeypatch.setattr(Placer, "_memory", lambda self: (
        self.resident_bytes() + (big if began["stage"] == "CHECK" else small), 1 << 40))
    model = attach(llama(), client=LocalStore(), device="cpu", gpu_memory_bytes=1 << 30,
                   activations=ActivationConfig(policy="auto", min_bytes=0,
                                                budget_bytes=1 << 30))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    session, stages = session_of(model), []
    model.register_forward_pre_hook(   # runs after tierd's: the read has been made
        lambda m, args: began.update(stage=session.activations.stage.name))
    for ids in batches(5):
        train(model, opt, [ids])
        stages.append(began["stage"])
    assert stages[:3] == ["PROFILE", "CHECK", "DONE"], stages
    placer = session.placer
    assert placer.state is PlacerState.PLACED
    assert placer._non_model < big, (placer._non_model, stages)


def test_kept_weights_are_written_a_lease_at_a_time(monkeypatch):
    import tierd.updates.resident as resident
    model = attach(llama(), client=LocalStore(job="run1"), job="run1", device="cpu",
                   compute_dtype="bf16", gpu_memory_bytes=_cap_for_half(llama),
                   unit_modules=owns_parameters)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    session = session_of(model)
    kept = {tp.key: tp for tp in session.params.values() if tp.stale_in_store}
    assert len(kept) > 1
    session.lease_cap = max(tp.nbytes for tp in kept.values())   # a full pool: small leases
    written, write = [], resident._write_kept

    def recorded(session, tps):
        written.append([tp.key for tp in tps])
        return write(session, tps)

    monkeypatch.setattr(resident, "_write_kept", recorded)
    tierd.commit(model, opt, 3)
    assert len(written) > 1 and sorted(k for batch in written for k in batch) == sorted(kept)
    assert all(sum(kept[k].nbytes for k in batch) <= session.lease_cap for batch in written)
    got = session.read(list(kept))
    assert all(torch.equal(got[k], tp.param.data) for k, tp in kept.items())


def test_choosing_cpu_updates_again_then_growing_stays_within_the_cap(monkeypatch):
    """Made-up peaks: a fused step peaks at its real update window. The host
    measures slow, so its units stream again, once an update has ended to
    measure it; the plan grows only after a step that held their state, and
    no step goes over the cap or replans."""
    import tierd.updates.cpu_update as cpu_update
    monkeypatch.setattr(cpu_update, "probe_copy_rate", lambda device: 1e9)
    monkeypatch.setattr(cpu_update, "probe_host_rate", lambda: 4e8)
    run_job = cpu_update.run_job   # measured: slow (each update reports 1000 s more),
    # and still running when the next step starts, so the first re-choice has no rate yet

    def slow(opt, job):
        time.sleep(0.05)
        return run_job(opt, job) + 1e3

    monkeypatch.setattr(cpu_update, "run_job", slow)
    # the cap is above the step with every unit streamed: 1 << 16 and its window (188,416)
    extra, cap, peaks = 1 << 16, 270_000, []

    def memory(self):
        ran = self._updates.fused_backwards() != self._fused_before
        window = self._updates.update_window() if ran else 0
        peaks.append(self.resident_bytes() + extra + window)
        return peaks[-1], 1 << 40

    monkeypatch.setattr(Placer, "_memory", memory)
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                   gpu_memory_bytes=cap, optimizer_placement="auto",
                   unit_modules=owns_parameters)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, prefetch_bytes=4096)
    train(model, opt, batches(6))
    placer = session_of(model).placer
    assert max(peaks) <= cap, peaks
    assert placer.replans == 0
    assert Place.CPU not in placer.plan.places.values()
