"""LoRA with peft on an attached model: adapters added before or after
``tierd.attach`` train as plain torch + peft bitwise, only the adapters get
state, and ``merge_and_unload`` works while attached (CPU, fp32, in-process
store). [Note: frozen parameters] in tierd.client.tiered_param and
[Note: parameters added after attach] in tierd.client.registry."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
import tierd.client.registry as registry_mod
import tierd.updates.fused as fused_mod
from tierd.client.attach import attach, detach, session_of
from tierd.client.store import LocalStore
from tierd.errors import StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama
from tests.faults import harness

peft = pytest.importorskip("peft")

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
BUILD = {"llama": llama, "gpt2": gpt2}


def _lora(kind: str):
    # dropout 0: the steps are deterministic without sharing an RNG stream
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind],
                           fan_in_fan_out=kind == "gpt2")


def _peft_model(kind: str, *, order: str, dtype: torch.dtype = torch.float32, **options):
    """torch + peft, and the same on tierd with the adapters added ``order``
    ("before" or "after") attach; same seed, so the same adapter values."""
    torch.manual_seed(3)
    ref = peft.get_peft_model(BUILD[kind]().to(dtype), _lora(kind))
    torch.manual_seed(3)
    if order == "before":
        model = attach(peft.get_peft_model(BUILD[kind]().to(dtype), _lora(kind)),
                       client=LocalStore(), device="cpu", **options)
        return model, ref, model
    base = attach(BUILD[kind]().to(dtype), client=LocalStore(), device="cpu", **options)
    return peft.get_peft_model(base, _lora(kind)), ref, base


def _train(model, opt, data, *, clip: float | None = None, accumulate: int = 1,
           device: str = "cpu"):
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for i, ids in enumerate(data):
        ids = ids.to(device)
        loss = model(input_ids=ids, labels=ids).loss / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(trainable, clip)
            opt.step()
            opt.zero_grad()
    return losses


def _adamw(model, torch_adamw: bool = False):
    trainable = [p for p in model.parameters() if p.requires_grad]
    if torch_adamw:
        return torch.optim.AdamW(trainable, lr=1e-2, foreach=False)
    return tierd.optim.AdamW(trainable, lr=1e-2)


def _stored_kinds(attached) -> dict[str, set[str]]:
    """Parameter name -> the kinds of key the daemon holds for it (p, master, grad, ...)."""
    session = session_of(attached)
    prefix = session.keys.prefix
    out: dict[str, set[str]] = {}
    for key in session.client.keys(session.keys.all):
        rest = key[len(prefix):].lstrip("/")
        kind, _, name = rest.partition("/")
        out.setdefault(name.split("/")[-1], set()).add(kind)
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_trains_as_torch_peft_bitwise_in_either_order(kind, order):
    model, ref, attached = _peft_model(kind, order=order)
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    data = batches(4)
    assert _train(model, opt, data) == _train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    # the adapters trained (lora_B starts at zero), the base did not
    lora_b = [n for n, p in ref.named_parameters() if "lora_B" in n]
    assert lora_b and all(ref.get_parameter(n).abs().sum() > 0 for n in lora_b)
    # only the adapters are trainable and have optimizer state
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in ref.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(opt.state_dict()["state"]) == len(trainable)
    # the frozen base stores its value only: no master, gradient or moments
    session = session_of(attached)
    frozen = [tp for tp in session.params.values() if not tp.param.requires_grad]
    assert frozen and all(not tp.outside.requires_grad and not tp.has_master for tp in frozen)
    kinds = _stored_kinds(attached)
    for tp in frozen:
        assert kinds[tp.name] == {"p"}, (tp.name, kinds[tp.name])


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_with_clipping_and_accumulation_matches_torch_peft(order):
    model, ref, _ = _peft_model("llama", order=order)
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    data = batches(6)
    got = _train(model, opt, data, clip=0.05, accumulate=2)
    assert got == _train(ref, ref_opt, data, clip=0.05, accumulate=2)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("order", ["before", "after"])
def test_merge_and_unload_while_attached_gives_torchs_values(order):
    model, ref, attached = _peft_model("llama", order=order)
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    data = batches(2)
    _train(model, opt, data)
    _train(ref, ref_opt, data)
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    # the base model with LoRA folded in, still attached (before: inside the
    # attached PeftModel; after: the attached model itself)
    assert merged is (attached.base_model.model if order == "before" else attached)
    assert_same_weights(merged, ref_merged)
    ids = batches(1, seed=7)[0]
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, ref_merged(input_ids=ids).logits)
    detach(attached)
    assert_same_weights(merged, ref_merged)


def test_a_second_adapter_disabling_generating_and_saving_work_as_in_peft(tmp_path):
    model, ref, _ = _peft_model("llama", order="after")
    for m in (model, ref):
        torch.manual_seed(4)   # the same draws for the new adapter's values
        m.add_adapter("b", _lora("llama"))
        m.set_adapter("b")
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(n for n, p in ref.named_parameters() if p.requires_grad)
    assert trainable and all(".b." in n for n in trainable)
    data = batches(2)
    assert _train(model, _adamw(model), data) == _train(ref, _adamw(ref, torch_adamw=True), data)
    ids = batches(1, seed=9)[0]
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    prompt = ids[:1, :4]
    assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False),
                       ref.generate(input_ids=prompt, max_new_tokens=5, do_sample=False))
    model.save_pretrained(tmp_path / "got", selected_adapters=["b"])
    ref.save_pretrained(tmp_path / "want", selected_adapters=["b"])
    from safetensors.torch import load_file
    got = load_file(tmp_path / "got" / "b" / "adapter_model.safetensors")
    want = load_file(tmp_path / "want" / "b" / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_generating_with_the_peft_model_places_it_as_the_plain_model():
    """peft's ``generate`` runs the wrapped model's forward, not the
    PeftModel's: tierd begins its steps there, so a capped model is placed
    (kept on the device) rather than streamed for every token."""
    from tierd.client.placer import PlacerState
    model, ref, _ = _peft_model("llama", order="before", gpu_memory_bytes=1 << 30)
    data = batches(2)
    assert _train(model, _adamw(model), data) == _train(ref, _adamw(ref, torch_adamw=True), data)
    placer = session_of(model).placer
    steps = session_of(model).counters.steps
    prompt = batches(1, seed=9)[0][:1, :4]
    with torch.no_grad():
        got = model.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
        assert torch.equal(got, ref.generate(input_ids=prompt, max_new_tokens=5, do_sample=False))
    assert session_of(model).counters.steps >= steps + 5   # each token's forward a step
    assert placer.state is PlacerState.PLACED and placer.resident_bytes() > 0


def test_adapters_below_fp32_compute_train_the_same_in_either_order():
    """A bf16 model: peft makes its adapters in bf16 and casts them to fp32
    with new Parameters (after attach: tierd keeps its own, bf16 compute and
    an fp32 master, and takes their values)."""
    runs = []
    for order in ("before", "after"):
        model, _, attached = _peft_model("llama", order=order, dtype=torch.bfloat16,
                                         compute_dtype="bf16")
        opt = _adamw(model)
        runs.append((_train(model, opt, batches(3)), model.state_dict(), attached))
    (losses_a, state_a, _), (losses_b, state_b, attached) = runs
    assert losses_a == losses_b
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name
    kinds = _stored_kinds(attached)
    lora = [n for n in kinds if "lora_" in n]
    assert lora and all("master" in kinds[n] for n in lora)
    assert all(kinds[n] == {"p"} for n in kinds if "lora_" not in n)


def test_freezing_and_unfreezing_after_attach_train_as_torch():
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    for m in (model, ref):
        m.model.embed_tokens.requires_grad_(False)
        m.model.layers[0].self_attn.q_proj.weight.requires_grad = False
    session = session_of(model)
    frozen = {tp.name for tp in session.params.values() if not tp.param.requires_grad}
    assert frozen == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    data = batches(3)
    assert _train(model, opt, data) == _train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    kinds = _stored_kinds(model)
    assert all(kinds[name] == {"p"} for name in frozen)   # no gradient was ever stored
    # unfrozen: trains again, with an optimizer built after (as torch's gets a gradient)
    for m in (model, ref):
        m.model.embed_tokens.weight.requires_grad_(True)
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    data = batches(3, seed=5)
    assert _train(model, opt, data) == _train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_attached_frozen_then_unfrozen_gets_a_master_and_trains():
    base = llama()
    base.model.embed_tokens.weight.requires_grad_(False)
    model = attach(base, client=LocalStore(), device="cpu", compute_dtype="bf16")
    tp = session_of(model).params["model.embed_tokens.weight"]
    assert not tp.has_master and "master" not in _stored_kinds(model)[tp.name]
    model.model.embed_tokens.weight.requires_grad_(True)
    assert tp.has_master and not tp.master_made
    before = model.model.embed_tokens.weight.detach().clone()
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, batches(2))
    assert tp.grad_hooked and tp.master_made
    assert not torch.equal(model.model.embed_tokens.weight.detach(), before)


def test_changes_that_would_lose_what_tierd_holds_raise_and_change_nothing():
    ref = gpt2(tie=False)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    with pytest.raises(StateError, match="before tierd.attach"):
        model.resize_token_embeddings(120)   # a new embedding under an attached name
    with pytest.raises(StateError, match="tie or move them before tierd.attach"):
        model.lm_head.weight = model.transformer.wte.weight
    with pytest.raises(StateError, match="before tierd.attach"):
        model.transformer.wte.weight = torch.nn.Parameter(torch.zeros(3, 3))
    assert_same_weights(model, ref)
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_adapters_added_after_a_resumed_attach_take_their_committed_values(tmp_path):
    """Commit at step 2 with adapters added after attach, kill the daemon,
    resume: the same order of calls brings the committed adapters back (fresh
    ones, from another seed, must lose), and steps 3-4 are the uninterrupted ones."""
    data = batches(4)
    d = harness.start(tmp_path)
    base = attach(llama(), client=d.connect(job="lora"), name="m")
    model = peft.get_peft_model(base, _lora("llama"))
    opt = _adamw(model)
    _train(model, opt, data[:2])
    tierd.commit(base, opt, 2)
    want = _train(model, opt, data[2:])
    want_weights = {k: v.clone() for k, v in model.state_dict().items()}
    d.kill()
    d = harness.start(tmp_path)   # same NVMe dir: recovers the commit
    try:
        base = attach(llama(seed=5), client=d.connect(job="lora"), name="m", resume=True)
        torch.manual_seed(11)
        model = peft.get_peft_model(base, _lora("llama"))
        opt = _adamw(model)
        assert _train(model, opt, data[2:]) == want
        got = model.state_dict()
        assert got.keys() == want_weights.keys()
        for name, value in want_weights.items():
            assert torch.equal(got[name], value), name
    finally:
        d.stop()


def _assert_trains_as_torch_peft_on_cuda(losses: list[float], state: dict) -> None:
    """``losses`` and the final ``state`` (on the CPU) of 3 steps of the Llama
    LoRA model match torch + peft's on CUDA."""
    torch.manual_seed(3)
    ref = peft.get_peft_model(llama(), _lora("llama")).cuda()
    want = _train(ref, _adamw(ref, torch_adamw=True), batches(3), device="cuda")
    assert losses == pytest.approx(want, rel=1e-4)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value.cpu(), atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap", [0, None], ids=["streamed", "placed"])
def test_lora_on_cuda_trains_alike_in_either_order_and_as_torch_peft(daemon, cap):
    runs = []
    for order in ("before", "after"):
        torch.manual_seed(3)
        if order == "before":
            model = attached = attach(peft.get_peft_model(llama(), _lora("llama")),
                                      client=tierd.connect(daemon), gpu_memory_bytes=cap)
        else:
            attached = attach(llama(), client=tierd.connect(daemon), gpu_memory_bytes=cap)
            model = peft.get_peft_model(attached, _lora("llama"))
        losses = _train(model, _adamw(model), batches(3), device="cuda")
        kinds = _stored_kinds(attached)
        assert all(kinds[n] == {"p"} for n in kinds if "lora_" not in n)
        runs.append((losses, {k: v.cpu() for k, v in model.state_dict().items()}))
        detach(attached)
    (losses, state), (other_losses, other_state) = runs
    assert losses == other_losses
    assert state.keys() == other_state.keys()
    for name, value in state.items():
        assert torch.equal(value, other_state[name]), name
    _assert_trains_as_torch_peft_on_cuda(losses, state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap", [0, None], ids=["streamed", "placed"])
def test_adapters_resident_by_size_keep_their_state_on_cuda(daemon, cap):
    """[Note: parameters resident for good keep their state on the device]
    (tierd.updates.fused): adapters under ``resident_below_bytes`` keep their
    masters and moments on the GPU, the store none of it, and train as torch
    + peft does."""
    torch.manual_seed(3)
    model = attach(peft.get_peft_model(llama(), _lora("llama")), client=tierd.connect(daemon),
                   gpu_memory_bytes=cap, resident_below_bytes=4096)
    losses = _train(model, _adamw(model), batches(3), device="cuda")
    kinds = _stored_kinds(model)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(kinds.get(n, set()) <= {"p"} for n in adapters), kinds
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    detach(model)
    _assert_trains_as_torch_peft_on_cuda(losses, state)


def test_a_parameter_unfrozen_after_a_resumed_attach_continues_from_its_committed_master(
        tmp_path):
    """bf16 compute: a parameter attached frozen and unfrozen after has an
    fp32 master once it trained; resumed the same way, it continues from the
    committed master, not from its bf16 compute copy."""
    data = batches(4)

    def attached(seed: int, **options):
        model = llama(seed=seed)
        model.model.embed_tokens.weight.requires_grad_(False)
        model = attach(model, client=d.connect(job="unfreeze"), name="m",
                       compute_dtype="bf16", **options)
        model.model.embed_tokens.weight.requires_grad_(True)
        return model, _adamw(model)

    d = harness.start(tmp_path)
    model, opt = attached(0)
    _train(model, opt, data[:2])
    tierd.commit(model, opt, 2)
    want = _train(model, opt, data[2:])
    want_weights = {k: v.clone() for k, v in model.state_dict().items()}
    d.kill()
    d = harness.start(tmp_path)   # same NVMe dir: recovers the commit
    try:
        model, opt = attached(5, resume=True)
        assert _train(model, opt, data[2:]) == want
        got = model.state_dict()
        for name, value in want_weights.items():
            assert torch.equal(got[name], value), name
    finally:
        d.stop()


# ------------------------------------------- [Note: adapters stay on the device]
@pytest.fixture
def adapters_kept(monkeypatch):
    """The rule and the small state it relies on, as on a GPU (both are off
    on the CPU, where the same code runs)."""
    monkeypatch.setattr(fused_mod, "keeps_small_state", lambda session: True)
    monkeypatch.setattr(registry_mod, "keeps_adapters",
                        lambda session, distributed: session.config.resident_adapters)


def _narrow_lora():
    # r=2 on the test Llama (64 wide, MLP 128): each adapter has at most
    # 1/64 of the elements of the block's largest frozen weight (64 x 128)
    return peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def test_the_rule_picks_trainable_parameters_small_beside_a_frozen_one():
    big = torch.nn.Parameter(torch.zeros(64, 128), requires_grad=False)
    small = torch.nn.Parameter(torch.zeros(2, 64))
    border = torch.nn.Parameter(torch.zeros(128, 2))   # 256 elements: 1/32 of it
    assert registry_mod.adapters([big, small, border]) == {id(small)}
    big.requires_grad_(True)   # nothing frozen: nothing is an adapter (a full fine-tune)
    assert registry_mod.adapters([big, small]) == set()
    # the units the rule looks in: the rest's parameters, then each block's
    model = llama()
    parts = registry_mod.unit_parameters(model)
    assert [root for root, _ in parts] == [model, *model.model.layers]
    assert {id(p) for p in parts[1][1]} == {id(p) for p in model.model.layers[0].parameters()}


@pytest.mark.parametrize("order", ["before", "after"])
def test_adapters_stay_on_the_device_with_their_state_and_train_as_torch_peft(
        adapters_kept, order):
    torch.manual_seed(3)
    ref = peft.get_peft_model(llama(), _narrow_lora())
    torch.manual_seed(3)
    if order == "before":
        model = attached = attach(peft.get_peft_model(llama(), _narrow_lora()),
                                  client=LocalStore(), device="cpu")
    else:   # peft freezes the base after adding them: judged when the optimizer is built
        attached = attach(llama(), client=LocalStore(), device="cpu")
        model = peft.get_peft_model(attached, _narrow_lora())
    session = session_of(attached)
    lora = [tp for tp in session.params.values() if "lora_" in tp.name]
    assert lora and all(tp.resident == (order == "before") for tp in lora)
    opt, ref_opt = _adamw(model), _adamw(ref, torch_adamw=True)
    assert all(tp.resident and tp.resident_for_good for tp in lora)
    assert not any(tp.resident for tp in session.params.values() if "lora_" not in tp.name)
    data = batches(4)
    assert _train(model, opt, data) == _train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    # the adapters' moments left the store (fp32: each is its own master)
    names = [opt.state_key(tp, n) for tp in lora for n in ("exp_avg", "exp_avg_sq")]
    assert not set(names) & set(session.client.keys(session.keys.all))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", ["before", "after"])
def test_on_cuda_adapters_stay_on_the_gpu_by_default(daemon, order):
    """[Note: adapters stay on the device]: no setting needed on a GPU, in
    either order; the base streams, the adapters and their state do not."""
    torch.manual_seed(3)
    if order == "before":
        model = attached = attach(peft.get_peft_model(llama(), _narrow_lora()),
                                  client=tierd.connect(daemon), gpu_memory_bytes=0)
    else:
        attached = attach(llama(), client=tierd.connect(daemon), gpu_memory_bytes=0)
        model = peft.get_peft_model(attached, _narrow_lora())
    opt = _adamw(model)
    session = session_of(attached)
    lora = [tp for tp in session.params.values() if "lora_" in tp.name]
    assert lora and all(tp.resident_for_good and tp.param.is_cuda for tp in lora)
    assert not any(tp.resident for tp in session.params.values() if "lora_" not in tp.name)
    torch.manual_seed(3)
    ref = peft.get_peft_model(llama(), _narrow_lora()).cuda()
    want = _train(ref, _adamw(ref, torch_adamw=True), batches(3), device="cuda")
    assert _train(model, opt, batches(3), device="cuda") == pytest.approx(want, rel=1e-4)
    names = [opt.state_key(tp, n) for tp in lora for n in ("exp_avg", "exp_avg_sq")]
    assert not set(names) & set(session.client.keys(session.keys.all))
    detach(attached)


def test_resident_adapters_false_streams_them(adapters_kept):
    model = attach(peft.get_peft_model(llama(), _narrow_lora()), client=LocalStore(),
                   device="cpu", resident_adapters=False)
    assert not any(tp.resident for tp in session_of(model).params.values())
    with pytest.raises(ValueError, match="resident_adapters='no' must be True or False"):
        attach(llama(), client=LocalStore(), device="cpu", resident_adapters="no")


def test_on_the_cpu_adapters_stream():
    model = attach(peft.get_peft_model(llama(), _narrow_lora()), client=LocalStore(),
                   device="cpu")
    assert not any(tp.resident for tp in session_of(model).params.values())
