"""attach() against torch itself, on a real daemon: same losses, same weights."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.activations import ActivationConfig
from tierd.client.attach import AttachConfig, attach, detach, session_of
from tierd.errors import StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


def _pair(make, daemon, **options):
    ref = make()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), **options)
    return model, ref


def _param_storage_bytes(model) -> int:
    """Bytes the compute tensors of the model's parameters hold (0 between uses)."""
    return sum(tp.storage_bytes for tp in session_of(model).params.values())


def test_gpt2_tied_embeddings_match_torch_adamw_bitwise(daemon):
    model, ref = _pair(gpt2, daemon)
    assert model.lm_head.weight is model.transformer.wte.weight   # still tied
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = batches(3)
    for ids in data:   # step by step: between steps nothing stays in the params
        assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
        assert _param_storage_bytes(model) == 0
    assert_same_weights(model, ref)
    session = session_of(model)
    model_bytes = sum(p.numel() * 4 for p in ref.parameters())
    stats = session.client.stats()
    assert stats["pool_used_bytes"] + stats["nvme_used_bytes"] >= model_bytes
    assert len(session.client.keys(session.prefix + "/p/")) == len(list(ref.parameters()))


def test_llama_grad_accumulation_and_clipping_bitwise(daemon):
    model, ref = _pair(llama, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(6)
    assert train(model, opt, data, accumulate=3) == \
        train(ref, ref_opt, data, accumulate=3, clip=0.05)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.05   # clipping was active
    assert_same_weights(model, ref)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_bitwise(daemon, reentrant):
    ref = gpt2()
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    assert _param_storage_bytes(model) == 0


def test_pool_smaller_than_model_spills_to_nvme_mid_training(daemon_factory):
    d = daemon_factory(pool="16MiB", nvme_size="512MiB", extra=("--segment-size", "4MiB"))
    make = lambda: gpt2(n_layer=4, n_embd=256, vocab=1000)   # ~3.4M params: 54 MB with states
    ref = make()
    client = tierd.connect(d)
    model = attach(copy.deepcopy(ref), client=client)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(2, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    stats = client.stats()
    assert stats["pool_bytes"] < sum(p.numel() * 4 for p in ref.parameters()) * 4
    assert stats["nvme_used_bytes"] > 0
    assert_same_weights(model, ref)


def test_detach_reads_the_store_back_in_parts_each_put_in_place(monkeypatch):
    # [Note: values read back in parts]: the host holds one part at a time
    from tierd.client import attached
    from tierd.client.store import LocalStore
    monkeypatch.setattr(attached, "READ_CHUNK_BYTES", 300_000)
    ref = gpt2(n_layer=2, n_embd=128, vocab=1000)   # ~0.5M parameters, 2 MB in fp32
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(2, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session, reads = session_of(model), []
    read = session.read
    monkeypatch.setattr(session, "read", lambda keys: reads.append(read(keys)) or reads[-1])
    detach(model)
    sizes = [sum(v.nbytes for v in got.values()) for got in reads]
    largest = max(p.numel() * 4 for p in ref.parameters())
    assert len(reads) > 3 and max(sizes) <= max(300_000, largest)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), name


def test_detach_of_placed_parameters_gives_back_their_values():
    # placed on the device, their masters are the optimizer's device tensors, taken as
    # they are (never a compute copy, whose storage detach frees)
    from tierd.client.store import LocalStore
    ref = gpt2(n_layer=2, n_embd=64, vocab=1000)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    detach(model)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and torch.equal(p, q), name


def test_detach_copies_a_master_that_is_the_compute_copy(monkeypatch):
    # on a GPU a resident fp32 parameter's master is its compute copy, whose storage
    # detach frees when placement streams it again: stand that in on the CPU
    from tierd.client.store import LocalStore
    ref = gpt2(n_layer=2, n_embd=64, vocab=1000)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3, vocab=1000)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    session = session_of(model)
    monkeypatch.setattr(session.updates, "device_masters",
                        lambda tps: {tp: tp.compute for tp in tps if tp.resident})
    detach(model)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and torch.equal(p, q), name


def test_two_attached_models_do_not_see_each_other(daemon):
    a, ref_a = _pair(lambda: gpt2(seed=1), daemon)
    b, ref_b = _pair(lambda: llama(seed=2), daemon)
    opt_a = tierd.optim.AdamW(a.parameters(), lr=1e-3)
    opt_b = tierd.optim.AdamW(b.parameters(), lr=1e-2)
    ref_opt_a = torch.optim.AdamW(ref_a.parameters(), lr=1e-3, foreach=False)
    ref_opt_b = torch.optim.AdamW(ref_b.parameters(), lr=1e-2, foreach=False)
    data = batches(2)
    for ids in data:   # interleaved
        assert train(a, opt_a, [ids]) == train(ref_a, ref_opt_a, [ids])
        assert train(b, opt_b, [ids]) == train(ref_b, ref_opt_b, [ids])
    assert_same_weights(a, ref_a)
    assert_same_weights(b, ref_b)
    assert session_of(a).prefix != session_of(b).prefix


def test_no_grad_inference_and_eval_train_switch(daemon):
    model, ref = _pair(gpt2, daemon)
    ids = batches(1)[0]
    model.eval(); ref.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert _param_storage_bytes(model) == 0
    assert session_of(model).client.stats()["tensors"] > 0
    model.train(); ref.train()
    opt = tierd.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_state_dict_and_detach_give_real_values(daemon):
    model, ref = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    train(model, opt, batches(1)); train(ref, ref_opt, batches(1))
    sd = model.state_dict()
    assert all(v.untyped_storage().nbytes() > 0 for v in sd.values())
    assert_same_weights(model, ref)
    client = session_of(model).client
    prefix = session_of(model).prefix
    detach(model)
    assert not any(isinstance(p, tierd.client.tiered_param.TieredParameter)
                   for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert client.keys(prefix + "/") == []
    ids = batches(1, seed=5)[0]
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    with pytest.raises(StateError):
        detach(model)


class _Shared(torch.nn.Module):
    """One Linear called twice per forward, and a weight shared by two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 8, bias=False)
        self.b = torch.nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        x = torch.tanh(self.inner(x))
        x = torch.tanh(self.inner(x)) * self.scale
        return self.b(torch.relu(self.a(x)))


def test_module_called_twice_shared_weight_and_buffers(daemon):
    torch.manual_seed(0)
    ref = _Shared()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), name="shared")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(4):
        x = torch.randn(5, 8)
        loss = model(x).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
        want = ref(x).square().mean(); want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == want.item()
    assert_same_weights(model, ref)


def test_learned_prefetch_follows_the_trace(daemon):
    model, ref = _pair(gpt2, daemon, prefetch_bytes=1 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    planner = session_of(model).mover.planner
    assert planner.steps_followed >= 2 and planner.divergences == 0


def test_bf16_compute_keeps_fp32_masters(daemon):
    model, ref = _pair(gpt2, daemon, compute_dtype="bf16")
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    got, want = train(model, opt, data), train(ref, ref_opt, data)
    assert got == pytest.approx(want, rel=2e-2)   # bf16 compute, fp32 masters
    sd = model.state_dict()
    assert sd["lm_head.weight"].dtype == torch.float32
    assert_same_weights(model, ref, atol=2e-2)


def test_resident_small_params_stay_on_device(daemon):
    model, ref = _pair(gpt2, daemon, resident_below_bytes=1024)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(2)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    ln = model.transformer.ln_f.weight
    assert ln.untyped_storage().nbytes() == ln.numel() * 4
    assert torch.equal(ln.detach(), ref.transformer.ln_f.weight.detach())
    assert model.transformer.wte.weight.tiered.storage_bytes == 0   # its compute tensor


def test_config_is_validated():
    with pytest.raises(ValueError, match="compute_dtype"):
        AttachConfig(compute_dtype="int8")
    with pytest.raises(ValueError, match="optimizer_placement"):
        AttachConfig(optimizer_placement="disk")
    with pytest.raises(ValueError, match="gpu_budget_bytes"):
        AttachConfig(gpu_budget_bytes=-1)
    assert AttachConfig(compute_dtype="fp16").compute_dtype is torch.float16


def test_optimizer_rejects_unattached_params():
    with pytest.raises(TypeError, match="tierd.attach"):
        tierd.optim.AdamW(torch.nn.Linear(2, 2).parameters())


class _Dynamic(torch.nn.Module):
    """Control flow that depends on the step: the learned order breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x, step: int):
        order = range(4) if step % 3 else (3, 1, 1, 0)
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x


def test_dynamic_control_flow_falls_back_and_relearns(daemon):
    torch.manual_seed(0)
    ref = _Dynamic()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), prefetch_bytes=1 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(7):
        x = torch.randn(3, 8)
        loss = model(x, step).sum(); loss.backward(); opt.step(); opt.zero_grad()
        want = ref(x, step).sum(); want.backward(); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == want.item()
    assert session_of(model).mover.planner.divergences >= 2
    assert_same_weights(model, ref)


def test_parameters_leave_between_forward_and_backward(daemon):
    model, ref = _pair(lambda: gpt2(n_layer=4), daemon, gpu_budget_bytes=0)
    total = sum(p.numel() * 4 for p in ref.parameters())
    seen: list[int] = []
    for block in model.transformer.h:
        block.register_full_backward_hook(
            lambda *args: seen.append(_param_storage_bytes(model)))
    ids = batches(1)[0]
    loss = model(input_ids=ids, labels=ids).loss
    assert _param_storage_bytes(model) == 0          # forward freed every unit
    loss.backward()
    assert len(seen) == 4 and max(seen) < total / 2  # never the whole model at once
    assert _param_storage_bytes(model) == 0
    assert set(session_of(model).gradients()) == {n for n, _ in ref.named_parameters()}


def test_activation_offload_keeps_losses_bitwise(daemon):
    plain, _ = _pair(gpt2, daemon)
    tiered, _ = _pair(gpt2, daemon, activations=ActivationConfig(policy="offload", min_bytes=0))
    assert session_of(tiered).activations is not None
    opt = tierd.optim.AdamW(plain.parameters(), lr=1e-3)
    tiered_opt = tierd.optim.AdamW(tiered.parameters(), lr=1e-3)
    data = batches(3)
    assert train(tiered, tiered_opt, data) == train(plain, opt, data)
    assert_same_weights(tiered, plain)
    handle = session_of(tiered).activations
    assert handle.stats()["d2h_bytes"] > 0   # saved tensors really went to the pool
    detach(tiered)
    assert handle._closed
    with pytest.raises(ValueError, match="activations"):
        AttachConfig(activations="disk")
    with pytest.raises(ValueError, match="budget_bytes"):
        AttachConfig(activations=ActivationConfig(policy="auto", budget_bytes=-1))
    with pytest.raises(ValueError, match="ActivationConfig"):
        AttachConfig(activations=3)
    assert AttachConfig(activations="auto").activations == ActivationConfig(policy="auto")


def test_a_dead_daemon_is_seen_at_the_next_step(daemon):
    import signal
    import time

    model, _ = _pair(gpt2, daemon)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(2)
    train(model, opt, data[:1])           # leases are held from here on: no requests
    daemon.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(tierd.DaemonUnavailable):
        train(model, opt, data[1:])
    assert time.monotonic() - start < 2


def test_attach_frees_each_cpu_parameter_once_its_module_is_stored(monkeypatch):
    """A CPU model's parameters are emptied module by module as attach stores
    them, so the process never holds the model twice; detach gives back the
    same Parameter objects with their values."""
    from tierd.client.store import LocalStore
    model = llama()
    params = list(model.parameters())
    want = [p.detach().clone() for p in params]
    store, held = LocalStore(), []
    put_many = store.put_many

    def spy(values, **kw):
        held.append(sum(p.untyped_storage().nbytes() for p in params))
        return put_many(values, **kw)

    monkeypatch.setattr(store, "put_many", spy)
    attach(model, client=store, device="cpu")
    assert len(held) > 3 and all(a > b for a, b in zip(held, held[1:])), held
    assert sum(p.untyped_storage().nbytes() for p in params) == 0
    detach(model)
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(torch.equal(p, w) for p, w in zip(params, want))


def test_a_tierd_optimizer_refuses_what_would_train_wrong():
    """Hyper-parameters load as in torch (per-parameter state: tests/optim/
    test_state_dict.py); after detach its step() and state_dict() raise
    instead of doing nothing."""
    from tierd.client.store import LocalStore
    model = attach(llama(), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(1))
    saved = opt.state_dict()
    groups = [dict(g, lr=5e-4) for g in saved["param_groups"]]
    opt.load_state_dict({"state": saved["state"], "param_groups": groups})
    assert opt.param_groups[0]["lr"] == 5e-4
    detach(model)
    with pytest.raises(StateError, match="was detached"):
        opt.state_dict()
    with pytest.raises(StateError, match="was detached"):
        opt.step()


def test_attach_options_take_sizes_and_refuse_wrong_types():
    config = AttachConfig(gpu_memory_bytes="1GiB", prefetch_bytes="512MiB",
                          gpu_budget_bytes="2GB", grad_bucket_bytes=1 << 20)
    assert (config.gpu_memory_bytes, config.prefetch_bytes, config.gpu_budget_bytes,
            config.grad_bucket_bytes) == (1 << 30, 512 << 20, 2 * 10**9, 1 << 20)
    for options, match in [({"gpu_memory_bytes": "lots"}, "cannot read size 'lots'"),
                           ({"prefetch_bytes": 1.5}, "must be a byte count"),
                           ({"grad_bucket_bytes": -1}, "must be >= 0"),
                           ({"hold_fraction": "0.5"}, "must be a number"),
                           ({"name": 5}, "non-empty string"), ({"name": ""}, "non-empty string")]:
        with pytest.raises(ValueError, match=match):
            AttachConfig(**options)
    from tierd.client.store import LocalStore
    model, store = llama(), LocalStore()
    with pytest.raises(ValueError, match="job=5 must be a non-empty string"):
        attach(model, client=store, job=5)
    assert store.keys() == [] and not tierd.client.attach.is_attached(model)


def test_a_model_dropped_without_detach_is_collected_and_its_client_closed(daemon):
    """torch holds tensor hooks from C++, out of the collector's sight: hooks
    that held the session kept a dropped model (and its connection) alive."""
    import gc
    import weakref

    def dropped():
        model = attach(llama(), client=daemon.connect(), device="cpu")
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        train(model, opt, batches(2))
        return weakref.ref(session_of(model)), session_of(model).client.job

    session, job = dropped()
    gc.collect()
    assert session() is None
    with daemon.connect() as client:   # the dropped client's default job went with it
        assert job not in client.stats()["jobs"]
