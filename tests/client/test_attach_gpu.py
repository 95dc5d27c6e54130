"""attach() on CUDA: bf16 autocast equivalence and peak memory within budget."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach
from tests.client.models import batches, gpt2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _step(model, opt, ids, autocast: bool) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_bf16_autocast_matches_all_on_gpu(daemon):
    ref = gpt2().cuda()
    model = attach(copy.deepcopy(ref).cpu(), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    for ids in batches(3):
        ids = ids.cuda()
        got = _step(model, opt, ids, autocast=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step(); ref_opt.zero_grad()
        assert got == pytest.approx(loss.item(), rel=1e-3)
    got, want = model.state_dict(), ref.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name].cuda(), value, atol=1e-4, rtol=1e-3, msg=name)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())


def test_peak_memory_within_budget_plus_activations(daemon_factory):
    d = daemon_factory(pool="512MiB", nvme_size="1GiB")
    make = lambda: gpt2(n_layer=8, n_embd=512, vocab=1000)
    ids = batches(1, batch=4, seq=32, vocab=1000)[0].cuda()
    ref = make().cuda()
    params = sum(p.numel() * 4 for p in ref.parameters())
    # what a step needs besides parameters and their grads: with only the
    # embedding trainable (so backward still runs through every layer), the
    # step's peak less that one grad is activations plus backward transients
    for name, p in ref.named_parameters():
        p.requires_grad_(name == "transformer.wte.weight")
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref(input_ids=ids, labels=ids).loss.backward()
    activations = (torch.cuda.max_memory_allocated() - base
                   - ref.transformer.wte.weight.numel() * 4)
    del ref
    budget = 4 * params // 8 // 8
    model = attach(make(), client=tierd.connect(d), gpu_budget_bytes=budget,
                   grad_bucket_bytes=1 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, ids, autocast=False)   # learns the order; updates in step()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(model, opt, ids, autocast=False)   # the update fused into backward
    peak = torch.cuda.max_memory_allocated() - base
    largest = max(p.numel() * 4 for p in model.parameters())
    # fp32 state in flight: at most one unit's master + moments + gradient
    # beyond the budget (the optimizer's prefetch_bytes defaults to it)
    state = 4 * max(sum(p.numel() * 4 for p in m.parameters(recurse=False))
                    for m in model.modules())
    assert peak <= budget + state + 4 * largest + (1 << 20) + activations
    assert peak < params   # never the whole model


def test_fused_update_matches_deferred_on_cuda(daemon):
    ref = gpt2()
    fused = attach(copy.deepcopy(ref), client=tierd.connect(daemon), name="fused")
    deferred = attach(copy.deepcopy(ref), client=tierd.connect(daemon), name="deferred")
    opt_f = tierd.optim.AdamW(fused.parameters(), lr=1e-3, accumulation_steps=2)
    opt_d = tierd.optim.AdamW(deferred.parameters(), lr=1e-3, fused=False)
    for i, ids in enumerate(batches(6)):
        ids = ids.cuda()
        for m, o in ((fused, opt_f), (deferred, opt_d)):
            (m(input_ids=ids, labels=ids).loss / 2).backward()
            if i % 2 == 1:
                o.step(); o.zero_grad()
    got, want = fused.state_dict(), deferred.state_dict()
    for name, value in want.items():   # same kernels; only backward's atomics may differ
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
