"""The optimizer update fused into backward (CPU: same code path, no streams)."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.errors import StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


def _pair(make, daemon, **options):
    ref = make()
    return attach(copy.deepcopy(ref), client=tierd.connect(daemon), **options), ref


def test_fused_accumulation_matches_torch_bitwise_and_keeps_grads_off_the_pool(daemon):
    model, ref = _pair(llama, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, accumulation_steps=3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(9)
    assert train(model, opt, data, accumulate=3) == train(ref, ref_opt, data, accumulate=3)
    assert_same_weights(model, ref)
    assert all(f.learned for f in opt._fused)


def test_fused_step_moves_no_gradient_and_sends_no_request_when_held(daemon):
    model, ref = _pair(gpt2, daemon)
    opt = tierd.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
    data = batches(4)
    session = session_of(model)
    assert session.stats()["held_bytes"] > 0
    assert train(model, opt, data[:2]) == train(ref, ref_opt, data[:2])   # learns
    before = session.stats()
    assert train(model, opt, data[2:]) == train(ref, ref_opt, data[2:])
    after = session.stats()
    assert after["requests"] == before["requests"]   # held leases: no round trip
    assert after["backwards"] - before["backwards"] == 2
    assert after["hook_seconds"] > before["hook_seconds"]
    assert not any(tp.grad_in_pool for tp in session.params.values())
    assert_same_weights(model, ref)


def test_backward_casts_fetched_masters_bitwise_like_the_stored_copy(daemon):
    # [Note: compute copy from the fetched master]: in an updating backward the
    # bf16 weights come from the fp32 masters fetched for the update; the
    # result is bitwise the unfused path's, which copies the stored bf16 in.
    model, _ = _pair(gpt2, daemon, compute_dtype="bf16")
    unfused, _ = _pair(gpt2, daemon, compute_dtype="bf16")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = tierd.optim.AdamW(unfused.parameters(), lr=1e-3, weight_decay=0.1, fused=False)
    data = batches(4)
    assert train(model, opt, data) == train(unfused, ref_opt, data)
    assert_same_weights(model, unfused)
    cast = session_of(model).stats()["master_copy_bytes"]
    bf16 = sum(tp.nbytes for tp in session_of(model).params.values() if tp.has_master)
    assert 3 * bf16 <= cast <= 6 * bf16   # 3 updating backwards; tied weights twice
    assert session_of(unfused).stats()["master_copy_bytes"] == 0


def test_not_held_fused_path_still_matches(daemon):
    model, ref = _pair(gpt2, daemon, hold_fraction=0.0, compute_dtype="fp32")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert session_of(model).stats()["held_bytes"] == 0
    assert_same_weights(model, ref)


def test_broken_window_contract_raises_instead_of_training_wrong(daemon):
    model, _ = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    train(model, opt, [ids])   # learning step (deferred)
    model(input_ids=ids, labels=ids).loss.backward()   # fused update
    with pytest.raises(StateError, match="already run: resume from the last commit.*accumulation_steps"):
        model(input_ids=ids, labels=ids).loss.backward()
    opt2_model, _ = _pair(gpt2, daemon, name="second")
    opt2 = tierd.optim.AdamW(opt2_model.parameters(), lr=1e-3)
    train(opt2_model, opt2, [ids])
    opt2_model(input_ids=ids, labels=ids).loss.backward()
    opt2.step()   # no zero_grad: torch would keep summing gradients we consumed
    with pytest.raises(StateError, match="zero_grad"):
        opt2_model(input_ids=ids, labels=ids).loss.backward()


def test_fused_false_and_clipping_use_the_deferred_path(daemon):
    model, ref = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    assert all(not f.fusing for f in opt._fused)   # buckets kept for placement only
    with pytest.raises(ValueError, match="fused=True"):
        tierd.optim.AdamW(model.parameters(), fused=True, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="accumulation_steps"):
        tierd.optim.AdamW(model.parameters(), accumulation_steps=0)


def test_the_first_step_frees_each_gradient_as_its_update_uses_it(daemon):
    # [Note: gradients freed as they are used]: the first window is updated in
    # step() with every gradient in the store; they go block by block, so no
    # gradient key is left by the end of step(), and p.grad says why.
    model, ref = _pair(llama, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    session = session_of(model)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    grad_keys = [tp.grad_key for tp in session.params.values()]
    assert set(grad_keys) <= set(session.client.keys())
    opt.step()
    assert not set(grad_keys) & set(session.client.keys())   # before zero_grad
    p = next(model.parameters())
    with pytest.raises(StateError, match="already used its gradient"):
        p.grad.sum()
    opt.zero_grad()
    assert p.grad is None
    # and training is torch's, bitwise, from that first step on
    train(ref, ref_opt, batches(1))
    data = batches(3, seed=2)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_the_first_step_keeps_gradients_a_later_window_sums(daemon):
    # a window of several backwards sums gradients in the store every step,
    # and gradients clipped through p.grad are read again: neither is freed early
    for accumulate, clip in ((2, None), (1, 1.0)):
        model, _ = _pair(gpt2, daemon)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        session = session_of(model)
        for ids in batches(accumulate):
            (model(input_ids=ids, labels=ids).loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        p = next(model.parameters())
        assert p.grad.norm() > 0   # still readable before zero_grad, as in torch
        assert {tp.grad_key for tp in session.params.values()} <= set(session.client.keys())
        opt.zero_grad()


def test_each_update_demotes_the_state_it_streamed_and_not_what_stays_on_the_device():
    # [Note: eviction by next use] in tierd.server.eviction: the moments (and a
    # master distinct from the weights) just written back are next needed a
    # whole step later; the weights the next forward reads are not demoted,
    # nor is anything held (never evicted) or kept on the device
    from tierd.client.store import LocalStore
    for cap, hold, streams in ((None, 0.0, True), (None, 0.5, False), (1 << 30, 0.0, False)):
        store = LocalStore()
        model = attach(gpt2(), client=store, device="cpu", gpu_memory_bytes=cap,
                       hold_fraction=hold)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        train(model, opt, batches(3))
        moments = {k for p in model.parameters() for k in opt.state_keys(p.tiered)[1:]}
        if streams:   # every step, each bucket's moments once
            assert set(store.demoted) == moments and len(store.demoted) == 3 * len(moments)
        else:
            assert store.demoted == []


def test_demoting_sends_requests_nobody_waits_for_without_filling_the_socket(daemon):
    # held keys are not demoted, but a loop that demotes and sends nothing
    # else must still get the next reply it waits for
    with tierd.connect(daemon.socket) as c:
        c.put("k", torch.zeros(4))
        for _ in range(5000):
            c.demote_async(["k"])
        assert c.stats()["tensors"] >= 1


def test_a_backward_after_the_first_step_without_zero_grad_raises(daemon):
    # the first step() freed the gradients torch would still add to
    model, _ = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with pytest.raises(StateError, match="without opt.zero_grad"):
        model(input_ids=ids, labels=ids).loss.backward()


def test_a_step_that_failed_part_way_then_dropped_skips_nothing_later(daemon, monkeypatch):
    # step() fails after its first block; the loop drops that batch
    # (model.zero_grad()) and goes on: the next step updates every parameter
    model, _ = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, fused=False, block_bytes=1 << 16)
    real, calls = type(opt)._begin_block, []

    def failing(self, group, block, *rest):
        calls.append(block)
        if len(calls) == 2:   # the first block's copies out still landing
            raise RuntimeError("injected")
        return real(self, group, block, *rest)

    monkeypatch.setattr(type(opt), "_begin_block", failing)
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    model.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    after = model.state_dict()
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_a_first_step_that_failed_and_was_dropped_does_not_lengthen_the_window(
        daemon, monkeypatch):
    model, _ = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    real = type(opt)._begin_block
    monkeypatch.setattr(type(opt), "_begin_block", lambda *a: (_ for _ in ()).throw(
        RuntimeError("injected")))
    ids = batches(1)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    opt.zero_grad()
    monkeypatch.setattr(type(opt), "_begin_block", real)
    train(model, opt, batches(3))
    assert [(f.window, f.fused_backwards > 0) for f in opt._fused] == [(1, True)]


@pytest.mark.parametrize("zero", ["model", "opt"])
def test_zero_grad_without_set_to_none_trains_like_torch(daemon, zero):
    # zero_grad(set_to_none=False) zeroes p.grad in place; after a fused
    # update there is nothing left to zero, and training goes on as torch's
    model, ref = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    for m, o in ((model, opt), (ref, ref_opt)):
        for ids in batches(4):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            (m if zero == "model" else o).zero_grad(set_to_none=False)
    assert_same_weights(model, ref)
