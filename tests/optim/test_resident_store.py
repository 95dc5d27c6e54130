"""The store holds no copy of what placement keeps on the device, and
moments are made when first needed: the GPU adds room (CPU, explicit
``gpu_memory_bytes``), and every read of the store still sees every value."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.placement import Place
from tierd.client.store import LocalStore
from tierd.errors import CapacityError
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


def _kinds(session) -> dict[str, int]:
    """Stored keys of the model by kind (``p``, ``master``, ``grad``, ``optim``)."""
    out: dict[str, int] = {}
    for key in session.client.keys(session.keys.all):
        kind = key[len(session.keys.prefix) + 1:].split("/")[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def _placed(make, cap, **options):
    ref = make()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=cap, **options)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return model, ref, opt, ref_opt


def test_moments_are_made_by_the_first_update_not_the_constructor():
    model, ref, opt, ref_opt = _placed(llama, None)
    session = session_of(model)
    assert "optim" not in _kinds(session)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    assert _kinds(session)["optim"] == 2 * n      # streamed: both moments stored
    assert_same_weights(model, ref)


def test_resident_state_leaves_the_store_and_is_read_on_the_device():
    model, ref, opt, ref_opt = _placed(llama, 1 << 30)
    data = batches(6)
    assert train(model, opt, data[:3]) == train(ref, ref_opt, data[:3])
    session = session_of(model)
    assert set(session.placer.plan.places.values()) == {Place.RESIDENT}
    assert _kinds(session) == {}          # weights, masters, moments: all on the device
    assert_same_weights(model, ref)       # state_dict reads them there
    assert _kinds(session) == {}          # nothing written back for it
    assert train(model, opt, data[3:]) == train(ref, ref_opt, data[3:])
    assert_same_weights(model, ref)
    tierd.detach(model)                   # the model gets the device values back
    assert_same_weights(model, ref)


def test_bf16_resident_keeps_no_master_or_compute_copy_in_the_store():
    model, ref, opt, ref_opt = _placed(gpt2, 1 << 30, compute_dtype="bf16")
    streamed = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                      compute_dtype="bf16")
    streamed_opt = tierd.optim.AdamW(streamed.parameters(), lr=1e-3, weight_decay=0.01)
    data = batches(4)
    assert train(model, opt, data) == train(streamed, streamed_opt, data)
    assert _kinds(session_of(model)) == {}
    got, want = model.state_dict(), streamed.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_a_half_resident_model_streams_the_rest_from_the_store():
    probe = attach(gpt2(), client=LocalStore(), device="cpu")
    cap = sum(u.nbytes for u in session_of(probe).units) * 5 // 2   # of 4x: not all
    tierd.detach(probe)
    model, ref, opt, ref_opt = _placed(gpt2, cap)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session = session_of(model)
    places = set(session.placer.plan.places.values())
    assert Place.RESIDENT in places and places != {Place.RESIDENT}
    kinds = _kinds(session)
    n = sum(1 for p in model.parameters() if p.requires_grad)
    assert 0 < kinds["optim"] < 2 * n     # the streamed units' moments only
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ a real daemon
def _small_daemon(daemon_factory):
    # ~3.4M params: 13.6 MB of fp32 weights and 27 MB of moments (the first
    # step's 13.6 MB of gradients go as they are used) = 41 MB; the store
    # holds 36 MiB
    return daemon_factory(pool="16MiB", nvme_size="20MiB", extra=("--segment-size", "4MiB"))


def _model():
    return gpt2(n_layer=4, n_embd=256, vocab=1000)


def _owns_parameters(module) -> bool:
    """A unit per module owning parameters (attach's ``unit_modules``): in a
    16 MiB pool half held, a block-sized unit (3 MB here) leaves the
    prefetch window no room; these tests are about the store's accounting."""
    return any(p is not None for p in module._parameters.values())


def test_a_model_larger_than_the_store_trains_with_the_gpu_counted(daemon_factory):
    d = _small_daemon(daemon_factory)
    ref = _model()
    client = tierd.connect(d)
    model = attach(copy.deepcopy(ref), client=client, device="cpu", gpu_memory_bytes=64 << 20,
                   unit_modules=_owns_parameters)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    state = sum(p.numel() * 12 for p in ref.parameters())   # weights and moments
    stats = client.stats()
    assert stats["pool_bytes"] + stats["nvme_bytes"] < state
    assert stats["stored_bytes"] < state // 8   # the device holds the rest
    assert_same_weights(model, ref)             # written back: weights and moments fit


def test_without_the_gpu_the_same_model_is_refused_before_anything_is_stored(daemon_factory):
    d = _small_daemon(daemon_factory)
    client = tierd.connect(d)
    with pytest.raises(CapacityError, match="No GPU room is counted"):
        attach(_model(), client=client, device="cpu")
    assert client.stats()["stored_bytes"] == 0


@pytest.mark.parametrize("filler_mib, refused", [(36, True), (28, False)])
def test_a_store_too_full_for_the_first_update_fails_and_the_same_step_then_trains(
        daemon_factory, filler_mib, refused):
    # 16 MiB of the GPU keeps ~1M of the 3.4M parameters whole: the other
    # 2.4M need 29 MB of weights and moments in the store, which the first
    # step's 14 MB of gradients make room for as they go ([Note: gradients
    # freed as they are used]). 64 MiB hold that, not with 36 MiB of another
    # job's: placement refuses the measured plan, the one estimated at attach
    # (weights only) stays, nothing updated. With 28 MiB the plan fits only
    # counting those gradients, and the store runs out
    # during the update: the parameters not yet updated keep their gradients.
    # Either way the same step() again, with room, trains as torch does.
    d = daemon_factory(pool="16MiB", nvme_size="48MiB", extra=("--segment-size", "4MiB"))
    ref = _model()
    client = tierd.connect(d)
    model = attach(copy.deepcopy(ref), client=client, device="cpu", gpu_memory_bytes=16 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    other = tierd.connect(d, job="other")   # another job fills the store meanwhile
    for i in range(filler_mib):
        other.put(f"filler{i}", torch.zeros(1 << 18))
    data = batches(3, vocab=1000)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = data[0]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with pytest.raises(CapacityError, match="units it streams need .* in the store"
                       if refused else "room"):
        opt.step()
    if refused:
        plan = session_of(model).placer.plan          # still the plan estimated at attach:
        assert plan and not plan.units_at(Place.RESIDENT)   # weights only, nothing updated
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any(tp.grad_in_pool for tp in session_of(model).params.values())
    other.delete([f"filler{i}" for i in range(filler_mib)])
    opt.step()                                         # the same step, now with room
    opt.zero_grad()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert loss.item() == ref_loss.item()
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert_same_weights(model, ref)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_commit_without_room_for_the_resident_values_fails_before_writing(daemon_factory):
    # 3.4M fp32 parameters all kept on the GPU: a commit must put back 41 MB
    # of weights and moments (no moments ever took store room); 32 MiB hold
    # the first step's weights and gradients, not that
    d = daemon_factory(pool="16MiB", nvme_size="16MiB", extra=("--segment-size", "4MiB"))
    ref = _model()
    client = tierd.connect(d, job="run1")
    model = attach(copy.deepcopy(ref), client=client, job="run1", device="cpu",
                   gpu_memory_bytes=64 << 20, unit_modules=_owns_parameters)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(4, vocab=1000)
    assert train(model, opt, data[:2]) == train(ref, ref_opt, data[:2])
    before = client.stats()["stored_bytes"]
    with pytest.raises(CapacityError, match="must go back into the store"):
        tierd.commit(model, opt, 2)
    assert client.stats()["stored_bytes"] == before and client.commits() == []
    assert_same_weights(model, ref)                    # read on the device: no room needed
    with torch.no_grad():                              # an evaluation batch of another shape
        model(input_ids=data[0][:1, :5])
    assert train(model, opt, data[2:]) == train(ref, ref_opt, data[2:])   # goes on
    tierd.detach(model)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("options", [dict(max_grad_norm=1.0), dict(accumulation_steps=2),
                                     dict(fused=False)])
def test_an_optimizer_that_keeps_gradients_every_step_counts_them(daemon_factory, options):
    # 3.4M fp32 parameters: weights and moments (41 MB) fit in 46 MiB, and
    # the fused path frees the first step's gradients as it goes; clipping, a
    # longer window or fused=False keep 13.6 MB more in the store every step:
    # refused when the optimizer is made, before anything is written
    d = daemon_factory(pool="16MiB", nvme_size="30MiB", extra=("--segment-size", "4MiB"))
    client = tierd.connect(d)
    model = attach(_model(), client=client, device="cpu")
    stored = client.stats()["stored_bytes"]
    with pytest.raises(CapacityError, match="gradients"):
        tierd.optim.AdamW(model.parameters(), lr=1e-3, **options)
    assert client.stats()["stored_bytes"] == stored
    tierd.optim.AdamW(model.parameters(), lr=1e-3)   # the fused default fits


def test_a_learned_window_that_keeps_gradients_fails_its_first_update_saying_why(
        daemon_factory):
    # two backwards per step, not declared: the constructor counts the fused
    # default; the first update then needs the state next to every gradient
    d = daemon_factory(pool="16MiB", nvme_size="30MiB", extra=("--segment-size", "4MiB"))
    model = attach(_model(), client=tierd.connect(d), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for ids in batches(2, vocab=1000):
        model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(CapacityError) as err:
        opt.step()
    assert "accumulation_steps=N" in "".join(getattr(err.value, "__notes__", []))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("pool, block_mib, made_ahead, overlap",
                         [("96MiB", 4, True, "all"), ("96MiB", 16, True, "some"),
                          ("16MiB", 4, False, "none"), ("20MiB", 4, False, "none")])
def test_the_first_update_queues_a_block_while_the_last_one_lands(
        daemon_factory, monkeypatch, pool, block_mib, made_ahead, overlap):
    # [Note: one block landing]: with pool room for the 27 MB of moments
    # beside the first step's gradients, they are made before the first
    # update, and each block is leased and queued before the last one's
    # leases go, unless two blocks' leases would pin more than a quarter of
    # the pool (some pairs of 16 MiB blocks in 96 MiB). In a 16 MiB pool the
    # moments are made block by block, in series (the gradients freed as
    # they are used make the room). Each way trains as torch does. In 20 MiB
    # (segments of 1.25 MiB) the second step's fetch of a 1 MiB moment found
    # no hole that large, every segment holding a leased tensor, until the
    # updater gave back what it fetched ahead ([Note: a fetch that finds no
    # room] in tierd.updates.fused); in 16 MiB that happened at times.
    d = daemon_factory(pool=pool, nvme_size="96MiB", extra=("--segment-size", "4MiB"))
    ref = _model()
    model = attach(copy.deepcopy(ref), client=tierd.connect(d), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, block_bytes=block_mib << 20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    cls, landing, begins = type(opt), {}, []   # begins: (blocks landing, bytes leased after)
    begin, end = cls._begin_block, cls._end_block

    def begun(self, group, block, *rest):
        made = "optim" in _kinds(session_of(model))
        landing[block[0].name] = self._leased_bytes(block)
        begins.append((len(landing) - 1, sum(landing.values()), made))
        return begin(self, group, block, *rest)

    def ended(self, done, frees):
        del landing[done.block[0].name]
        return end(self, done, frees)

    monkeypatch.setattr(cls, "_begin_block", begun)
    monkeypatch.setattr(cls, "_end_block", ended)
    data = batches(3, vocab=1000)
    assert train(model, opt, data[:1]) == train(ref, ref_opt, data[:1])
    assert len(begins) > 2 and not landing
    assert begins[0][2] == made_ahead   # the first block's moments made before it
    assert all(n <= session_of(model).lease_cap for k, n, _ in begins if k)   # two at once
    behind = [k for k, _, _ in begins[1:]]
    assert set(behind) <= {0, 1}
    assert {"all": set(behind) == {1}, "some": set(behind) == {0, 1},
            "none": set(behind) == {0}}[overlap], behind
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert_same_weights(model, ref)


@pytest.mark.parametrize("pool, units", [("6MiB", _owns_parameters), ("7MiB", None)])
def test_a_lease_that_finds_no_hole_gets_the_room_leased_ahead(daemon_factory, pool, units):
    # the pool's segments are 1 MiB here (the daemon's least), so each 1 MiB
    # weight or moment needs a segment of its own, with 1-2 MB free in
    # holes smaller than that: a unit's weights, asked at its backward, found
    # no room (its moments fetched ahead, other units prefetched) until what
    # the mover and the updater had leased ahead of need went back
    # ([Note: a fetch that finds no room] in tierd.updates.fused)
    d = daemon_factory(pool=pool, nvme_size="96MiB", extra=("--segment-size", "4MiB"))
    ref = _model()
    options = {} if units is None else {"unit_modules": units}
    model = attach(copy.deepcopy(ref), client=tierd.connect(d), device="cpu", **options)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, block_bytes=4 << 20)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
