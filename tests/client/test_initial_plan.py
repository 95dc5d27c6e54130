"""The first step's plan, estimated from sizes ([Note: the plan before a step
is measured] in tierd.client.placer), and frozen weights that init=True keeps
only on the device ([Note: frozen weights kept only on the device] in
tierd.client.kept_frozen).

The device is faked: the compute device is the CPU, its free memory and the
step's peak come through ``Placer._memory``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.placement import Place, Placement, UnitBytes, plan_placement
from tierd.client.held_grads import PeakReading, held_units, kept_for_update
import tierd.client.placer as placer_module
from tierd.client.capacity import estimate_budget
from tierd.client.placer import Placer, PlacerState
from tierd.client.store import LocalStore
from tierd.errors import CapacityError, StateError
from tests.client.models import assert_same_weights, batches, llama, train

SEED = 5


def _fake_device(monkeypatch, *, free: int = 1 << 40) -> dict:
    """``_memory``: the step's peak is what the plan holds plus ``extra["bytes"]``."""
    extra = {"bytes": 1 << 20, "free": free}
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra["bytes"],
                                                         extra["free"]))
    return extra


def _everything(make) -> int:
    probe = attach(make(), client=LocalStore(), device="cpu")
    total = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    return total


# ------------------------------------------------------------------ the estimate
def test_sized_units_count_state_for_trainable_parameters_only():
    frozen = UnitBytes.sized(0, [(400, 100, False, False)])
    trained = UnitBytes.sized(1, [(200, 100, True, True)])   # bf16 with an fp32 master
    assert (frozen.param_bytes, frozen.state_bytes, frozen.grad_bytes) == (400, 0, 0)
    assert (trained.param_bytes, trained.state_bytes, trained.grad_bytes) == (200, 1200, 400)
    # a frozen unit costs its weights alone: it is kept before a trainable one's state
    plan = plan_placement([frozen, trained], 600)
    assert plan.places == {0: Place.WEIGHTS, 1: Place.WEIGHTS}


def test_the_estimate_leaves_a_quarter_of_the_cap_and_the_margin():
    assert estimate_budget(1000, 50) == 700
    assert estimate_budget(1000, 50, free=400) == 350   # the device has less free
    assert estimate_budget(1000, 2000) == 0


def test_the_first_step_runs_a_placed_plan_when_memory_is_plenty(monkeypatch):
    _fake_device(monkeypatch)
    cap = _everything(llama) * 2 + (1 << 30)   # and the update window the placer assumes
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    session = session_of(model)
    placer = session.placer
    data = batches(6)
    ids = data[0]
    before = session.stats()["h2d_bytes"]
    loss = model(input_ids=ids, labels=ids).loss
    # the first step already runs on a plan: every unit's weights on the device
    assert placer.state is PlacerState.MEASURING
    assert set(placer.plan.places.values()) == {Place.WEIGHTS}
    assert placer.resident_bytes() == sum(tp.nbytes for tp in session.params.values())
    loss.backward()
    assert session.stats()["h2d_bytes"] == before   # nothing streamed in
    opt.step(); opt.zero_grad()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    assert loss.item() == ref_loss.item()
    # the measured plan is made at the first update and holds from then on
    assert placer.state is PlacerState.PLACED
    plan = placer.plan
    assert set(plan.places.values()) == {Place.RESIDENT}
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert placer.plan is plan and placer.replans == 0
    assert_same_weights(model, ref)


def test_a_plan_that_fails_part_way_leaves_every_unit_streamed(monkeypatch):
    """Kept units are made resident one unit's leases at a time: when a later
    unit's lease fails, the units made resident before it stream again, and
    the same model then trains as torch does."""
    _fake_device(monkeypatch)
    cap = _everything(llama) * 2 + (1 << 30)
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    session = session_of(model)
    acquire, calls = session.leases.acquire, []

    def third_fails(keys, *args, **kwargs):
        calls.append(keys)
        if len(calls) == 3:
            raise CapacityError("the pool has no room (injected)")
        return acquire(keys, *args, **kwargs)

    monkeypatch.setattr(session.leases, "acquire", third_fails)
    ids = batches(1)[0]
    with pytest.raises(CapacityError, match="injected"):
        model(input_ids=ids, labels=ids)
    assert len(calls) == 3
    assert not any(tp.resident for tp in session.params.values())
    assert session.placer.resident_bytes() == 0
    monkeypatch.setattr(session.leases, "acquire", acquire)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_the_estimate_keeps_within_the_free_memory_and_the_measured_plan_shrinks_it(
        monkeypatch):
    extra = _fake_device(monkeypatch)
    everything = _everything(llama)
    ref = llama()
    cap = everything * 2 + (1 << 30)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    session, placer = session_of(model), session_of(model).placer
    weights = sorted(sum(tp.nbytes for tp in session.registry.members(u)) for u in session.units)
    extra["free"] = weights[0] + weights[1]   # room for the two smallest units' weights
    data = batches(4)
    ids = data[0]
    loss = model(input_ids=ids, labels=ids).loss
    assert 0 < placer.resident_bytes() <= extra["free"]
    assert len(placer.plan.units_at(Place.WEIGHTS)) < len(session.units)
    loss.backward()
    # the step needed the whole cap: the plan made at the first update keeps nothing
    extra["bytes"] = cap
    opt.step(); opt.zero_grad()
    got = [loss.item()]
    assert placer.state is PlacerState.PLACED and placer.resident_bytes() == 0
    # the order learned with units kept is followed; the units streamed
    # again join it ([Note: units new to the trace] in tierd.client.planner)
    planner = session.mover.planner
    assert planner.trace
    got += train(model, opt, data[1:])
    assert planner is session.mover.planner
    assert planner.divergences == 0 and planner.steps_followed == len(data) - 2
    assert set(planner.trace) == {u.index for u in session.units}
    assert placer.state is PlacerState.PLACED and placer.plan.device_bytes == 0
    assert got == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


# ------------------------------------------------- the measuring step's gradients
def _kept_first_step(monkeypatch, *, whole: int = 1):
    """A Llama of three units whose estimate counts its ``whole`` smallest
    units whole (their weights and fp32 moments) and keeps the next one's
    weights only; the step needs 1 MiB besides the plan, so the measured
    plan keeps every unit whole."""
    extra = _fake_device(monkeypatch)
    ref = llama()
    cap = _everything(llama) * 2 + (1 << 30)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)
    session = session_of(model)
    weights = sorted(sum(tp.nbytes for tp in session.registry.members(u)) for u in session.units)
    assert len(weights) == 3
    extra["free"] = 3 * sum(weights[:whole]) + weights[whole]   # fp32: moments are 2x weights
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return model, ref, opt, ref_opt, session, extra


def _backward(model, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item()


def _estimated_whole(session) -> list:
    """The trainable parameters of the units the estimate counted whole."""
    placer = session.placer
    budget = estimate_budget(placer.cap, 0, placer._memory()[1])
    whole = plan_placement(placer.sized_units(), budget).units_at(Place.RESIDENT)
    return [tp for i in whole for tp in session.registry.members(session.units[i])]


def test_the_measuring_step_sums_the_kept_units_gradients_on_the_device(monkeypatch):
    """[Note: the measuring step keeps its gradients on the device]: no
    gradient of a unit the estimate counted whole reaches the store, the
    first update reads them where they are and frees them, and training is
    torch's, bit for bit. A unit kept weights only (its gradients were not
    counted) sends them to the store, as a streamed one does."""
    model, ref, opt, ref_opt, session, extra = _kept_first_step(monkeypatch)
    data = batches(4)
    kept = _estimated_whole(session)
    got = [_backward(model, data[0])]
    weights_only = [tp for tp in session.params.values() if tp.resident and tp not in kept]
    streamed = [tp for tp in session.params.values() if not tp.resident]
    assert kept and weights_only and streamed
    assert all(tp.resident and tp.grad_on_device and not tp.grad_created for tp in kept)
    assert all(tp.grad_in_pool for tp in weights_only + streamed)
    assert session.grads.held_bytes == sum(tp.grad_nbytes for tp in kept)
    leased, acquire = [], session.leases.acquire
    monkeypatch.setattr(session.leases, "acquire",
                        lambda keys, *a, **k: (leased.extend(keys), acquire(keys, *a, **k)))
    opt.step()
    monkeypatch.setattr(session.leases, "acquire", acquire)
    assert set(session.placer.plan.places.values()) == {Place.RESIDENT}
    assert not {tp.grad_key for tp in kept} & set(leased)   # read on the device
    assert {tp.grad_key for tp in streamed} <= set(leased)
    assert session.grads.held_bytes == 0
    assert not any(tp.has_gradient for tp in session.params.values())
    opt.zero_grad()
    got += train(model, opt, data[1:])
    assert got == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_with_a_daemon_the_kept_units_gradients_never_reach_the_store(monkeypatch,
                                                                      daemon_factory):
    extra = _fake_device(monkeypatch)
    ref = llama()
    client = tierd.connect(daemon_factory(pool="64MiB"))
    cap = _everything(llama) * 2 + (1 << 30)
    model = attach(copy.deepcopy(ref), client=client, device="cpu", gpu_memory_bytes=cap)
    session = session_of(model)
    weights = sorted(sum(tp.nbytes for tp in session.registry.members(u)) for u in session.units)
    extra["free"] = 3 * weights[0] + weights[1]   # as _kept_first_step's
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    kept = _estimated_whole(session)
    got = [_backward(model, data[0])]
    stored = set(client.keys(session.keys.all))
    assert kept and not {tp.grad_key for tp in kept} & stored
    assert {tp.grad_key for tp in session.params.values() if tp not in kept} <= stored
    opt.step(); opt.zero_grad()
    assert not {tp.grad_key for tp in kept} & set(client.keys(session.keys.all))
    got += train(model, opt, data[1:])
    assert got == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    detach(model)


def test_held_gradients_read_through_p_grad_come_from_the_pool_as_torch_s(monkeypatch):
    """Reading them (``session.gradients()``, ``clip_grad_norm_``) writes
    them to the pool first; the update then keeps to the pool, as torch's."""
    model, ref, opt, ref_opt, session, _ = _kept_first_step(monkeypatch)
    data = batches(3)
    assert _backward(model, data[0]) == _backward(ref, data[0])
    assert session.grads.held_bytes > 0
    grads = session.gradients()
    named = dict(ref.named_parameters())
    assert grads.keys() == {n for n, p in named.items() if p.grad is not None}
    assert all(torch.equal(g, named[n].grad) for n, g in grads.items())
    assert session.grads.held_bytes == 0
    assert all(tp.grad_in_pool for tp in session.params.values())
    for m in (model, ref):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
    opt.step(); opt.zero_grad()
    ref_opt.step(); ref_opt.zero_grad()
    assert train(model, opt, data[1:], clip=0.01) == train(ref, ref_opt, data[1:], clip=0.01)
    assert_same_weights(model, ref)


def test_zero_grad_frees_the_gradients_held_on_the_device(monkeypatch):
    model, ref, opt, ref_opt, session, _ = _kept_first_step(monkeypatch)
    data = batches(4)
    assert _backward(model, data[0]) == _backward(ref, data[0])
    assert session.grads.held_bytes > 0
    opt.zero_grad(); ref_opt.zero_grad()
    assert session.grads.held_bytes == 0
    assert not any(tp.has_gradient for tp in session.params.values())
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert_same_weights(model, ref)


def test_a_first_window_of_two_backwards_stores_the_held_gradients_at_its_second_forward(
        monkeypatch):
    model, ref, opt, ref_opt, session, _ = _kept_first_step(monkeypatch)
    data = batches(6)
    spilled, spill = [], session.grads.spill
    monkeypatch.setattr(session.grads, "spill", lambda tps: _record(spilled, spill, tps))
    got = train(model, opt, data, accumulate=2)
    assert got == train(ref, ref_opt, data, accumulate=2)
    assert spilled   # the measured plan, placed at the second forward, holds none
    assert session.grads.held_bytes == 0 and not session.grads.hold
    assert_same_weights(model, ref)


def _record(spilled: list, spill, tps) -> None:
    tps = list(tps)
    spilled += [tp for tp in tps if tp.grad_on_device]
    spill(tps)


def test_the_measuring_step_holds_gradients_within_the_estimates_budget():
    """[Note: the measuring step keeps its gradients on the device]: the
    units planned whole first, then those kept weights only, while their
    gradients fit what the budget leaves besides the compute copies."""
    units = [UnitBytes(0, 4, 24, 8), UnitBytes(1, 2, 12, 4), UnitBytes(2, 2, 12, 4),
             UnitBytes(3, 2, 0, 0)]   # unit 3 is frozen: no gradient
    plan = Placement({0: Place.WEIGHTS, 1: Place.WEIGHTS, 2: Place.RESIDENT,
                      3: Place.WEIGHTS}, 22, 0)
    assert held_units(units, plan, 12) == [2, 0]
    assert held_units(units, plan, 11) == [2, 1]   # unit 0 does not fit; unit 1 does
    assert held_units(units, plan, 3) == []
    assert held_units(units, plan, 100) == [2, 0, 1]


def test_the_peak_reading_leaves_out_held_gradients_but_no_earlier_peak():
    memory = {"now": 0, "peak": 0}

    def alloc(n: int) -> None:
        memory["now"] += n
        memory["peak"] = max(memory["peak"], memory["now"])

    reading = PeakReading(lambda: memory["peak"], lambda: memory.update(peak=memory["now"]))
    alloc(100); alloc(-60)          # the forward's activations, then 40 left
    reading.held(30); alloc(30)     # a gradient held on the device
    alloc(50); alloc(-50)           # 90 besides it: under the earlier 100
    assert reading.peak() == 100
    alloc(80)                       # 120 besides it
    assert reading.peak() == 120
    alloc(-80); alloc(-30); reading.held(-30)   # the update freed it
    alloc(110)                      # 150 now, nothing held
    assert reading.peak() == 150
    alloc(-110)
    reading.reset()
    assert reading.peak() == 40


def test_the_first_update_keeps_held_gradients_within_the_measured_room(monkeypatch):
    """[Note: held gradients at the first update]: a unit kept whole costs
    what its gradients exceed its state by (nothing for AdamW); any other
    unit all its gradients, within the room given."""
    model, ref, opt, ref_opt, session, _ = _kept_first_step(monkeypatch, whole=2)
    _backward(model, batches(1)[0])
    placer = session.placer
    held = [i for i, u in enumerate(session.units)
            if any(tp.grad_on_device for tp in session.registry.members(u))][:2]
    assert len(held) == 2
    members = {i: [tp for tp in session.registry.members(session.units[i])
                   if tp.grad_on_device] for i in held}
    grads = {i: sum(tp.grad_nbytes for tp in members[i]) for i in held}
    units = placer.unit_bytes()
    freed = [tp for i in held for tp in members[i]]

    def plan(first: Place, second: Place):
        places = {i: Place.STREAM for i in range(len(session.units))}
        places.update({held[0]: first, held[1]: second})
        return type(placer.plan)(places, 0, 0)

    whole = kept_for_update(session, plan(Place.RESIDENT, Place.RESIDENT), units, 0, freed)
    assert set(whole) == set(freed)
    some = kept_for_update(session, plan(Place.WEIGHTS, Place.STREAM), units, grads[held[0]],
                                   freed)
    assert set(some) == set(members[held[0]])   # the second does not fit what is left
    assert kept_for_update(session, plan(Place.CPU, Place.STREAM), units, 0, freed) == []
    assert kept_for_update(session, plan(Place.RESIDENT, Place.RESIDENT), units, 0, []) == []


def test_the_first_update_leaves_the_update_window_to_the_streamed_blocks(monkeypatch):
    """The room held gradients may take at the first update is the step's
    non-model bytes less the update window they count, which the streamed
    blocks' update takes ([Note: held gradients at the first update])."""
    model, ref, opt, ref_opt, session, extra = _kept_first_step(monkeypatch)
    extra["bytes"] = 3 << 20
    offered = []
    keep = placer_module.kept_for_update
    monkeypatch.setattr(placer_module, "kept_for_update",
                        lambda s, plan, units, room, freed: (offered.append(room),
                                                             keep(s, plan, units, room, freed))[1])
    data = batches(3)
    assert _backward(model, data[0]) == _backward(ref, data[0])
    window = session.updates.update_window()
    assert 0 < window
    opt.step(); ref_opt.step()
    # the step's non-model bytes were 3 MiB measured and the window assumed
    assert offered == [3 << 20]
    opt.zero_grad(); ref_opt.zero_grad()
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ init=True, frozen
class _Frozen(nn.Module):
    """An embedding, ``layers`` blocks of two linears, a head; every parameter frozen."""

    def __init__(self, layers: int = 8, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
            for _ in range(layers))
        self.head = nn.Linear(width, 32, bias=False)
        self.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _block_bytes(model: _Frozen) -> int:
    return sum(p.nbytes for p in model.blocks[0].parameters())


def _frozen_init(monkeypatch, *, store: LocalStore, kept_blocks: int, **options):
    """A frozen meta model attached with init=True, its estimate keeping about
    ``kept_blocks`` blocks' weights; and the plain model on the same seed."""
    extra = _fake_device(monkeypatch)
    with torch.device("meta"):
        meta = _Frozen()
    torch.manual_seed(SEED)
    ref = _Frozen()
    rest = sum(p.nbytes for m in (ref.embed, ref.head) for p in m.parameters())
    cap = (rest + kept_blocks * _block_bytes(ref)) * 4 // 3 + 4   # the estimate's 3/4
    torch.manual_seed(SEED)
    extra["bytes"] = 0   # the steps need no memory besides the plan: it keeps the cap's worth
    model = attach(meta, client=store, device="cpu", init=True, gpu_memory_bytes=cap,
                   **options)
    return model, ref, extra


def _kept(session) -> list:
    return [tp for tp in session.params.values() if not tp.in_store]


def _outputs(model, n: int = 3) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.arange(12).reshape(2, 6) % 32 + i) for i in range(n)]


def test_init_keeps_frozen_units_on_the_device_and_never_stores_them(monkeypatch):
    # the store holds less than the model: the GPU keeps the rest
    probe = _Frozen()
    whole, block = sum(p.nbytes for p in probe.parameters()), _block_bytes(probe)
    store = LocalStore(pool_bytes=whole - 3 * block)
    model, ref, _ = _frozen_init(monkeypatch, store=store, kept_blocks=5)
    session = session_of(model)
    kept = _kept(session)
    assert kept and all(tp.resident for tp in kept)
    stored = set(store.keys(session.keys.all))
    assert not stored & {tp.key for tp in kept}                  # never written
    assert stored == {tp.key for tp in session.params.values() if tp.in_store}
    assert store.used_bytes <= whole - 3 * block < whole
    assert_same_weights(model, ref)                              # the plain model's init
    want = _outputs(ref)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), want))
    assert session.placer.state is PlacerState.PLACED and set(_kept(session)) == set(kept)
    assert set(store.keys(session.keys.all)) == stored           # running wrote none
    values = {k: v.clone() for k, v in model.state_dict().items()}
    detach(model)                                                # read from the device
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    assert_same_weights(model, ref)


def test_a_demoted_frozen_unit_is_stored_first_and_keeps_its_values(monkeypatch):
    store = LocalStore()
    model, ref, extra = _frozen_init(monkeypatch, store=store, kept_blocks=5)
    session, placer = session_of(model), session_of(model).placer
    want = _outputs(ref)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model, 1), want))
    kept_before = set(_kept(session))
    extra["bytes"] = placer.cap - 2 * _block_bytes(ref)   # the step needed most of the cap
    got = _outputs(model)                                  # measured: placed within less
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    left = kept_before - set(_kept(session))
    assert left and all(not tp.resident and tp.in_store for tp in left)
    stored = set(store.keys(session.keys.all))
    assert {tp.key for tp in left} <= stored
    assert not stored & {tp.key for tp in _kept(session)}
    assert_same_weights(model, ref)
    detach(model)
    assert_same_weights(model, ref)


def test_a_store_too_small_for_a_demotion_raises_and_loses_nothing(monkeypatch):
    probe = _Frozen()
    whole, block = sum(p.nbytes for p in probe.parameters()), _block_bytes(probe)
    store = LocalStore(pool_bytes=whole - 5 * block)
    model, ref, extra = _frozen_init(monkeypatch, store=store, kept_blocks=6)
    session = session_of(model)
    want = _outputs(ref)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model, 1), want))
    kept = set(_kept(session))
    used = store.used_bytes
    extra["bytes"] = session.placer.cap   # nothing may stay: everything must be stored
    with pytest.raises(CapacityError, match="frozen parameters kept only on the GPU"):
        _outputs(model, 1)
    assert set(_kept(session)) == kept and all(tp.resident for tp in kept)
    assert store.used_bytes == used                        # nothing half-written
    assert_same_weights(model, ref)
    detach(model)                                          # needs no store room
    assert_same_weights(model, ref)


def test_kept_frozen_units_are_committed_and_resume_bitwise(monkeypatch):
    store = LocalStore(job="run1")
    model, ref, _ = _frozen_init(monkeypatch, store=store, kept_blocks=5, job="run1")
    session = session_of(model)
    kept = _kept(session)
    assert kept
    want = _outputs(ref)
    tierd.commit(model, None, 1)
    assert all(tp.in_store and tp.resident for tp in kept)   # stored, still on the device
    assert {tp.key for tp in kept} <= set(store.keys(session.keys.all))
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), want))
    store.restart()
    object.__delattr__(model, "_tierd_session")
    torch.manual_seed(SEED + 1)
    again = attach(_Frozen(), client=store, job="run1", resume=True, device="cpu")
    assert_same_weights(again, ref)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(again), want))


def test_kept_units_with_trainable_parameters_train_like_torch(monkeypatch):
    """A LoRA-like model: frozen weights, a trainable bias in every block. The
    kept units' frozen weights are never stored, their trainable biases are
    (masters and state go through the store); training is torch's, bitwise."""
    _fake_device(monkeypatch)["bytes"] = 0
    with torch.device("meta"):
        meta = _Frozen()
    torch.manual_seed(SEED)
    ref = _Frozen()
    for m in (meta, ref):
        for block in m.blocks:
            block[2].bias.requires_grad_(True)
    rest = sum(p.nbytes for mod in (ref.embed, ref.head) for p in mod.parameters())
    store = LocalStore()
    torch.manual_seed(SEED)
    model = attach(meta, client=store, device="cpu", init=True,
                   gpu_memory_bytes=(rest + 5 * _block_bytes(ref)) * 2 + (1 << 30))
    session = session_of(model)
    kept = _kept(session)
    assert kept and all(not tp.param.requires_grad for tp in kept)
    opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                foreach=False)
    for step in range(4):
        ids = (torch.arange(12).reshape(2, 6) * (step + 1)) % 32
        losses = []
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = m(ids).float().pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1], step
    assert session.placer.state is PlacerState.PLACED
    assert not {tp.key for tp in _kept(session)} & set(store.keys(session.keys.all))
    assert_same_weights(model, ref)


def test_a_kept_frozen_parameter_cannot_be_unfrozen(monkeypatch):
    model, ref, _ = _frozen_init(monkeypatch, store=LocalStore(), kept_blocks=5)
    tp = _kept(session_of(model))[0]
    with pytest.raises(StateError, match="set requires_grad before tierd.attach"):
        tp.param.requires_grad_(True)
    assert not tp.param.requires_grad
    assert_same_weights(model, ref)


def test_a_user_write_to_a_kept_parameter_stays_on_the_device(monkeypatch):
    store = LocalStore()
    model, ref, _ = _frozen_init(monkeypatch, store=store, kept_blocks=5)
    session = session_of(model)
    tp = _kept(session)[0]
    name = tp.name
    with torch.no_grad():
        model.get_parameter(name).mul_(0.5)
        ref.get_parameter(name).mul_(0.5)
    assert_same_weights(model, ref)
    assert tp.key not in set(store.keys(session.keys.all)) and not tp.in_store


def test_a_daemon_smaller_than_the_model_attaches_it_and_refuses_to_stream_it(
        monkeypatch, daemon_factory):
    """init=True of a model larger than the daemon's pool + NVMe: the units
    the plan keeps on the (faked) device are never stored, so the capacity
    check and the puts pass; a plan that would stream them is refused with
    the sizes, and nothing is lost."""
    with torch.device("meta"):
        probe = _Frozen(width=256)
    whole = sum(p.nbytes for p in probe.parameters())   # 4.3 MB
    client = tierd.connect(daemon_factory(pool="2MiB", nvme_size="1MiB"))
    extra = _fake_device(monkeypatch)
    extra["bytes"] = 0
    torch.manual_seed(SEED)
    ref = _Frozen(width=256)
    torch.manual_seed(SEED)
    model = attach(_on_meta_frozen(256), client=client, device="cpu", init=True,
                   gpu_memory_bytes=whole * 4 // 3 + 4)
    session = session_of(model)
    assert whole > 3 << 20 and set(_kept(session)) == set(session.params.values())
    assert not client.keys(session.keys.all)
    want = _outputs(ref)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(model), want))
    extra["bytes"] = session.placer.cap   # nothing may stay on the device
    with pytest.raises(CapacityError, match="in the store"):
        _outputs(model, 1)
    assert set(_kept(session)) == set(session.params.values())
    assert_same_weights(model, ref)
    detach(model)
    assert_same_weights(model, ref)


def _on_meta_frozen(width: int) -> _Frozen:
    with torch.device("meta"):
        return _Frozen(width=width)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_kept_frozen_units_live_on_the_device_only(daemon_factory):
    # a real daemon whose pool and NVMe together hold less than the model
    device = torch.device("cuda")
    with torch.device("meta"):
        meta = _Frozen(layers=8, width=1024)          # blocks of 8 MiB in fp32
    whole = sum(p.nbytes for p in meta.parameters())
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        ref = _Frozen(layers=8, width=1024)            # the device's generator, same order
    gc.collect()   # an earlier test's tensors freed during attach would read as less here
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    client = tierd.connect(daemon_factory(pool="32MiB", nvme_size="16MiB"))
    torch.manual_seed(SEED)
    model = attach(meta, client=client, device=device, init=True,
                   gpu_memory_bytes=whole * 4 // 3 + (64 << 20))
    session = session_of(model)
    kept = _kept(session)
    assert whole > 48 << 20 and set(kept) == set(session.params.values())   # all, never stored
    assert all(tp.param.device.type == "cuda" for tp in kept)
    assert torch.cuda.memory_allocated(device) - base >= sum(tp.nbytes for tp in kept)
    assert not {tp.key for tp in kept} & set(client.keys(session.keys.all))
    ids = (torch.arange(12, device=device).reshape(2, 6) % 32)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids), ref(ids))
    got = model.state_dict()
    assert all(torch.equal(got[k].cuda(), v) for k, v in ref.state_dict().items())
    detach(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_measuring_step_keeps_its_gradients_off_the_store(daemon_factory):
    """[Note: the measuring step keeps its gradients on the device], with a
    real daemon and the allocator's peak: the estimate counts every unit whole, no
    gradient key is made in the first step, and training follows torch."""
    device = torch.device("cuda")
    ref = llama().to(device)
    client = tierd.connect(daemon_factory(pool="256MiB"))
    model = attach(copy.deepcopy(ref), client=client, device=device)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    session = session_of(model)
    data = [ids.to(device) for ids in batches(4)]
    loss = model(input_ids=data[0], labels=data[0]).loss
    loss.backward()
    trained = list(session.params.values())
    assert all(tp.resident and tp.grad_on_device for tp in trained)
    assert session.grads.held_bytes == sum(tp.grad_nbytes for tp in trained)
    assert not {tp.grad_key for tp in trained} & set(client.keys(session.keys.all))
    opt.step(); opt.zero_grad()
    assert session.grads.held_bytes == 0 and session.placer.state is PlacerState.PLACED
    ref_loss = ref(input_ids=data[0], labels=data[0]).loss
    ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    got = [loss.item()] + train(model, opt, data[1:])
    want = [ref_loss.item()] + train(ref, ref_opt, data[1:])
    assert got == pytest.approx(want, rel=1e-5)
    assert_same_weights(model, ref, atol=1e-5)
    detach(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_estimate_counts_the_allocators_cache_as_free(monkeypatch, daemon_factory):
    """A model built on the device leaves its parameters' blocks in the
    allocator's cache once attach has stored them: the estimate counts them
    free, as the cap does, not only the driver's free memory."""
    device = torch.device("cuda")
    cached = torch.empty(1 << 30, dtype=torch.uint8, device=device)   # 1 GiB left cached
    del cached
    model = attach(llama().to(device), client=tierd.connect(daemon_factory(pool="256MiB")),
                   device=device)
    given = []
    budget = placer_module.estimate_budget
    monkeypatch.setattr(placer_module, "estimate_budget",
                        lambda cap, margin, free=None: (given.append(free),
                                                        budget(cap, margin, free))[1])
    unallocated = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert unallocated >= 1 << 30
    ids = batches(1)[0].to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(given) == 1
    assert given[0] >= torch.cuda.mem_get_info(device)[0] + (1 << 30)
    detach(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_first_update_counts_the_bytes_it_copies(daemon_factory):
    """The first update in ``step()`` copies every streamed parameter's master
    in and its master and new moments out: the session's copy counters (what
    benches report as PCIe bytes) count them."""
    device = torch.device("cuda")
    model = attach(llama().to(device), client=tierd.connect(daemon_factory(pool="256MiB")),
                   device=device, gpu_memory_bytes=0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    session = session_of(model)
    ids = batches(1)[0].to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    before = session.stats()
    opt.step()
    torch.cuda.synchronize()
    after = session.stats()
    params = sum(tp.param.numel() for tp in session.params.values())
    assert after["h2d_bytes"] - before["h2d_bytes"] >= 4 * params           # the masters
    assert after["d2h_bytes"] - before["d2h_bytes"] >= 12 * params          # masters, moments
    detach(model)
