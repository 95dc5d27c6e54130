"""[Note: deferred write-out] in tierd.updates.fused: the buckets a fused
update reaches last keep their new state on the device and copy it out as
the next forward begins. Training is bitwise the same as writing everything
out in backward, and whatever reads the store first forces the copy."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.updates.buckets import BucketState
from tests.client.models import assert_same_weights, batches, gpt2, llama, train
from tests.faults import harness

DEFER = 1 << 20   # every bucket of the tiny models but the first updated


def _deferred(opt) -> list:
    return [b for f in opt._fused for b in f.buckets if b.state is BucketState.DEFERRED]


def _pool(session, key: str) -> torch.Tensor:
    """The store's bytes of ``key`` as they are now (no settle: nothing forced)."""
    session.leases.acquire([key])
    try:
        return session.leases.views([key])[key].clone()
    finally:
        session.leases.release([key])


def _run(daemon, make, name, defer, *, dtype, accumulate, checkpointing, data):
    model = make()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model = attach(model, client=tierd.connect(daemon), name=name, compute_dtype=dtype,
                   deferred_write_bytes=defer)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = train(model, opt, data, accumulate=accumulate)
    return model, opt, losses


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*")
@pytest.mark.parametrize("make,dtype,accumulate,checkpointing", [
    (gpt2, "fp32", 1, False),
    (gpt2, "bf16", 1, False),
    (llama, "bf16", 2, False),
    (gpt2, "bf16", 1, True),
])
def test_deferring_trains_bitwise_like_writing_out_in_backward(daemon, make, dtype, accumulate,
                                                               checkpointing):
    data = batches(4 * accumulate)
    kw = dict(dtype=dtype, accumulate=accumulate, checkpointing=checkpointing, data=data)
    model, opt, losses = _run(daemon, make, "deferred", DEFER, **kw)
    assert _deferred(opt)   # the last update of the run kept its state on the device
    plain, plain_opt, plain_losses = _run(daemon, make, "plain", 0, **kw)
    assert not _deferred(plain_opt)
    assert losses == plain_losses
    assert_same_weights(model, plain)
    got, want = opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for name in want[i]:
            assert torch.equal(torch.as_tensor(got[i][name]), torch.as_tensor(want[i][name]))


def test_deferred_state_is_copied_out_as_the_next_forward_begins(daemon):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), deferred_write_bytes=DEFER)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    assert train(model, opt, data[:2]) == train(ref, ref_opt, data[:2])   # learns, then fuses
    session, fused = session_of(model), opt._fused[0]
    waiting = _deferred(opt)
    assert waiting
    tp = waiting[0].tps[0]
    key = fused.opt.master_key(tp)
    want = dict(ref.named_parameters())[tp.name].detach()
    before = _pool(session, key)
    assert not torch.equal(before, want)   # the store still has the step before's value

    seen = []

    def at_forward_start(module, args):
        seen.append(([b.state for b in waiting], _pool(session, key)))

    first_block = model.transformer.h[0]
    handle = first_block.register_forward_pre_hook(at_forward_start)
    train(model, opt, data[2:])   # its forward queues the copies before any unit runs
    handle.remove()
    states, pooled = seen[0]
    assert set(states) == {BucketState.HOST}
    assert torch.equal(pooled, want)


@pytest.mark.parametrize("reader", ["state_dict", "optimizer_state_dict", "detach"])
def test_reading_right_after_a_step_sees_the_deferred_state(daemon, reader):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), compute_dtype="bf16",
                   deferred_write_bytes=DEFER, name="deferred")
    plain = attach(copy.deepcopy(ref), client=tierd.connect(daemon), compute_dtype="bf16",
                   deferred_write_bytes=0, name="plain")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = tierd.optim.AdamW(plain.parameters(), lr=1e-3)
    data = batches(3)
    train(model, opt, data)
    train(plain, plain_opt, data)
    assert _deferred(opt)
    if reader == "state_dict":
        assert_same_weights(model, plain)
    elif reader == "optimizer_state_dict":
        got, want = opt.state_dict()["state"], plain_opt.state_dict()["state"]
        for i in want:
            for name in want[i]:
                assert torch.equal(torch.as_tensor(got[i][name]),
                                   torch.as_tensor(want[i][name])), (i, name)
    else:
        detach(model)
        detach(plain)
        assert_same_weights(model, plain)
    assert not _deferred(opt)


def test_a_commit_right_after_a_step_holds_the_deferred_state(tmp_path):
    data = batches(4)
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    want = train(ref, ref_opt, data)
    d = harness.start(tmp_path)
    try:
        model = attach(gpt2(), client=d.connect(job="run"), name="m",
                       deferred_write_bytes=DEFER)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        assert train(model, opt, data[:2]) == want[:2]
        assert _deferred(opt)
        tierd.commit(model, opt, 2)
        assert not _deferred(opt)
        session_of(model).client.close()   # the process ends without detaching
        again = attach(gpt2(seed=7), client=d.connect(job="run"), name="m", resume=True,
                       deferred_write_bytes=DEFER)
        opt = tierd.optim.AdamW(again.parameters(), lr=1e-3)
        assert train(again, opt, data[2:]) == want[2:]
        assert_same_weights(again, ref)
    finally:
        d.stop()


def test_deferral_is_off_by_default_and_sized_by_the_config(daemon):
    model = attach(gpt2(), client=tierd.connect(daemon), name="default")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    assert opt._fused[0].defer_bytes == 0
    model = attach(gpt2(), client=tierd.connect(daemon), name="sized",
                   deferred_write_bytes="3MiB")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    assert opt._fused[0].defer_bytes == 3 << 20
    model = attach(gpt2(), client=tierd.connect(daemon), name="window",
                   deferred_write_bytes=None)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    assert opt._fused[0].defer_bytes == 0   # the fetch window on CUDA; none on the CPU
    with pytest.raises(ValueError, match="deferred_write_bytes"):
        attach(gpt2(), client=tierd.connect(daemon), name="bad", deferred_write_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cap", [pytest.param(0, id="all-streamed"),
                                 pytest.param(10 << 20, id="some-resident")])
def test_on_cuda_deferring_the_fetch_window_trains_bitwise_like_writing_out_in_backward(
        daemon, dtype, cap, monkeypatch):
    # the copies out run on the copy-out stream as the next forward begins,
    # the next fetches of those keys wait for them; the plan from the cap alone
    # (as in test_cpu_update_gpu), so both runs place alike
    from tierd.client.placer import Placer
    monkeypatch.setattr(Placer, "_memory", lambda self: None)
    data = batches(6, batch=2, seq=16)
    runs = []
    for name, defer in (("window", None), ("plain", 0)):
        model = attach(gpt2(n_layer=4, n_embd=128), client=tierd.connect(daemon), name=name,
                       compute_dtype=dtype, gpu_memory_bytes=cap, deferred_write_bytes=defer)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for ids in data:
            loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        deferred = bool(_deferred(opt))
        runs.append((losses, model.state_dict(), opt.state_dict()["state"], deferred,
                     opt._fused[0]))
    (losses, sd, state, deferred, fused), (plain, sd1, state1, _, _) = runs
    assert fused.defer_bytes == 2 * fused.prefetch_bytes and deferred
    assert losses == plain
    assert all(torch.equal(sd[k], v) for k, v in sd1.items())
    for i in state1:
        for n in state1[i]:
            assert torch.equal(torch.as_tensor(state[i][n]), torch.as_tensor(state1[i][n]))
