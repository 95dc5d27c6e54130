"""Placement: the planner as plain code, then placement applied on the
in-process store (CPU, explicit ``gpu_memory_bytes``) against plain torch."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import tierd
import tierd.optim
import tierd.updates.engine as engine_mod
import tierd.updates.fused as fused_mod
from tierd.client.attach import attach, detach, is_attached, session_of
from tierd.client.placement import (Costs, Place, Placement, UnitBytes, grow_placement,
                                    plan_placement, stored)
from tierd.client.placer import Placer, PlacerState
from tierd.client.store import LocalStore
from tierd.client.tiered_param import ParamState
from tests.client.models import assert_same_weights, batches, gpt2, llama, train

# bf16 compute, AdamW: 2 B/param of weights, 12 B/param of fp32 state
UNITS = [UnitBytes(i, 2 * n, 12 * n) for i, n in enumerate([100, 300, 200, 50])]
TOTAL = sum(u.param_bytes + u.state_bytes for u in UNITS)
DEVICE_PLACES = [Place.STREAM, Place.WEIGHTS, Place.RESIDENT]


# ------------------------------------------------------------------ the planner
def test_everything_resident_when_it_fits_and_nothing_streams():
    plan = plan_placement(UNITS, TOTAL)
    assert set(plan.places.values()) == {Place.RESIDENT}
    assert plan.streamed_bytes == 0 and plan.device_bytes == TOTAL


@pytest.mark.parametrize("budget", [0, 1, 99, 200, 1301, 3000, TOTAL - 1, TOTAL + 7])
def test_never_over_the_budget(budget):
    plan = plan_placement(UNITS, budget)
    assert plan.device_bytes <= budget
    held = sum(u.device_bytes(plan.places[u.index]) for u in UNITS)
    assert held == plan.device_bytes


def test_largest_saving_per_byte_first_weights_then_state():
    weights = sum(u.param_bytes for u in UNITS)
    plan = plan_placement(UNITS, weights)   # room for every compute copy, no state
    assert set(plan.places.values()) == {Place.WEIGHTS}
    everything_streamed = sum(u.streamed(Place.STREAM) for u in UNITS)
    assert plan.streamed_bytes == everything_streamed - 3 * weights
    # no other placement within this budget moves fewer bytes
    for places in itertools.product(DEVICE_PLACES, repeat=len(UNITS)):
        held = sum(u.device_bytes(p) for u, p in zip(UNITS, places))
        if held <= weights:
            assert sum(u.streamed(p) for u, p in zip(UNITS, places)) >= plan.streamed_bytes


def test_state_only_after_the_units_weights():
    extra = UNITS[0].state_bytes
    plan = plan_placement(UNITS, sum(u.param_bytes for u in UNITS) + extra)
    assert Place.STREAM not in plan.places.values()   # every unit's weights first
    whole = plan.units_at(Place.RESIDENT)
    assert whole and sum(UNITS[i].state_bytes for i in whole) <= extra


@pytest.mark.parametrize("n", [16, 40, 7])
def test_units_kept_whole_and_units_streaming_alternate_through_the_model(n):
    """[Note: spread]: of identical blocks, those whose state streams are
    spread between those kept whole, not bunched at the end of the model."""
    units = [UnitBytes(i, 2, 12) for i in range(n)]
    for whole in range(1, n):
        plan = plan_placement(units, 2 * n + 12 * whole)
        kept = plan.units_at(Place.RESIDENT)
        assert len(kept) == whole and len(plan.units_at(Place.WEIGHTS)) == n - whole
        # the longest run of streaming units is no longer than an even share
        runs, run = [], 0
        for i in range(n):
            run = 0 if plan.places[i] is Place.RESIDENT else run + 1
            runs.append(run)
        assert max(runs) <= -(-(n - whole) // (whole + 1)) * 2, (whole, plan.places)


def test_a_larger_measured_step_places_less():
    cap = TOTAL + 1000
    small_step, large_step = 500, 500 + TOTAL // 2
    before = plan_placement(UNITS, cap - small_step)
    after = plan_placement(UNITS, cap - large_step)
    assert before.device_bytes > after.device_bytes
    assert after.streamed_bytes > before.streamed_bytes == 0


def test_a_tight_store_trades_kept_weights_for_whole_units():
    budget = sum(u.param_bytes for u in UNITS) + UNITS[0].state_bytes + 400
    roomy = plan_placement(UNITS, budget)
    assert roomy.units_at(Place.RESIDENT) == [3] and len(roomy.units_at(Place.WEIGHTS)) == 3
    # unit 0 fits whole once unit 2's kept weights go back; units 1 and 2 never fit
    room = stored(UNITS, roomy.places) - UNITS[0].store_bytes
    tight = plan_placement(UNITS, budget, store_bytes=room)
    assert tight.places == {0: Place.RESIDENT, 1: Place.WEIGHTS, 2: Place.STREAM,
                            3: Place.RESIDENT}
    assert stored(UNITS, tight.places) <= room and tight.device_bytes <= budget
    assert tight.streamed_bytes == (roomy.streamed_bytes + 3 * UNITS[2].param_bytes
                                    - 2 * UNITS[0].state_bytes)
    hopeless = plan_placement(UNITS, budget, store_bytes=0)   # returned; the placer refuses
    assert stored(UNITS, hopeless.places) > 0 and hopeless.device_bytes <= budget


def test_units_sharded_over_two_ranks_are_placed_within_each_ranks_budget():
    """[Note: one budget on every rank]: four units' state split between two
    owners (the others keep 100 B of fp32 values each): where replicas fit
    one unit's state beside the weights, each rank fits two of its own."""
    replicas = [UnitBytes(i, 200, 1200) for i in range(4)]
    owners = [UnitBytes(i, 200, 1200, rank_state=(1200, 100) if i % 2 == 0 else (100, 1200))
              for i in range(4)]
    budget = 4 * 200 + 2 * 1200 + 2 * 100
    assert len(plan_placement(replicas, budget).units_at(Place.RESIDENT)) == 2
    plan = plan_placement(owners, budget)
    assert plan.units_at(Place.RESIDENT) == [0, 1, 2, 3]
    assert plan.device_bytes == budget == 4 * 200 + 2 * 1200 + 2 * 100
    assert plan.streamed_bytes == 0
    # a rank short of room holds the plan back for both: one rank's 100 B less
    lopsided = [UnitBytes(i, 200, 1200, rank_state=(1200, 100)) for i in range(4)]
    tight = plan_placement(lopsided, budget)
    assert tight.units_at(Place.RESIDENT) == [1, 2] and tight.device_bytes <= budget
    # the store's room is found on every rank too
    room = stored(owners, plan_placement(owners, 4 * 200).places) - owners[0].store_bytes
    fitted = plan_placement(owners, 4 * 200 + 1200, store_bytes=room)
    assert stored(owners, fitted.places) <= room and fitted.device_bytes <= 4 * 200 + 1200


@pytest.mark.parametrize("small,large", [(0, TOTAL), (300, 2500), (700, 5000), (1000, 1000)])
def test_a_grown_plan_only_moves_units_up_and_stays_within_its_budget(small, large):
    rank = {Place.STREAM: 0, Place.WEIGHTS: 1, Place.RESIDENT: 2}
    plan = plan_placement(UNITS, small)
    grown = grow_placement(UNITS, plan, large)
    assert grown.device_bytes <= max(large, plan.device_bytes)
    assert all(rank[grown.places[i]] >= rank[p] for i, p in plan.places.items())
    if large >= TOTAL:
        assert set(grown.places.values()) == {Place.RESIDENT}
    # where nothing was kept yet, growing is planning afresh
    assert grow_placement(UNITS, plan_placement(UNITS, 0), large).places \
        == plan_placement(UNITS, large).places


def test_growing_keeps_cpu_updated_units_on_the_cpu():
    costs = Costs(copy_bytes_per_s=1.0, host_bytes_per_s=1e9)
    plan = plan_placement(HOST_UNITS, 600, cpu="auto", costs=costs)
    on_cpu = plan.units_at(Place.CPU)
    assert on_cpu and plan.units_at(Place.WEIGHTS)
    grown = grow_placement(HOST_UNITS, plan, 10 ** 9)
    assert grown.units_at(Place.CPU) == on_cpu
    assert set(grown.places.values()) == {Place.CPU, Place.RESIDENT}


def test_units_without_state_only_keep_weights_and_bad_budgets_fail():
    plan = plan_placement([UnitBytes(0, 8, 0)], 100)
    assert plan.places[0] is Place.WEIGHTS
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_placement(UNITS, -1)


# ------------------------------------------------------------------ CPU updates
# bf16 compute and AdamW with an fp32 gradient: 2 + 12 + 4 B/param
HOST_UNITS = [UnitBytes(i, 2 * n, 12 * n, 4 * n) for i, n in enumerate([100, 300, 200, 50])]
HOST_WEIGHTS = sum(u.param_bytes for u in HOST_UNITS)


def _step_time(plan, costs):
    return plan.seconds(costs.copy_bytes_per_s, costs.compute_s, costs.host_bytes_per_s)


def test_a_slow_host_gets_no_cpu_updates():
    costs = Costs(copy_bytes_per_s=1000.0, host_bytes_per_s=1.0)
    plan = plan_placement(HOST_UNITS, HOST_WEIGHTS // 2, cpu="auto", costs=costs)
    assert Place.CPU not in plan.places.values() and plan.host_bytes == 0
    assert plan == plan_placement(HOST_UNITS, HOST_WEIGHTS // 2)


def test_slow_pcie_moves_streamed_units_to_the_cpu_until_it_is_as_slow():
    budget = HOST_UNITS[0].param_bytes + HOST_UNITS[3].param_bytes   # two units' weights
    device_only = plan_placement(HOST_UNITS, budget)
    costs = Costs(copy_bytes_per_s=1000.0, host_bytes_per_s=500.0)
    plan = plan_placement(HOST_UNITS, budget, cpu="auto", costs=costs)
    assert plan.units_at(Place.STREAM)   # the host would be slower with them
    # units holding device bytes stay where they are
    for i, place in device_only.places.items():
        if place is not Place.STREAM:
            assert plan.places[i] is place
    on_host = plan.units_at(Place.CPU)
    assert on_host and plan.device_bytes == device_only.device_bytes
    assert _step_time(plan, costs) < _step_time(device_only, costs)
    pcie_s = plan.streamed_bytes / costs.copy_bytes_per_s
    host_s = plan.host_bytes / costs.host_bytes_per_s
    assert host_s <= pcie_s
    # one more unit on the CPU would make the host the slower side, no faster
    for u in HOST_UNITS:
        if plan.places[u.index] is Place.STREAM:
            assert host_s + u.host_bytes(Place.CPU) / costs.host_bytes_per_s >= pcie_s
    # no choice of places for the streamed units predicts a shorter step
    streamed = [u.index for u in HOST_UNITS if device_only.places[u.index] is Place.STREAM]
    for choice in itertools.product([Place.STREAM, Place.CPU], repeat=len(streamed)):
        places = dict(device_only.places) | dict(zip(streamed, choice))
        other = Placement(places, device_only.device_bytes,
                          sum(u.streamed(places[u.index]) for u in HOST_UNITS),
                          sum(u.host_bytes(places[u.index]) for u in HOST_UNITS))
        assert _step_time(other, costs) >= _step_time(plan, costs)


def test_a_fast_host_and_slow_pcie_update_every_streamed_unit_on_the_cpu():
    costs = Costs(copy_bytes_per_s=1.0, host_bytes_per_s=1e9)
    plan = plan_placement(HOST_UNITS, 0, cpu="auto", costs=costs)
    assert plan.units_at(Place.CPU) == [0, 1, 2, 3]
    assert plan.streamed_bytes == sum(2 * u.param_bytes + u.grad_bytes for u in HOST_UNITS)


def test_optimizer_placement_cpu_keeps_whole_units_and_updates_the_rest_on_the_cpu():
    budget = HOST_WEIGHTS   # room for every compute copy, yet no WEIGHTS under "cpu"
    plan = plan_placement(HOST_UNITS, budget, cpu="all")
    assert Place.WEIGHTS not in plan.places.values() and Place.STREAM not in plan.places.values()
    assert plan.units_at(Place.RESIDENT) and plan.units_at(Place.CPU)
    assert plan.device_bytes <= budget
    everything = plan_placement(HOST_UNITS, TOTAL, cpu="all")
    assert set(everything.places.values()) == {Place.RESIDENT}
    with pytest.raises(ValueError, match="cpu="):
        plan_placement(HOST_UNITS, 0, cpu="sometimes")
    with pytest.raises(ValueError, match="costs"):
        plan_placement(HOST_UNITS, 0, cpu="auto")
    with pytest.raises(ValueError, match="host_bytes_per_s"):
        Costs(copy_bytes_per_s=1.0, host_bytes_per_s=0.0)


# ------------------------------------------------------------------ applied (CPU)
def _train_placed(make, *, cap, data, seed_data=None, dtype="fp32"):
    ref = make()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=cap, compute_dtype=dtype)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return model, ref, opt, ref_opt


def test_resident_units_train_bitwise_like_torch_and_hold_their_state():
    model, ref, opt, ref_opt = _train_placed(llama, cap=1 << 30, data=None)
    data = batches(5)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session = session_of(model)
    assert session.placer.state is PlacerState.PLACED
    assert set(session.placer.plan.places.values()) == {Place.RESIDENT}
    assert all(tp.resident and tp.state is ParamState.DEVICE for tp in session.params.values())
    stats = session.stats()
    assert stats["resident_bytes"] > 0 and stats["planned_pcie_bytes"] == 0
    # units placed whole have nothing to move: their hooks do not call in
    assert session.mover.planner.trace == ()
    assert_same_weights(model, ref)   # state_dict writes resident values back first


def test_a_small_cap_keeps_some_units_and_streams_the_rest():
    make = lambda: gpt2(n_layer=6)   # blocks are units: enough of them to mix places
    probe = attach(make(), client=LocalStore(), device="cpu")
    units = session_of(probe).units
    cap = max(u.nbytes for u in units) * 4 * 21 // 20   # one unit's weights and state, 5 % more
    assert cap < sum(u.nbytes for u in units)           # not every unit's weights
    detach(probe)
    model, ref, opt, ref_opt = _train_placed(make, cap=cap, data=None)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session = session_of(model)
    plan = session.placer.plan
    assert plan.device_bytes <= cap
    assert Place.STREAM in plan.places.values() and Place.WEIGHTS in plan.places.values()
    streamed = set(plan.units_at(Place.STREAM))
    assert streamed and set(session.mover.planner.trace) == streamed   # followed, not re-learned
    assert session.mover.planner.steps_followed >= 1
    assert_same_weights(model, ref)


def test_a_plan_made_with_an_assumed_update_window_grows_into_the_measured_room(monkeypatch):
    # made-up measured peaks (the CPU measures none): the step's own memory,
    # ``extra``, besides what the plan holds; the measuring step has no fused
    # update, so the placer adds its assumed window (twice the model here: nothing fits)
    extra = {"bytes": 1 << 20}
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra["bytes"],
                                                         1 << 40))
    probe = attach(llama(), client=LocalStore(), device="cpu")
    everything = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: 2 * everything)
    model, ref, opt, ref_opt = _train_placed(llama, cap=everything + (2 << 20), data=None)
    placer = session_of(model).placer
    data = batches(6)
    losses = train(model, opt, data[:2])
    assert placer.plan.device_bytes == 0 and placer._window > 0   # step 1: window assumed
    losses += train(model, opt, data[2:3])   # its peak is read at the next forward: grows
    losses += train(model, opt, data[3:4])
    assert placer.state is PlacerState.PLACED and placer.replans == 0
    assert set(placer.plan.places.values()) == {Place.RESIDENT}
    assert placer.resident_bytes() > 0
    extra["bytes"] = 8 << 20   # a later step outgrows it: placed again, not grown again
    losses += train(model, opt, data[4:])
    assert placer.replans == 1 and placer.plan.device_bytes < everything
    assert losses == train(ref, ref_opt, data)   # bitwise, across every change of plan
    assert_same_weights(model, ref)


def test_the_step_after_placing_before_the_update_reads_only_its_own_peak(monkeypatch):
    """[Note: placing before the first update]: a made-up allocator (a peak
    sampled at every module's forward, started afresh by ``_reset_peak``).
    The measuring step, on the plan estimated from sizes, peaks just over
    the cap; the plan placed before its update holds less. The next reading
    must not hold that old peak against the new plan: read so, the step
    looked 1 byte over the cap, and placement placed again, smaller."""
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: 0)
    probe = attach(llama(), client=LocalStore(), device="cpu")
    cap = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    model, ref, opt, ref_opt = _train_placed(llama, cap=cap, data=None)
    placer = session_of(model).placer
    allocator = {"peak": 0, "extra": None}

    def sample(*_):
        if allocator["extra"] is None:   # the first step, on the estimated plan
            allocator["extra"] = cap + 1 - placer.resident_bytes()
        allocator["peak"] = max(allocator["peak"], placer.resident_bytes() + allocator["extra"])

    for m in model.modules():
        m.register_forward_hook(sample)
    monkeypatch.setattr(Placer, "_memory", lambda self: (allocator["peak"], 1 << 40))
    monkeypatch.setattr(Placer, "_reset_peak",
                        lambda self: allocator.update(peak=self.resident_bytes()))
    data = batches(5)
    losses = train(model, opt, data[:1])
    estimated_plan = cap + 1 - allocator["extra"]   # what the measuring step held
    assert placer.state is PlacerState.PLACED and placer.resident_bytes() < estimated_plan
    placed = placer.plan.places
    losses += train(model, opt, data[1:])
    assert placer.replans == 0 and placer.plan.places == placed
    assert losses == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_a_plan_grows_only_into_what_the_device_has_free(monkeypatch):
    # the measured step leaves room under the cap, but the device has little free
    # outside the allocator's cache (fragmented cached blocks may not take new tensors)
    probe = attach(llama(), client=LocalStore(), device="cpu")
    units = session_of(probe).units
    everything = sum(u.nbytes for u in units) * 7   # weights + fp32 state
    free = min(u.nbytes for u in units) * 8   # room for the smallest unit only
    detach(probe)
    monkeypatch.setattr(engine_mod, "update_window", lambda buckets, prefetch: 2 * everything)
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + (1 << 20),
                                                         free))
    model, ref, opt, ref_opt = _train_placed(llama, cap=everything + (2 << 20), data=None)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    placer = session_of(model).placer   # placed with a window assumed, then grown a little
    assert placer.state is PlacerState.PLACED and 0 < placer.plan.device_bytes <= free


def test_new_input_shapes_stream_everything_then_place_again():
    model, ref, opt, ref_opt = _train_placed(gpt2, cap=1 << 30, data=None)
    short, long = batches(3, seq=8), batches(3, seq=16, seed=4)
    assert train(model, opt, short) == train(ref, ref_opt, short)
    placer = session_of(model).placer
    assert placer.state is PlacerState.PLACED
    ids = long[0]
    loss = model(input_ids=ids, labels=ids).loss   # a new length: back to streaming
    assert placer.state is PlacerState.MEASURING and placer.resident_bytes() == 0
    loss.backward()
    opt.step(); opt.zero_grad()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
    assert loss.item() == ref_loss.item()
    assert train(model, opt, long[1:]) == train(ref, ref_opt, long[1:])
    assert placer.state is PlacerState.PLACED
    assert_same_weights(model, ref)


def test_lengths_that_vary_by_batch_run_on_one_plan_for_the_longest(monkeypatch):
    """Made-up peaks that grow with the length: each length is measured once
    (the longer one streams everything for a step), then batches of either
    length run on one plan, made for the longer; bitwise like torch."""
    probe = attach(gpt2(), client=LocalStore(), device="cpu")
    everything = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    peak = {8: 1 << 20, 16: (1 << 20) + everything // 2}   # non-model bytes by length
    seen = {"len": 8}
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + peak[seen["len"]],
                                                         1 << 40))
    model, ref, opt, ref_opt = _train_placed(gpt2, cap=everything + (2 << 20), data=None)
    model.register_forward_pre_hook(   # runs after tierd's: the step's length, for _memory
        lambda m, args, kwargs: seen.update(len=kwargs["input_ids"].shape[1]), with_kwargs=True)
    placer = session_of(model).placer
    short, long = batches(8, seq=8), batches(8, seq=16, seed=4)
    got, want, states = [], [], []
    for ids in (short[0], short[1], long[0], long[1], *[b for pair in zip(short[2:], long[2:])
                                                         for b in pair]):
        got += train(model, opt, [ids])
        want += train(ref, ref_opt, [ids])
        states.append(placer.state)
    assert got == want
    assert_same_weights(model, ref)
    assert states.count(PlacerState.MEASURING) <= 2 and states[-8:] == [PlacerState.PLACED] * 8
    assert placer.replans == 0
    assert 0 < placer.plan.device_bytes <= everything + (2 << 20) - peak[16]


def test_commit_and_resume_with_resident_units():
    store = LocalStore(job="run1")
    model = attach(gpt2(), client=store, job="run1", device="cpu", gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    assert session_of(model).placer.state is PlacerState.PLACED
    tierd.commit(model, opt, 3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, batches(1, seed=7))   # resident values leave the store again
    store.restart()                          # the job holds its commit
    object.__delattr__(model, "_tierd_session")
    again = attach(gpt2(seed=9), client=store, job="run1", resume=True, device="cpu")
    got = again.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def _kept_weights(session) -> list:
    """Parameters placed ``WEIGHTS`` (compute copy on the device, state streamed)."""
    plan = session.placer.plan
    return [tp for i in plan.units_at(Place.WEIGHTS)
            for tp in session.registry.members(session.units[i]) if tp.has_master]


def test_kept_bf16_weights_reach_the_store_at_commit_and_resume_trains_on():
    data, cap = batches(6), _cap_for_half(llama)

    def run(store):
        model = attach(llama(), client=store, job="run1", device="cpu", compute_dtype="bf16",
                       unit_modules=owns_parameters,
                       gpu_memory_bytes=cap)
        return model, tierd.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = run(LocalStore(job="run1"))
    want = train(model, opt, data)
    store = LocalStore(job="run1")
    model, opt = run(store)
    got = train(model, opt, data[:3])
    session = session_of(model)
    kept = _kept_weights(session)
    assert kept

    def stored():
        return session.read([tp.key for tp in kept])

    # a step writes no kept compute copy into the store: the device has the newest
    assert not any(torch.equal(stored()[tp.key], tp.param.data) for tp in kept)
    tierd.commit(model, opt, 3)
    assert all(torch.equal(stored()[tp.key], tp.param.data) for tp in kept)
    store.restart()   # the job holds its commit; the resumed model streams from it first
    object.__delattr__(model, "_tierd_session")
    again = attach(llama(seed=5), client=store, job="run1", resume=True, device="cpu",
                   unit_modules=owns_parameters,
                   compute_dtype="bf16", gpu_memory_bytes=cap)
    opt = tierd.optim.AdamW(again.parameters(), lr=1e-3)
    assert got + train(again, opt, data[3:]) == want


def test_kept_bf16_weights_stream_again_with_their_newest_values():
    short, long = batches(3, seq=8), batches(3, seq=16, seed=4)
    runs = []
    for cap in (None, _cap_for_half(llama)):   # streamed throughout / placed
        model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                       unit_modules=owns_parameters,
                       gpu_memory_bytes=cap)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        losses = train(model, opt, short)
        if cap:
            assert _kept_weights(session_of(model))
        # a new length streams every unit again, from the store
        runs.append((losses + train(model, opt, long), model.state_dict()))
    (streamed, sd0), (placed, sd1) = runs
    assert placed == streamed
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items())


def test_kept_bf16_weights_stream_again_with_their_newest_values_when_the_plan_shrinks(
        monkeypatch):
    """A step whose peak came near the cap makes the plan again within less
    ([Note: a plan made again moves what changes]): the units it no longer
    keeps stream again from the store, whose copies of their bf16 weights
    are older ([Note: kept weights are written when the store is read] in
    tierd.updates.resident); they are written first, and training is bitwise
    the run that streamed throughout."""
    extra = {"bytes": 1 << 20}   # made-up peaks: the step's own memory besides the plan
    data, cap = batches(6), _cap_for_half(llama) + extra["bytes"]
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra["bytes"],
                                                         1 << 40))
    runs = []
    for placed in (False, True):
        model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                       unit_modules=owns_parameters, gpu_memory_bytes=cap if placed else None)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        losses = train(model, opt, data[:3])
        if placed:
            session = session_of(model)
            kept = _kept_weights(session)
            assert kept and all(tp.stale_in_store for tp in kept)
            plan = session.placer.plan
            extra["bytes"] = cap - plan.device_bytes + max(tp.nbytes for tp in kept)
        losses += train(model, opt, data[3:4])
        extra["bytes"] = 1 << 20
        losses += train(model, opt, data[4:])
        if placed:
            assert session.placer.replans == 1 and session.placer.plan.device_bytes < \
                plan.device_bytes
            assert set(kept) - set(_kept_weights(session))   # some stream again
        runs.append((losses, model.state_dict()))
    (streamed, sd0), (placed, sd1) = runs
    assert placed == streamed
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items())


def test_bf16_resident_matches_bf16_streamed_bitwise():
    data = batches(4)
    outs = []
    for cap in (None, 1 << 30):
        model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                       unit_modules=owns_parameters,
                       gpu_memory_bytes=cap)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        outs.append((train(model, opt, data), model.state_dict()))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(outs[0][1][k], v) for k, v in outs[1][1].items())


def owns_parameters(module) -> bool:
    """A unit per module owning parameters (attach's ``unit_modules``): the
    granularity the caps of the tests below are set for (half the model's
    weights; a block-sized unit would not fit)."""
    return any(p is not None for p in module._parameters.values())


def _cap_for_half(make):
    probe = attach(make(), client=LocalStore(), device="cpu", unit_modules=owns_parameters)
    cap = sum(u.nbytes for u in session_of(probe).units) // 2
    detach(probe)
    return cap


@pytest.mark.parametrize("accumulate", [1, 2])
def test_cpu_placement_with_a_cap_keeps_whole_units_and_updates_the_rest_on_the_cpu(accumulate):
    # accumulate=1: the first update frees the resident units' gradient keys,
    # which the CPU placement had made and held
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   unit_modules=owns_parameters,
                   gpu_memory_bytes=4 * _cap_for_half(llama), optimizer_placement="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = batches(6)
    assert train(model, opt, data, accumulate=accumulate) \
        == train(ref, ref_opt, data, accumulate=accumulate)
    session = session_of(model)
    plan = session.placer.plan
    assert set(plan.places.values()) == {Place.RESIDENT, Place.CPU}
    (fused,) = opt._fused
    on_host = {tp for i in plan.units_at(Place.CPU) for tp in session.registry.members(
        session.units[i])}
    assert on_host and all(fused.bucket_of[tp].cpu for tp in on_host)
    assert not any(b.cpu for b in fused.buckets if b.pinned)
    assert fused.host.nbytes > 0
    assert_same_weights(model, ref)


def test_auto_placement_updates_streamed_units_on_the_cpu_when_pcie_is_slow(monkeypatch):
    import tierd.updates.cpu_update as cpu_update
    monkeypatch.setattr(cpu_update, "probe_copy_rate", lambda device: 1e3)   # made up: slow
    monkeypatch.setattr(cpu_update, "probe_host_rate", lambda: 1e12)         # made up: fast
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   unit_modules=owns_parameters,
                   gpu_memory_bytes=_cap_for_half(llama), optimizer_placement="auto")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(5)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    plan = session_of(model).placer.plan
    assert Place.CPU in plan.places.values() and Place.STREAM not in plan.places.values()
    assert Place.WEIGHTS in plan.places.values()   # device units untouched
    assert opt._fused[0].host.nbytes > 0
    assert_same_weights(model, ref)


def test_bad_caps_fail_clearly():
    """A cap below one unit's need: the error says the least that works, and
    the model and store are as they were (a valid attach then trains)."""
    model, store = llama(), LocalStore()
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ValueError, match="a cap must be at least [0-9]+ bytes"):
        attach(model, client=store, device="cpu", gpu_memory_bytes=1000)
    assert not is_attached(model) and store.keys() == []
    assert all(p is params[k] and torch.equal(p, before[k])
               for k, p in model.named_parameters())
    attach(model, client=store, device="cpu", gpu_memory_bytes=1 << 30)
    train(model, tierd.optim.AdamW(model.parameters(), lr=1e-3), batches(2))
    assert model.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match="fraction of the device's memory"):
        attach(llama(), client=LocalStore(), device="cpu", gpu_memory_bytes=0.5)
    with pytest.raises(ValueError, match="gpu_memory_bytes"):
        tierd.AttachConfig(gpu_memory_bytes=1.5)
    with pytest.raises(ValueError, match="gpu_memory_bytes"):
        tierd.AttachConfig(gpu_memory_bytes=-1)
    off = attach(gpt2(), client=LocalStore(), device="cpu", gpu_memory_bytes=0)
    assert session_of(off).placer.state is PlacerState.OFF


@pytest.mark.parametrize("make,options", [(llama, {}), (gpt2, {"compute_dtype": "bf16"}),
                                          (gpt2, {"resident_below_bytes": 4096})],
                         ids=["llama", "gpt2-tied-bf16", "gpt2-small-resident"])
def test_the_least_cap_is_the_largest_units_need(make, options):
    """attach checks the cap on the model before storing anything: the least
    it accepts is what the largest of the session's units needs at once."""
    probe = attach(make(), client=LocalStore(), device="cpu", **options)
    need = max(sum(tp.nbytes + 12 * tp.param.numel() * tp.param.requires_grad
                   for tp in u.params) for u in session_of(probe).units)
    detach(probe)
    with pytest.raises(ValueError, match=f"a cap must be at least {need} bytes"):
        attach(make(), client=LocalStore(), device="cpu", gpu_memory_bytes=need - 1, **options)
    attach(make(), client=LocalStore(), device="cpu", gpu_memory_bytes=need, **options)


def test_a_resume_refused_for_its_cap_keeps_the_jobs_keys():
    store = LocalStore(job="run1")
    model = attach(llama(), client=store, job="run1", device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(2))
    tierd.commit(model, opt, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    store.restart()                            # the job holds its commit
    object.__delattr__(model, "_tierd_session")
    before = store.keys()
    with pytest.raises(ValueError, match="a cap must be at least"):
        attach(llama(seed=9), client=store, job="run1", resume=True, device="cpu",
               gpu_memory_bytes=1000)
    assert before and store.keys() == before   # the committed job's keys are still there
    again = attach(llama(seed=9), client=store, job="run1", resume=True, device="cpu",
                   gpu_memory_bytes=1 << 30)    # the corrected retry resumes
    got = again.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_cap_above_free_memory_warns_and_uses_what_is_free(monkeypatch):
    from tierd.client.attach_config import resolve_cap
    free, total = 10 << 30, 80 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 << 30)
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match="are free on cuda:0"):
        assert resolve_cap(cuda, 40 << 30) == free + (1 << 30)   # the allocator's cache counts
    with pytest.warns(UserWarning, match="are free"):
        assert resolve_cap(cuda, 0.5) == free + (1 << 30)        # 40 GiB of 80
    assert resolve_cap(cuda, 0.1) == 8 << 30
    assert resolve_cap(cuda, None) == free + (1 << 30)


def test_export_of_a_commit_with_resident_units_holds_the_values_at_commit(daemon, tmp_path):
    """``tierd export`` reads the daemon's last commit from NVMe: resident
    weights and optimizer state are in it as they were at the commit."""
    from tierd.archive import export_job
    safetensors = pytest.importorskip("safetensors.torch")
    model = attach(gpt2(), client=tierd.connect(daemon, job="run"), job="run", device="cpu",
                   gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    assert Place.RESIDENT in session_of(model).placer.plan.places.values()
    tierd.commit(model, opt, 3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    keys = session_of(model).keys   # the commit wrote the resident moments down
    with daemon.connect(job="run") as client:
        stored = client.get_many([keys.state("exp_avg", n) for n, _ in model.named_parameters()])
    moments = {n: stored[keys.state("exp_avg", n)] for n, _ in model.named_parameters()}
    train(model, opt, batches(1, seed=7))   # after the commit: not exported
    out = tmp_path / "run.safetensors"
    export_job(daemon.nvme, "run", out, prefix="tierd-attach/run/")
    got = safetensors.load_file(out)
    for name, value in want.items():
        if f"p/{name}" in got:
            assert torch.equal(got[f"p/{name}"], value), name
    assert sum(f"p/{n}" in got for n in want) == len(dict(model.named_parameters()))
    assert all(torch.equal(got[f"optim/exp_avg/{n}"], m) for n, m in moments.items())
    detach(model)


def test_the_daemon_shows_each_jobs_gpu_resident_bytes(daemon):
    import subprocess
    import sys
    model = attach(gpt2(), client=tierd.connect(daemon, job="placed"), job="placed",
                   device="cpu", gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(2))
    session = session_of(model)
    held = session.placer.plan.device_bytes
    assert held > 0
    job = session.client.stats()["jobs"]["placed"]
    assert job["gpu_resident_bytes"] == held
    out = subprocess.run([sys.executable, "-m", "tierd", "status", "--socket", str(daemon.socket)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = out.stdout
    assert "on GPUs" in out and "placed" in out
    detach(model)   # nothing resident any more
    with tierd.connect(daemon, job="placed") as c:
        assert c.stats()["jobs"]["placed"]["gpu_resident_bytes"] == 0


@pytest.mark.parametrize("how", ["max_grad_norm", "clip_grad_norm_"])
def test_clipping_loops_keep_resident_state_on_the_device(how):
    from tierd.updates.buckets import BucketState
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3,
                            max_grad_norm=0.5 if how == "max_grad_norm" else None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(5)
    losses, ref_losses = [], []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if how == "clip_grad_norm_":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step(); opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step(); ref_opt.zero_grad()
        losses.append(loss.item()); ref_losses.append(ref_loss.item())
    assert losses == ref_losses
    buckets = [b for f in opt._fused for b in f.buckets]
    assert buckets and all(b.state is BucketState.RESIDENT for b in buckets)   # kept, not dropped
    assert_same_weights(model, ref)   # the reads write resident state back first


def test_cpu_updates_go_to_the_last_units_in_forward_order_first():
    """Identical units save alike: the host takes the ones updated first in
    backward (last in forward), whose new weights the next forward needs last."""
    units = [UnitBytes(i, 2 * 100, 12 * 100, 4 * 100) for i in range(6)]
    costs = Costs(copy_bytes_per_s=1000.0, host_bytes_per_s=1000.0)
    plan = plan_placement(units, 0, cpu="auto", costs=costs)
    on_host = plan.units_at(Place.CPU)
    assert 0 < len(on_host) < len(units)
    assert on_host == list(range(len(units) - len(on_host), len(units)))


def test_cpu_updates_are_chosen_again_at_the_rate_the_host_reached(monkeypatch):
    """The plan follows the probe (a fast host: every streamed unit updated
    on the CPU); the first step that updates there measures the host far
    slower (made up), so the units stream again; fp32 stays torch's bitwise."""
    import tierd.updates.cpu_update as cpu_update
    monkeypatch.setattr(cpu_update, "probe_copy_rate", lambda device: 1e9)   # made up
    monkeypatch.setattr(cpu_update, "probe_host_rate", lambda: 1e12)         # made up: fast
    run_job = cpu_update.run_job   # measured: slow (each update reports 1000 s more)
    monkeypatch.setattr(cpu_update, "run_job", lambda opt, job: run_job(opt, job) + 1e3)
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   unit_modules=owns_parameters,
                   gpu_memory_bytes=_cap_for_half(llama), optimizer_placement="auto")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    placer, host = session_of(model).placer, opt._fused[0].host
    data = batches(6)
    got, want = train(model, opt, data[:2]), train(ref, ref_opt, data[:2])
    host.wait_all()   # counted as its updates end (a loaded machine may not have ended them)
    assert Place.CPU in placer.plan.places.values() and host.nbytes > 0   # updated there
    got += train(model, opt, data[2:])
    want += train(ref, ref_opt, data[2:])
    assert got == want
    places = set(placer.plan.places.values())
    assert Place.CPU not in places and Place.STREAM in places and Place.WEIGHTS in places
    assert_same_weights(model, ref)


def test_back_to_back_readings_under_the_cap_keep_the_plan_and_a_peak_near_it_replans(
        monkeypatch):
    """[Note: a plan changes for memory, not for a different reading]: steps
    run back to back read higher peaks than the synchronized step the plan
    was made from (blocks freed while a copy may still read them come back
    later); under the cap that is no reason to shrink. A peak within half the
    margin of the cap is: the plan is made again, within less."""
    probe = attach(llama(), client=LocalStore(), device="cpu")
    everything = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    cap = everything + (64 << 20)
    extra = {"bytes": 1 << 20}   # made-up peaks: the step's own memory besides the plan
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra["bytes"],
                                                         1 << 40))
    model, ref, opt, ref_opt = _train_placed(llama, cap=cap, data=None)
    placer = session_of(model).placer
    data = batches(12)
    losses = train(model, opt, data[:4])   # measured, placed (with a window assumed), grown
    assert placer.state is PlacerState.PLACED
    plan = placer.plan
    for i, back_to_back in enumerate([8 << 20, 24 << 20, 4 << 20, 40 << 20, 16 << 20]):
        extra["bytes"] = back_to_back   # up to 40x the synchronized reading, under the cap
        losses += train(model, opt, data[4 + i:5 + i])
    assert placer.replans == 0 and placer.plan is plan
    extra["bytes"] = cap - placer.resident_bytes() + 1   # this step's peak passed the cap
    losses += train(model, opt, data[9:10])
    losses += train(model, opt, data[10:])
    assert placer.replans == 1 and placer.plan.device_bytes < plan.device_bytes
    assert losses == train(ref, ref_opt, data)   # bitwise, across the change of plan
    assert_same_weights(model, ref)


def test_a_plan_made_again_within_less_moves_only_the_units_that_change(monkeypatch):
    """[Note: a plan made again moves what changes]: a step whose peak came
    near the cap makes the plan again from the one applied: only the units
    no longer kept whole write their state to the store; those that stay keep
    it on the device, and training is bitwise torch's across the change."""
    make = lambda: gpt2(n_layer=6)
    probe = attach(make(), client=LocalStore(), device="cpu")
    everything = sum(u.nbytes for u in session_of(probe).units) * 7   # weights + fp32 state
    detach(probe)
    cap = everything + (64 << 20)
    extra = {"bytes": 1 << 20}
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra["bytes"],
                                                         1 << 40))
    written = []
    monkeypatch.setattr(fused_mod, "write_back",
                        (lambda real: lambda session, opt, b: (written.append(set(b.tps)),
                                                               real(session, opt, b)))(
                            fused_mod.write_back))
    model, ref, opt, ref_opt = _train_placed(make, cap=cap, data=None)
    session, placer = session_of(model), session_of(model).placer
    data = batches(8)
    losses = train(model, opt, data[:4])
    plan = placer.plan
    whole = set(plan.units_at(Place.RESIDENT))
    assert placer.state is PlacerState.PLACED and len(whole) == len(session.units)
    state = max(u.state_bytes for u in placer.unit_bytes())
    extra["bytes"] = cap - plan.device_bytes + 3 * state // 2   # 1.5 units' state over the cap
    written.clear()
    losses += train(model, opt, data[4:5])
    assert placer.replans == 1 and placer.plan.device_bytes < plan.device_bytes
    stays = set(placer.plan.units_at(Place.RESIDENT))
    assert stays and stays < whole
    members = lambda units: {tp for i in units
                             for tp in session.registry.members(session.units[i])}
    assert written and all(tps & members(whole - stays) for tps in written)
    assert not any(tps & members(stays) for tps in written)
    extra["bytes"] = 1 << 20
    losses += train(model, opt, data[5:])
    assert losses == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_decoding_places_once_though_the_attention_mask_grows_each_token(caplog):
    """Decoding with a KV cache passes an attention mask one token longer
    every call (as transformers 4.x's ``generate`` does): a forward without
    autograd within an eighth of a measured shape runs on the plan, so the
    model is placed after the prompt's forward instead of streaming
    everything again for every token; a prompt twice as long is measured."""
    ref = llama().eval()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=1 << 30)
    placer = session_of(model).placer
    prompt = batches(1, batch=1, seq=16)[0]

    def decode(m, tokens: int) -> list[int]:
        ids, mask = prompt, torch.ones_like(prompt)
        out = m(input_ids=ids, attention_mask=mask, use_cache=True)
        got = []
        for _ in range(tokens):
            ids = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            got.append(int(ids))
            out = m(input_ids=ids, attention_mask=mask, past_key_values=out.past_key_values,
                    use_cache=True)
        return got

    with caplog.at_level("INFO", logger="tierd.placement"), torch.no_grad():
        assert decode(model, 2) == decode(ref, 2)   # 18 tokens: within an eighth of 16
    assert placer.state is PlacerState.PLACED and placer.resident_bytes() > 0
    assert "inputs changed" not in caplog.text
    with torch.no_grad():
        model(torch.cat([prompt, prompt], dim=1))
    assert placer.state is PlacerState.MEASURING
    detach(model)


def test_a_placed_step_that_made_the_allocator_retry_is_read_at_its_reserved_peak(monkeypatch):
    """[Note: the allocator's retries]: a step on the plan whose allocations
    made the caching allocator free its cache and retry (device figures faked
    through ``Placer._retries``, ``_reserved_peak`` and ``_memory``) is read
    at what the allocator reserved, which met the device: the plan is made
    again once, smaller by that, and stays, also when later steps retry (once
    per measured shape); steps that reserve past the cap without retrying
    change nothing; training is bitwise torch's."""
    cap = 1 << 30
    device = {"retries": 0, "reserved": 0}
    monkeypatch.setattr(Placer, "_retries", lambda self: device["retries"])
    monkeypatch.setattr(Placer, "_reserved_peak", lambda self: device["reserved"])
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + (1 << 20),
                                                         1 << 40))
    model, ref, opt, ref_opt = _train_placed(llama, cap=cap, data=None)
    placer = session_of(model).placer
    data = batches(9)
    losses = train(model, opt, data[:3])
    assert placer.state is PlacerState.PLACED
    plan = placer.plan
    device["reserved"] = cap + (64 << 20)   # cached past the cap, no retry: no reason
    losses += train(model, opt, data[3:5])
    assert placer.plan is plan and placer.replans == 0
    device["retries"] += 3                  # this step retried: the device was full
    device["reserved"] = cap + (1 << 20)    # (the smaller plan keeps something resident)
    losses += train(model, opt, data[5:6])
    losses += train(model, opt, data[6:7])
    assert placer.replans == 1 and placer.plan.device_bytes < plan.device_bytes
    smaller = placer.plan
    assert smaller.device_bytes > 0
    device["retries"] += 2                  # the step after the change retries too
    losses += train(model, opt, data[7:])   # ... and the plan stays
    assert placer.plan is smaller and placer.replans == 1
    assert losses == train(ref, ref_opt, data)
