"""attach() on CUDA: bf16 autocast equivalence, peak memory within budget
(streaming: ``gpu_memory_bytes=0``), and placement (the default: units that
fit stay on the device) giving the streamed path's values bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
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
    model = attach(copy.deepcopy(ref).cpu(), client=tierd.connect(daemon), gpu_memory_bytes=0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    # on CUDA tierd's AdamW is torch's fused kernel
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
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
    assert all(tp.storage_bytes == 0 for tp in session_of(model).params.values())


def test_peak_memory_within_budget_plus_activations(daemon_factory):
    """Peak GPU memory of a step is activations plus what tierd keeps in flight:
    parameters (the budget, plus the unit running now, plus the next step's
    first weights kept at the end of backward, at most the budget again), the
    fused optimizer's fp32 state (up to twice its prefetch bytes, plus the
    bucket being updated) and one unit's gradients; what tierd holds is well
    under the model. Few tokens, so the activations are small next to the model."""
    d = daemon_factory(pool="512MiB", nvme_size="1GiB")
    make = lambda: gpt2(n_layer=8, n_embd=512, vocab=1000)
    ids = batches(1, batch=2, seq=16, vocab=1000)[0].cuda()
    ref = make().cuda()
    params = sum(p.numel() * 4 for p in ref.parameters())
    # activations plus backward transients: with only the embedding trainable
    # (so backward still runs through every layer), the peak less its grad
    for name, p in ref.named_parameters():
        p.requires_grad_(name == "transformer.wte.weight")
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ref(input_ids=ids, labels=ids).loss.backward()
    activations = (torch.cuda.max_memory_allocated() - base
                   - ref.transformer.wte.weight.numel() * 4)
    del ref
    budget = 4 * params // 8 // 8
    model = attach(make(), client=tierd.connect(d), gpu_budget_bytes=budget, gpu_memory_bytes=0,
                   grad_bucket_bytes=1 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)   # prefetch_bytes = budget
    _step(model, opt, ids, autocast=False)   # learns the order; updates in step()
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _step(model, opt, ids, autocast=False)   # the update fused into backward
    peak = torch.cuda.max_memory_allocated() - base
    units = session_of(model).units   # a block each, and the rest (held all forward)
    unit = max(u.nbytes for u in units)   # fp32 bytes of the largest unit
    in_flight = (2 * budget + unit) + (2 * budget + 3 * unit) + unit + units[0].nbytes
    assert peak <= activations + in_flight + (4 << 20)
    # a unit is a whole block (an eighth of this model) and the rest is held
    # for the whole forward: what tierd holds stays well under the model
    assert peak - activations < 0.7 * params


def test_fused_steps_cast_masters_and_keep_first_weights_bitwise(daemon):
    """In an updating backward the bf16 weights are cast from the fp32 masters
    fetched for the update, and the new values of the weights the next forward
    uses first stay on the device, within the budget ([Note: compute copy from
    the fetched master], [Note: new values kept for the next step]). Both are
    bitwise the unfused path's, which copies every stored bf16 value in."""
    make = lambda: gpt2(n_layer=4, n_embd=128)
    block = sum(p.numel() * 2 for p in make().transformer.h[0].parameters())
    budget = 2 * block
    model = attach(make(), client=tierd.connect(daemon), compute_dtype="bf16", gpu_memory_bytes=0,
                   gpu_budget_bytes=budget)
    unfused = attach(make(), client=tierd.connect(daemon), compute_dtype="bf16", gpu_memory_bytes=0,
                     gpu_budget_bytes=budget)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = tierd.optim.AdamW(unfused.parameters(), lr=1e-3, weight_decay=0.1, fused=False)
    for ids in batches(4):
        ids = ids.cuda()
        assert _step(model, opt, ids, autocast=True) == _step(unfused, ref_opt, ids,
                                                                autocast=True)
        assert sum(tp.storage_bytes for tp in session_of(model).params.values()) <= budget
    session = session_of(model)
    kept = [tp for tp in session.params.values() if tp.storage_bytes]
    assert kept, "the first weights of the next step stay on the device"
    first = {tp for i in session.mover.planner.head() for tp in session.units[i].params}
    assert set(kept) <= first
    values = {tp.key: tp.param.detach().cpu().clone() for tp in kept}
    stored = session.read(list(values))
    assert all(torch.equal(values[k], stored[k]) for k in values)
    assert session.stats()["master_copy_bytes"] > 0
    assert session_of(unfused).stats()["master_copy_bytes"] == 0
    got, want = model.state_dict(), unfused.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(tp.storage_bytes == 0 for tp in session_of(model).params.values())


def _train_bf16(model, opt, data) -> list[float]:
    return [_step(model, opt, ids.cuda(), autocast=True) for ids in data]


@pytest.mark.parametrize("cap", [None, 24 << 20], ids=["all-fits", "capped"])
def test_resident_and_streamed_units_give_bitwise_the_same_values(daemon, cap):
    from tierd.client.placer import PlacerState
    data = batches(6, batch=2, seq=16) + batches(2, batch=3, seq=24, seed=7)   # shapes change
    runs = []
    for memory in (0, cap):
        model = attach(gpt2(n_layer=4, n_embd=128), client=tierd.connect(daemon),
                       compute_dtype="bf16", gpu_memory_bytes=memory)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        runs.append((_train_bf16(model, opt, data), model.state_dict(), session_of(model)))
    (streamed, sd0, s0), (placed, sd1, s1) = runs
    assert streamed == placed
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items())
    assert s0.placer.state is PlacerState.OFF and s1.placer.state is PlacerState.PLACED
    assert s1.stats()["resident_bytes"] > 0
    if cap is None:
        assert s1.stats()["planned_pcie_bytes"] == 0
    else:
        assert s1.placer.plan.device_bytes <= cap


def test_placement_with_a_pool_smaller_than_the_model(daemon_factory):
    """Everything resident on the GPU while the pool holds only part of the
    state: each fetched bucket's lease goes once copied, so the last buckets
    of the first placed backward still find room (the rest spills to NVMe)."""
    d = daemon_factory(pool="40MiB", nvme_size="512MiB", extra=("--segment-size", "4MiB"))
    make = lambda: gpt2(n_layer=4, n_embd=256, vocab=1000)   # ~3.4M params: 54 MB of state
    data = batches(5, batch=2, seq=16, vocab=1000)
    runs = []
    for memory in (0, 1 << 30):
        model = attach(make(), client=tierd.connect(d), gpu_memory_bytes=memory)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        runs.append(([_step(model, opt, ids.cuda(), autocast=False) for ids in data],
                     model.state_dict()))
        if memory:
            assert session_of(model).placer.plan.streamed_bytes == 0
        tierd.detach(model)
    (streamed, sd0), (placed, sd1) = runs
    assert streamed == placed
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items())


def test_commit_resume_and_state_dict_with_resident_units(daemon):
    data = batches(4, batch=2, seq=16)
    model = attach(gpt2(), client=tierd.connect(daemon, job="placed"), job="placed",
                   compute_dtype="bf16")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    _train_bf16(model, opt, data[:3])
    assert session_of(model).stats()["resident_bytes"] > 0
    tierd.commit(model, opt, 3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    session_of(model).client.close()   # the process ends without detaching
    again = attach(gpt2(seed=5), client=tierd.connect(daemon, job="placed"), job="placed",
                   compute_dtype="bf16", resume=True)
    got = again.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    opt2 = tierd.optim.AdamW(again.parameters(), lr=1e-3)
    _train_bf16(again, opt2, data[3:])   # trains on, resident again
