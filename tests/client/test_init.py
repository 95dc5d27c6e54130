"""attach(meta_model, init=True): the model's own initialization, unit by unit.

A meta model initialized by tierd has the values of the model's own init on
the same seed (Hugging Face models: that init with torch's constructor draws
off, [Note: init values and the plain model's]; torch models: the plain
model), trains as torch does, holds at most the rest and one block at once,
and a model tierd cannot initialize fails with one clear error leaving the
model and the store as they were.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.attached import is_attached
from tierd.client.store import LocalStore
from tests.client.models import assert_same_weights, batches, gpt2, llama, train

SEED = 3


def _on_meta(make):
    with torch.device("meta"):
        return make()


@contextlib.contextmanager
def _constructor_inits_off(monkeypatch):
    """Build a model without torch's constructor draws (``nn.Linear.__init__``'s
    ``kaiming_uniform_``...): Hugging Face's ``_init_weights`` alone draws
    (transformers keeps its own references to the torch functions)."""
    with monkeypatch.context() as m:
        for name in ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_",
                     "xavier_uniform_", "trunc_normal_", "constant_", "ones_", "zeros_"):
            m.setattr(torch.nn.init, name, lambda t, *a, **k: t)
        yield


def _initialized(make, **options):
    model = _on_meta(make)
    torch.manual_seed(SEED)
    return attach(model, client=options.pop("client", LocalStore()), device="cpu", init=True,
                  **options)


def _train_like_torch(model, ref, steps: int = 2) -> None:
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for ids in batches(steps):
        assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
    assert_same_weights(model, ref)


def test_llama_equals_its_own_init_and_trains(monkeypatch):
    with _constructor_inits_off(monkeypatch):
        ref = llama(seed=SEED)
    model = _initialized(llama, resident_below_bytes=1024)   # the norms: read back at attach
    assert any(tp.resident for tp in session_of(model).params.values())
    assert_same_weights(model, ref)
    want = dict(ref.named_buffers())   # rotary inv_freq, re-created
    for name, buf in model.named_buffers():
        assert torch.equal(buf, want[name]), name
    _train_like_torch(model, ref)


def test_buffers_built_on_the_cpu_are_kept(monkeypatch):
    # accelerate.init_empty_weights puts only parameters on meta
    from accelerate import init_empty_weights
    with _constructor_inits_off(monkeypatch):
        ref = llama(seed=SEED)
    with init_empty_weights():
        model = llama()
    inv_freq = model.model.rotary_emb.inv_freq
    assert model.lm_head.weight.is_meta and not inv_freq.is_meta
    torch.manual_seed(SEED)
    attach(model, client=LocalStore(), device="cpu", init=True)
    assert_same_weights(model, ref)
    assert model.model.rotary_emb.inv_freq is inv_freq


def test_gpt2_tied_equals_its_own_init(monkeypatch, daemon):
    with _constructor_inits_off(monkeypatch):
        ref = gpt2(seed=SEED)
    model = _initialized(gpt2, client=tierd.connect(daemon))
    assert model.lm_head.weight is model.transformer.wte.weight   # still tied
    # the scaled residual init (c_proj) is the block's own init's, inside the unit
    assert_same_weights(model, ref)
    _train_like_torch(model, ref)
    detach(model)   # a meta model comes back as an ordinary CPU model
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_same_weights(model, ref)


@pytest.mark.parametrize("make", [llama, gpt2])
def test_hugging_face_values_have_the_plain_models_distribution(make):
    # the plain model drew torch's constructor inits first, so other numbers
    # ([Note: init values and the plain model's]); constants are equal
    plain = make(seed=SEED)
    model = _initialized(make)
    got = dict(model.named_parameters())
    assert got.keys() == dict(plain.named_parameters()).keys()
    for name, want in plain.named_parameters():
        value = got[name].detach()
        assert value.shape == want.shape and value.dtype == want.dtype, name
        if want.std() == 0:
            assert torch.equal(value, want), name   # ones, zeros
        else:
            assert not torch.equal(value, want), name
            torch.testing.assert_close(value.std(), want.std(), rtol=0.1, atol=0, msg=name)
            assert value.mean().abs() < 4 * want.std() / want.numel() ** 0.5, name


def _lora(init_lora_weights=True):
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=init_lora_weights)


def test_peft_adapters_start_as_peft_makes_them():
    # get_peft_model on the meta model: the base by its model's init, the
    # adapters by peft's (A kaiming-uniform, B zero: the model starts as its base)
    from peft import get_peft_model
    model = _initialized(lambda: get_peft_model(llama(), _lora()))
    plain = get_peft_model(llama(seed=SEED), _lora())
    got = dict(model.named_parameters())
    adapters = 0
    for name, want in plain.named_parameters():
        assert got[name].requires_grad == want.requires_grad, name   # only adapters train
        value = got[name].detach()
        if ".lora_B." in name:
            assert torch.equal(value, torch.zeros_like(want)), name
        elif ".lora_A." in name:
            adapters += 1
            bound = want.shape[1] ** -0.5   # kaiming_uniform_(a=sqrt(5))
            assert value.abs().max() <= bound and value.abs().max() > 0.9 * bound, name
            torch.testing.assert_close(value.std(), want.detach().std(), rtol=0.1, atol=0)
    assert adapters == 4
    ids = batches(1)[0]
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
    assert torch.equal(adapted, base)


def test_peft_adapters_initialized_from_the_base_weights():
    from peft import get_peft_model
    _refused(_on_meta(lambda: get_peft_model(llama(), _lora(init_lora_weights=False))),
             r"adapter 'default' has init_lora_weights=False; init=True initializes LoRA "
             r"adapters as \(True, 'gaussian'\) do")


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class _TorchLM(nn.Module):
    """A language model of torch modules only, initialized by their
    ``reset_parameters`` (``_reset_parameters`` for attention), head tied."""

    def __init__(self, layers: int = 3, width: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(layers))
        self.norm = nn.BatchNorm1d(width)   # persistent buffers, re-made by its reset
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.transpose(1, 2)).transpose(1, 2))


def test_torch_model_equals_the_plain_model_on_the_same_seed():
    torch.manual_seed(SEED)
    ref = _TorchLM().eval()
    model = _initialized(_TorchLM).eval()
    assert model.head.weight is model.embed.weight
    assert_same_weights(model, ref)   # parameters and BatchNorm's running stats
    ids = torch.randint(0, 50, (2, 7))
    assert torch.equal(model(ids), ref(ids))


def test_bf16_compute_keeps_the_fp32_init_as_masters():
    model = _initialized(llama, compute_dtype="bf16", name="bf")
    w = "model.layers.1.mlp.up_proj.weight"
    got = session_of(model).read([f"tierd-attach/bf/p/{w}", f"tierd-attach/bf/master/{w}"])
    master = got[f"tierd-attach/bf/master/{w}"]
    assert master.dtype == torch.float32 and master.std() > 0
    assert torch.equal(got[f"tierd-attach/bf/p/{w}"], master.to(torch.bfloat16))
    assert torch.equal(model.state_dict()[w], master)   # state_dict reads the masters


def test_a_bf16_model_stores_no_masters_and_trains():
    # built in the compute dtype, as a model too large for fp32 is: each master
    # is made from its compute copy at the first update ([Note: masters made
    # when first needed] in tierd.client.registry)
    model = _initialized(lambda: llama().to(torch.bfloat16), compute_dtype="bf16", name="b")
    keys = session_of(model).client.keys("tierd-attach/b/")
    assert keys and not [k for k in keys if "/master/" in k]
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and 0.015 < w.detach().float().std() < 0.025
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batches(1)[0]
    losses = train(model, opt, [ids, ids])   # the same batch: the step lowers its loss
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


class _Stack(nn.Module):
    """An embedding and a head (the rest) around ``layers`` blocks of two linears."""

    def __init__(self, layers: int = 24, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False))
            for _ in range(layers))
        self.head = nn.Linear(width, 64, bias=False)


def _bytes(*modules: nn.Module) -> int:
    return sum(p.nbytes for m in modules for p in m.parameters())


def _live_bytes(model: nn.Module) -> int:
    """Bytes of materialized tensors the model's modules hold (tied once)."""
    seen = {id(p): p for m in model.modules() for p in m._parameters.values()
            if p is not None and not p.is_meta and p.device.type == "cpu"}
    return sum(p.nbytes for p in seen.values())


def test_at_most_the_rest_and_one_block_are_materialized():
    model = _on_meta(_Stack)
    block, rest, whole = _bytes(model.blocks[0]), _bytes(model.embed, model.head), _bytes(model)
    store = LocalStore()
    live, puts = [], []
    put_many = store.put_many

    def measured(items, dtypes=None):   # what the model holds at each unit's put
        live.append(_live_bytes(model))
        puts.append(sorted(items))
        put_many(items, dtypes)
    store.put_many = measured
    torch.manual_seed(SEED)
    attach(model, client=store, device="cpu", init=True)
    assert len(puts) == 24 + 1   # one put per block, then the rest
    assert max(live) <= rest + block < whole // 4, (max(live), rest, block, whole)
    assert live[0] == _bytes(model.embed) + block   # the head comes after the blocks
    torch.manual_seed(SEED)
    assert_same_weights(model, _Stack())


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_process_memory_does_not_grow_with_the_units_stored(daemon_factory):
    # 64 units of 1 MiB: holding what was initialized would grow the process's
    # private memory (RssAnon) by a MiB a unit, 32 MiB over the last 32 units;
    # init=True holds one (the pool is shared memory, RssShmem). The first
    # units are left out: the allocator grows its heap for them once (glibc
    # raising its mmap threshold), by a few MiB whatever the model's size.
    layers, width = 64, 512
    make = lambda: nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    unit_bytes = width * width * 4
    client = tierd.connect(daemon_factory(pool="128MiB"))
    at_puts = []
    put_many = client.put_many

    def measured(items, dtypes=None):   # memory at each unit's put, its values in hand
        at_puts.append(_rss_anon())
        put_many(items, dtypes)
    client.put_many = measured
    attach(_on_meta(make), client=client, init=True)
    assert len(at_puts) == layers
    grown = at_puts[-1] - at_puts[layers // 2]
    assert grown < (layers // 2) * unit_bytes // 4, [a >> 20 for a in at_puts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_memory_is_bounded_by_a_unit(daemon_factory):
    device = torch.device("cuda")
    model = _on_meta(lambda: _Stack(layers=16, width=2048))   # blocks of 32 MiB
    block, rest, whole = _bytes(model.blocks[0]), _bytes(model.embed, model.head), _bytes(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    torch.manual_seed(SEED)
    client = tierd.connect(daemon_factory(pool="1GiB", nvme_size="1GiB"))
    attach(model, client=client, device=device, init=True,
           gpu_memory_bytes=0)   # nothing stays on the device after attach
    grown = torch.cuda.max_memory_allocated(device) - base
    assert grown <= rest + block + (4 << 20) < whole, (grown, rest, block, whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_torch_model_equals_the_plain_model_built_there(daemon):
    # the device's generator, drawn in the same order as the constructors draw
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        ref = _TorchLM()
    torch.manual_seed(SEED)
    model = attach(_on_meta(_TorchLM), client=tierd.connect(daemon), device="cuda", init=True)
    got = model.state_dict()
    for name, want in ref.state_dict().items():
        assert torch.equal(got[name].cpu(), want.cpu()), name


# ------------------------------------------------------------------ refused


def _refused(model: nn.Module, match: str, **options) -> None:
    """attach(init=True) raises ValueError matching ``match``; the model holds
    its own Parameters and the store is empty."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    store = LocalStore()
    with pytest.raises(ValueError, match=match):
        attach(model, client=store, device="cpu", init=True, **options)
    assert not is_attached(model) and store.keys() == []
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is p for k, p in params.items())
    assert all(model.get_buffer(n) is b for n, b in buffers.items())


def test_init_with_weights_or_resume(tmp_path):
    with pytest.raises(TypeError, match="init='yes' must be True or False"):
        attach(_on_meta(_Stack), client=LocalStore(), device="cpu", init="yes")
    _refused(_on_meta(_Stack), "init=True .* or weights=PATH .*not both", weights=tmp_path)
    _refused(_on_meta(_Stack), "init=True .* or resume=True .*not both", resume=True,
             name="run")


def test_a_model_with_values():
    model = _Stack()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _refused(model, r"built on the meta device, and _Stack has parameters with values "
                    r"\(embed\.weight, blocks\.0\.0\.weight")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _Bare(nn.Module):
    """A parameter of its own and no reset_parameters: nothing initializes it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)


def test_a_model_without_an_init():
    _refused(_on_meta(lambda: nn.ModuleList([nn.Linear(4, 4), _Bare()])),
             r"no initialization for the parameters of 1 \(no Hugging Face _init_weights")


class _HalfReset(nn.Linear):
    """A reset that leaves the bias as ``__init__`` made it."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


class _DataReset(nn.Linear):
    """A reset writing through ``.data``, as transformers 4.x inits do."""

    def reset_parameters(self) -> None:
        self.weight.data.normal_()
        self.bias.data.zero_()


class _ResetsItsBlocks(nn.Module):
    """A root whose reset re-initializes its blocks (after they are stored)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.gain = nn.Parameter(torch.ones(1))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.gain)
        for block in self.blocks:
            nn.init.zeros_(block.weight)


def test_an_init_that_misses_a_parameter_or_writes_outside_its_unit():
    _refused(_on_meta(lambda: nn.Sequential(nn.Linear(4, 4), _HalfReset(4, 4))),
             r"leaves parameters 1\.bias \(all or part\) unset")
    torch.manual_seed(SEED)   # a write through .data sets it as well
    ref = nn.Sequential(_DataReset(4, 4), _DataReset(4, 4))
    assert_same_weights(_initialized(lambda: nn.Sequential(_DataReset(4, 4), _DataReset(4, 4))),
                        ref)
    _refused(_on_meta(_ResetsItsBlocks),
             r"wrote parameters blocks\.0\.weight, blocks\.1\.weight while their unit was not "
             "on the device.*unit_modules=")
    # one unit for the whole model: the root's init finds its blocks materialized
    model = _on_meta(_ResetsItsBlocks)
    attach(model, client=LocalStore(), device="cpu", init=True,
           unit_modules=lambda m: False)
    assert torch.equal(model.blocks[1].weight, torch.zeros(4, 4))


def test_a_store_failing_mid_init_undoes_everything():
    model = _on_meta(_Stack)
    params = dict(model.named_parameters())
    store = LocalStore()
    put_many, puts = store.put_many, []

    def full_at_the_third(items, dtypes=None):
        puts.append(items)
        if len(puts) == 3:
            raise tierd.CapacityError("the pool is full")
        put_many(items, dtypes)
    store.put_many = full_at_the_third
    with pytest.raises(tierd.CapacityError):
        attach(model, client=store, device="cpu", init=True)
    assert not is_attached(model) and store.keys() == []
    after = dict(model.named_parameters())
    assert all(after[k] is p and p.is_meta for k, p in params.items())
