"""Activation tiering against plain torch, on a real daemon: same losses, same
grads (bitwise, fp32), and the pool given back after every step.

Every test that claims tiering happened asserts the store copied bytes out
(``stats()["d2h_bytes"] > 0``): tiny models save tensors far below the default
``min_bytes`` (1 MiB), so without that check a test could pass with nothing
offloaded. Most tests pass ``min_bytes=0``; the attach tests use a vocabulary
large enough that the loss's saved logits cross the default threshold."""

from __future__ import annotations

import copy
import itertools
import logging
import threading

import pytest
import torch
from torch import nn

import tierd
import tierd.optim
from tierd.client.activations import (ActivationConfig, AutoStage, BlockMode, find_blocks,
                                     tier_activations)
from tierd.client.activations import auto
from tierd.client.attach import attach, detach, session_of
from tierd.errors import StateError, UnknownKey
from tests.client.models import assert_same_weights, batches, gpt2, llama, train
from tests.conftest import start_daemon

VOCAB = 128
SMALL = dict(min_bytes=0, chunk_bytes=64 << 10, verbose=False)


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One daemon for the tests that need no special pool (starting one takes seconds)."""
    d = start_daemon(tmp_path_factory.mktemp("act"))
    yield d
    d.stop()


@pytest.fixture
def client(shared_daemon):
    c = shared_daemon.connect()
    yield c
    c.close()


def _gpt2(**kw):
    return gpt2(vocab=VOCAB, **kw)


def _llama():
    return llama()


def _data(model, n: int, **kw):
    return batches(n, vocab=model.config.vocab_size, **kw)


def _steps(model, data, *, after_step=None) -> list[tuple[float, dict]]:
    """Loss and parameter grads of each batch (grads zeroed between)."""
    out = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                  if p.grad is not None}))
        model.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
    return out


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for (loss, grads), (ref_loss, ref_grads) in zip(got, want):
        assert loss == ref_loss
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            assert torch.equal(grads[name], ref_grads[name]), name


def _pool_used(client) -> int:
    return client.stats()["pool_used_bytes"]


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_policies_match_torch_bitwise_and_give_the_pool_back(client, make, policy):
    ref = make()
    data = _data(ref, 2)
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy=policy, **SMALL)
    used = []
    got = _steps(model, data, after_step=lambda: used.append(_pool_used(client)))
    _assert_same(got, want)
    assert used == [baseline] * len(data)
    stats = handle.stats()
    assert stats["live_chunks"] == 0
    if policy in ("offload", "auto"):   # auto offloads in its measuring step
        assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] >= stats["d2h_bytes"] // 2
    else:
        assert stats["d2h_bytes"] == 0
    handle.close()
    assert _pool_used(client) == baseline


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_bf16_autocast_steps_match_torch_bitwise(client, policy):
    """Under autocast (what training on a GPU uses) saved tensors are bf16 and
    the weights' bf16 casts are saved too: both round-trip exactly."""
    ref = _gpt2()
    data = batches(2, vocab=VOCAB, batch=4, seq=32)

    def steps(model):
        out = []
        for ids in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out

    want = steps(ref)
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy=policy, budget_bytes=0, **SMALL)
    _assert_same(steps(model), want)
    if policy != "recompute":
        assert handle.stats()["d2h_bytes"] > 0
    handle.close()


def _logged(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "tierd.activations" and r.levelno == level]


def test_auto_within_a_budget_mixes_modes_and_logs_its_plan_once(client, caplog):
    caplog.set_level(logging.INFO, logger="tierd.activations")
    ref = _gpt2(n_layer=4)
    data = batches(3, vocab=VOCAB)
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy="auto", budget_bytes=400 << 10,
                              min_bytes=0, chunk_bytes=64 << 10)
    _assert_same(_steps(model, data), want)
    plans = _logged(caplog)
    assert len(plans) == 1 and plans[0].startswith("tierd activations plan"), plans
    modes = {m.value for m in handle.plan.modes}
    assert modes - {"keep"}, handle.plan       # the budget forced something off
    assert handle.plan.fits and handle.plan.memory <= 400 << 10
    assert handle.check is None                # no allocator to read on CPU
    handle.close()


def _auto_with_allocator(client, monkeypatch, read, budget: int):
    """``auto`` on CPU as on CUDA: ``read`` stands for the allocator's count."""
    monkeypatch.setattr(auto, "_allocated_reader", lambda device: read)
    ref = _gpt2(n_layer=4)
    data = batches(3, vocab=VOCAB)
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy="auto", budget_bytes=budget,
                              min_bytes=0, chunk_bytes=64 << 10)
    _assert_same(_steps(model, data), want)    # profile, check, then the plan kept
    assert handle.stage is AutoStage.DONE and handle.check is not None
    return handle


def test_auto_checks_its_first_step_and_keeps_the_plan_when_none_fits(client, caplog,
                                                                      monkeypatch):
    """Each read finds 64 KiB more than the last: the reads fall to the points
    in step order (blocks' forwards, the rest's, then backward from the rest
    to block 0), and the step is far over the budget, so far that no plan
    fits what it measured: the plan that ran stays, with a warning, and the
    steps still match torch bitwise. (When a plan fits, it is made again:
    the plain-code tests of check_plan.)"""
    caplog.set_level(logging.INFO, logger="tierd.activations")
    reads = itertools.count()
    handle = _auto_with_allocator(client, monkeypatch, lambda: next(reads) << 16, 400 << 10)
    forward, backward = handle.check.step.forward, handle.check.step.backward
    assert list(forward) == sorted(set(forward))
    assert list(backward) == sorted(set(backward), reverse=True)
    assert min(backward) > max(forward)
    assert handle.check.measured > 400 << 10
    assert handle.check.plan is None and handle.plan is handle.check.ran
    assert len(_logged(caplog)) == 1
    warnings = _logged(caplog, logging.WARNING)
    assert len(warnings) == 1 and "no plan fits it" in warnings[0]
    handle.close()


def test_auto_keeps_its_plan_when_its_first_step_kept_within_the_budget(client, caplog,
                                                                        monkeypatch):
    # a budget all of it fits in: nothing is offloaded, so no unpack reaches
    # the store, and the check still ends with the backward
    caplog.set_level(logging.INFO, logger="tierd.activations")
    handle = _auto_with_allocator(client, monkeypatch, lambda: 0, 1 << 30)
    assert set(handle.plan.modes) == {BlockMode.KEEP}
    assert handle.check.plan is None and handle.check.ran is handle.plan
    assert len(_logged(caplog)) == 1 and not _logged(caplog, logging.WARNING)
    handle.close()


def test_with_attach_params_and_activations_offloaded_together(client):
    ref = _gpt2()
    model = attach(copy.deepcopy(ref), client=client)
    handle = tier_activations(model, client, policy="offload", device="cpu", **SMALL)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3, vocab=VOCAB)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    assert handle.stats()["d2h_bytes"] > 0 and handle.stats()["live_chunks"] == 0
    handle.close()


@pytest.mark.parametrize("reentrant,policy", [(True, "offload"), (False, "offload"),
                                              (True, "recompute"), (False, "recompute"),
                                              (False, "auto")])
@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_gradient_checkpointing_already_in_the_model(client, reentrant, policy):
    ref = _gpt2()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    data = batches(2, vocab=VOCAB)
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy=policy, **SMALL)
    _assert_same(_steps(model, data), want)
    assert _pool_used(client) == baseline
    if policy != "recompute":
        assert handle.stats()["d2h_bytes"] > 0
    handle.close()


class _Views(nn.Module):
    """Saves one tensor twice and views of one storage; its weight is big."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 128)
        self.big = nn.Parameter(torch.randn(256, 256) * 0.01)

    def forward(self, x):
        h = self.lin(x)                        # (B, 128): one storage
        sq = h * h                             # saves h twice (one record)
        q, k = h.split(64, dim=-1)             # views of h's storage
        s = q @ k.transpose(0, 1)              # saves the views
        return sq.sum() + s.sum() + (x @ self.big[:64, :64]).sum()


def test_saved_twice_and_views_share_one_copy_and_parameters_are_not_copied(client):
    torch.manual_seed(0)
    ref = _Views()
    x = torch.randn(32, 64)
    ref(x).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model = copy.deepcopy(ref)
    model.zero_grad()
    handle = tier_activations(model, client, policy="offload", blocks=[], **SMALL)
    model(x).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    stats = handle.stats()
    # h (32x128 fp32) is copied once, whatever number of times or views it
    # was saved as; x is a leaf without grad (copied), big.[...] never is.
    assert stats["d2h_bytes"] == 32 * 128 * 4 + 32 * 64 * 4
    assert stats["deduped"] >= 3
    handle.close()


def test_min_bytes_leaves_smaller_saved_tensors_in_place(client):
    """Only saved tensors of at least ``min_bytes`` are copied; the default
    (1 MiB) copies nothing of a small model, and grads are the same either way."""
    torch.manual_seed(0)
    ref = _Views()
    x = torch.randn(32, 64)
    ref(x).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    copied = {}
    for min_bytes in (12 << 10, None):   # h is 16 KiB, x 8 KiB
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        options = {} if min_bytes is None else {"min_bytes": min_bytes}
        handle = tier_activations(model, client, policy="offload", blocks=[],
                                  chunk_bytes=64 << 10, verbose=False, **options)
        model(x).backward()
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, want[n]), n
        copied[min_bytes] = handle.stats()["d2h_bytes"]
        assert handle.config.min_bytes == (1 << 20 if min_bytes is None else min_bytes)
        handle.close()
    assert copied == {12 << 10: 32 * 128 * 4, None: 0}


@pytest.mark.parametrize("options", [dict(activations="offload"),
                                     dict(activations=ActivationConfig(policy="auto", budget_bytes=0))],
                         ids=["offload", "auto"])
def test_attach_with_the_default_min_bytes_offloads_and_matches_torch(client, options):
    """``attach(activations=...)`` tiers with the default ``min_bytes`` (attach
    has no option for it): a vocabulary of 2048 makes the loss save 2 MiB of
    logits, so bytes do reach the pool, and training stays bitwise."""
    ref = gpt2(vocab=2048)
    model = attach(copy.deepcopy(ref), client=client, **options)
    handle = session_of(model).activations
    assert handle.config.min_bytes == 1 << 20
    data = batches(3, batch=8, seq=32, vocab=2048)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    stats = handle.stats()
    assert stats["d2h_bytes"] >= 1 << 20 and stats["h2d_bytes"] >= stats["d2h_bytes"] // 2
    assert stats["live_chunks"] == 0
    detach(model)
    assert handle._closed


def test_auto_with_nothing_to_offload_ends_its_profile_and_placement_goes_on():
    """Every activation under ``min_bytes``: the profiling step offloads none,
    yet its backward still ends the profile (all blocks kept), so placement,
    which waits for the final activation plan, places the model."""
    from tierd.client.placer import PlacerState
    from tierd.client.store import LocalStore
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=1 << 30, activations=ActivationConfig(policy="auto"))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session = session_of(model)
    assert session.activations.auto.stage is AutoStage.DONE
    assert set(session.activations.modes) == {BlockMode.KEEP}
    assert session.placer.state is PlacerState.PLACED
    assert_same_weights(model, ref)


def test_inference_saves_nothing(client):
    model = _gpt2()
    handle = tier_activations(model, client, policy="offload", **SMALL)
    ids = batches(1, vocab=VOCAB)[0]
    with torch.no_grad():
        model(input_ids=ids)
    with torch.inference_mode():
        model(input_ids=ids)
    assert handle.stats()["records"] == 0 and handle.stats()["chunks"] == 0
    handle.close()


class _Boom(Exception):
    pass


def test_exception_mid_forward_leaves_no_pool_use_behind(client):
    model = _gpt2(n_layer=3)
    ref = copy.deepcopy(model)
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy="offload", **SMALL)
    blocks = find_blocks(model)
    hook = blocks[2].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(_Boom()))
    ids = batches(1, vocab=VOCAB)[0]
    with pytest.raises(_Boom):
        model(input_ids=ids, labels=ids)
    assert handle.stats()["d2h_bytes"] > 0      # blocks 0 and 1 were offloaded
    assert _pool_used(client) == baseline
    hook.remove()
    handle_ok = _steps(model, [ids])              # the next step works as usual
    _assert_same(handle_ok, _steps(ref, [ids]))
    assert _pool_used(client) == baseline
    handle.close()


def test_close_with_a_graph_pending_gives_the_pool_back(client):
    model = _gpt2()
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy="offload", **SMALL)
    ids = batches(1, vocab=VOCAB)[0]
    loss = model(input_ids=ids, labels=ids).loss
    assert _pool_used(client) > baseline
    handle.close()
    assert _pool_used(client) == baseline
    with pytest.raises(StateError, match="dropped"):
        loss.backward()


def test_chunks_deleted_behind_the_store_fail_the_backward_and_close_still_returns(client):
    """A lease request that failed is not read again (a reply is read once:
    reading it again waited for ever); close gives back what is left."""
    model = _gpt2()
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy="offload", **SMALL)
    ids = batches(1, vocab=VOCAB)[0]
    loss = model(input_ids=ids, labels=ids).loss
    handle.store.flush()
    client.delete(client.keys(handle.store.prefix))
    with pytest.raises(UnknownKey):
        loss.backward()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            handle.close()
        except BaseException as exc:   # reported below, not lost in the thread
            errors.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(120)   # a guard against hanging, not a timing: close takes milliseconds
    assert not closer.is_alive(), "close() hung on a failed lease"
    assert errors == []
    assert _pool_used(client) == baseline


def test_retain_graph_backward_twice(client):
    ref = _gpt2()
    ids = batches(1, vocab=VOCAB)[0]
    loss = ref(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    baseline = _pool_used(client)
    handle = tier_activations(model, client, policy="offload", **SMALL)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    stats = handle.stats()
    assert stats["d2h_bytes"] > 0 and stats["h2d_bytes"] >= stats["d2h_bytes"]
    del loss
    handle.store.sweep()
    assert _pool_used(client) == baseline
    handle.close()


def test_pool_smaller_than_the_activations_spills_to_nvme(daemon_factory):
    d = daemon_factory(pool="4MiB", nvme_size="256MiB", extra=("--segment-size", "1MiB"))
    client = tierd.connect(d)
    ref = _gpt2(n_layer=2, n_embd=128)
    data = batches(1, batch=8, seq=32, vocab=VOCAB)
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy="offload", min_bytes=0, verbose=False)
    got = _steps(model, data)
    _assert_same(got, want)
    stats = client.stats()
    assert handle.stats()["d2h_bytes"] > stats["pool_bytes"]
    assert stats["bytes_to_nvme"] > 0 and stats["bytes_to_pool"] > 0
    assert stats["pool_used_bytes"] == 0
    handle.close()


def test_policy_none_installs_nothing_and_bad_options_name_the_field(client):
    model = _gpt2()
    handle = tier_activations(model, client, policy=None)
    assert not model._forward_pre_hooks
    handle.close()
    with pytest.raises(ValueError, match="policy="):
        tier_activations(model, client, policy="swap")
    with pytest.raises(ValueError, match="min_bytes"):
        tier_activations(model, client, min_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["offload", "auto"])
def test_cuda_offload_matches_and_lowers_peak_memory(client, policy):
    ref = _gpt2(n_layer=4, n_embd=256).cuda()
    data = [ids.cuda() for ids in batches(2, batch=8, seq=32, vocab=VOCAB)]
    want = _steps(ref, data)
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy=policy, min_bytes=1 << 10,
                              budget_bytes=1 << 20, verbose=False)
    got = _steps(model, data)
    _assert_same(got, want)
    assert handle.stats()["d2h_bytes"] > 0 and handle.stats()["live_chunks"] == 0
    handle.close()


def test_backward_frees_restored_tensors_as_it_goes(client):
    """Restored saved tensors live from shortly before their node to just after
    it: the store's count of restored bytes still referenced stays within the
    prefetch window plus what one node uses, far below the bytes saved (it was
    all of them when prefetch skipped, without counting, what it had brought
    back already, so the window grew at every unpack)."""
    ref = _gpt2(n_layer=6)
    ids = batches(1, vocab=VOCAB, batch=4, seq=32)[0]
    want = _steps(ref, [ids])
    model = copy.deepcopy(ref)
    handle = tier_activations(model, client, policy="offload", prefetch_bytes=256 << 10,
                              **SMALL)
    _assert_same(_steps(model, [ids]), want)
    stats = handle.store.stats
    assert stats.records > 50 and stats.h2d_bytes >= stats.d2h_bytes
    assert 0 < stats.restored_peak_bytes <= stats.d2h_bytes // 4, (
        stats.restored_peak_bytes, stats.d2h_bytes)
    assert handle.store.restored_bytes() == 0   # nothing restored outlives backward
    handle.close()
