"""CPU updates overlapped with backward (``optimizer_placement="cpu"``): on
this machine the device is the CPU, so the gradients' copy out is trivial, but
the host threads, their futures, the waits and the leases are real."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.store import LocalStore
from tierd.updates.buckets import BucketState
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


class GatedAdamW(tierd.optim.AdamW):
    """AdamW whose updates wait for ``gate`` (or fail with ``fail``), and say
    which thread ran them: lets a test look at the model while they run."""

    def __init__(self, *args, **kwargs) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.fail: str | None = None
        self.threads: set[str] = set()
        super().__init__(*args, **kwargs)

    def update_params(self, group, tps, params, grads, moments) -> None:
        self.threads.add(threading.current_thread().name)
        self.gate.wait()
        if self.fail is not None:
            raise RuntimeError(self.fail)
        super().update_params(group, tps, params, grads, moments)


def _host(opt):
    (fused,) = opt._fused
    return fused


def test_cpu_updates_match_torch_bitwise_with_accumulation_on_host_threads(daemon):
    ref = llama()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), optimizer_placement="cpu")
    opt = GatedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = batches(8)
    # the first window is learned (updated in step()); the next three in backward
    assert train(model, opt, data, accumulate=2) == train(ref, ref_opt, data, accumulate=2)
    fused = _host(opt)
    assert all(b.cpu for b in fused.buckets)
    assert fused.host.nbytes > 0   # updates ran as host jobs
    assert any(name.startswith("tierd-cpu-update") for name in opt.threads)
    session = session_of(model)
    assert not any(tp.grad_in_pool for tp in session.params.values())
    assert_same_weights(model, ref)
    assert all(b.state is BucketState.HOST for b in fused.buckets)
    assert opt.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"]


def test_bf16_cpu_updates_equal_the_fused_device_path():
    data = batches(5)
    outs = []
    for placement in ("gpu-stream", "cpu"):
        model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                       optimizer_placement=placement)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        outs.append((train(model, opt, data), model.state_dict()))
        assert any(b.cpu for b in _host(opt).buckets) == (placement == "cpu")
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(outs[0][1][k], v) for k, v in outs[1][1].items())


def _one_step_pending(model, opt, ids):
    """Backward with every CPU update held at the gate: returns the buckets
    still UPDATING when backward ended."""
    # the last window's updates pass the gate first: closed on one of them,
    # this forward would wait for it, and it for the gate (a test deadlock)
    _host(opt).host.wait_all()
    opt.gate.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    return [b for b in _host(opt).buckets if b.state is BucketState.UPDATING]


def test_reads_commits_and_detach_while_updates_run_see_the_final_values():
    ref = gpt2()
    store = LocalStore(job="run1")
    model = attach(copy.deepcopy(ref), client=store, job="run1", device="cpu",
                   optimizer_placement="cpu")
    opt = GatedAdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(4)
    train(model, opt, data[:2]), train(ref, ref_opt, data[:2])
    for i, read in enumerate(("state_dict", "commit", "detach")):
        ids = data[2 + i] if i < 2 else batches(1, seed=7)[0]
        assert _one_step_pending(model, opt, ids)
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step(); ref_opt.zero_grad()
        threading.Timer(0.2, opt.gate.set).start()   # the read must wait for it
        if read == "state_dict":   # the torch optimizer's too: step counts are final
            assert opt.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"]
            assert_same_weights(model, ref)
            opt.step(); opt.zero_grad()
        elif read == "commit":
            opt.step(); opt.zero_grad()
            tierd.commit(model, opt, 4)
            assert store.commits()
            tp = session_of(model).params["transformer.wte.weight"]
            assert torch.equal(session_of(model).read([tp.key])[tp.key],
                               ref.transformer.wte.weight)
        else:
            opt.step(); opt.zero_grad()
            plain = detach(model)
            assert_same_weights(plain, ref)


def test_a_scheduler_changing_lr_while_updates_run_changes_the_next_window_only():
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   optimizer_placement="cpu")
    opt = GatedAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for i, ids in enumerate(batches(4)):
        pending = _one_step_pending(model, opt, ids) if i else None
        if i == 0:   # the learning step updates in step()
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step(); opt.zero_grad()
        sched.step()   # lr halves while this window's updates wait at the gate
        assert i == 0 or pending
        opt.gate.set()
        ref(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step(); ref_opt.zero_grad(); ref_sched.step()
    assert_same_weights(model, ref)


def test_a_failed_cpu_update_surfaces_at_the_next_step_and_nothing_hangs():
    model = attach(gpt2(), client=LocalStore(), device="cpu", optimizer_placement="cpu")
    opt = GatedAdamW(model.parameters(), lr=1e-3)
    data = batches(4)
    train(model, opt, data[:2])
    opt.fail = "boom in the update"
    with pytest.raises(RuntimeError, match="boom in the update") as raised:
        train(model, opt, data[2:])
    assert any("CPU update of optimizer bucket" in n for n in raised.value.__notes__)
    fused = _host(opt)
    assert all(b.state is BucketState.HOST for b in fused.buckets)   # leases released
    session_of(model).settle()   # raised once, for every bucket that failed
    detach(model)


def test_an_optimizer_over_cpu_placement_without_zero_grad_is_told_the_fix():
    model = attach(gpt2(), client=LocalStore(), device="cpu", optimizer_placement="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(3)
    with pytest.raises(tierd.StateError, match="zero_grad"):
        for ids in data:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()


def test_cpu_updates_overlap_backward_except_under_ranks():
    """CUDA too (the GPU tests in test_cpu_update_gpu.py); not under ranks."""
    from types import SimpleNamespace

    from tierd.updates.cpu_update import overlapped
    assert overlapped(SimpleNamespace(share=None, device=torch.device("cpu")))
    assert overlapped(SimpleNamespace(share=None, device=torch.device("cuda", 0)))
    assert not overlapped(SimpleNamespace(share=object(), device=torch.device("cuda", 0)))


def test_the_plan_sees_the_host_rate_every_optimizer_measured_together():
    """Updates of several optimizers share the host: the rate the placer
    plans with is their bytes over their seconds, not the first one's (or
    its probe, when only another has updated on the host)."""
    from types import SimpleNamespace

    from tierd.client.placement import Costs
    from tierd.updates.cpu_update import host_choice

    def opt(choice, nbytes, seconds):
        return SimpleNamespace(host=SimpleNamespace(choice=lambda: choice, nbytes=nbytes,
                                                    seconds=seconds))
    probed = ("auto", Costs(copy_bytes_per_s=50.0, host_bytes_per_s=1000.0))
    mode, costs = host_choice([opt(("none", None), 0, 0.0), opt(probed, 0, 0.0),
                               opt(probed, 300, 2.0), opt(probed, 100, 2.0)])
    assert mode == "auto" and costs == Costs(50.0, 100.0)
    assert host_choice([opt(probed, 0, 0.0)]) == probed            # nothing measured yet
    assert host_choice([opt(("none", None), 5, 1.0)]) == ("none", None)
