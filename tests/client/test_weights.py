"""attach(model, weights=PATH): values streamed from safetensors checkpoints.

A streamed load equals ``from_pretrained`` bitwise (sharded Llama, GPT-2 with
tied embeddings), trains as torch does, keeps process memory bounded, and a
bad checkpoint fails with one clear error leaving the model and the store as
they were.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import GPT2LMHeadModel, LlamaForCausalLM

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.attached import is_attached
from tierd.client.store import LocalStore
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    llama().save_pretrained(path, max_shard_size="20KB")
    return path


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    gpt2().save_pretrained(path, max_shard_size="20KB")
    return path


def _on_meta(make):
    with torch.device("meta"):
        return make()


def _train_like_torch(model, ref, steps: int = 3) -> None:
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for ids in batches(steps):
        assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
    assert_same_weights(model, ref)


def test_sharded_llama_on_meta_equals_from_pretrained(llama_dir):
    assert len(list(llama_dir.glob("*.safetensors"))) > 3   # really sharded
    ref = LlamaForCausalLM.from_pretrained(llama_dir).train()
    model = _on_meta(llama).train()
    attach(model, client=LocalStore(), device="cpu", weights=llama_dir)
    assert_same_weights(model, ref)
    # the non-persistent rotary buffers were re-created, not left on meta
    want = dict(ref.named_buffers())
    for name, buf in model.named_buffers():
        assert torch.equal(buf, want[name]), name
    rotary = model.model.rotary_emb
    if hasattr(rotary, "original_inv_freq"):   # an alias of the buffer (transformers 4.x)
        assert torch.equal(rotary.original_inv_freq, rotary.inv_freq)
    _train_like_torch(model, ref)


def test_gpt2_tied_on_meta_real_daemon(gpt2_dir, daemon):
    ref = GPT2LMHeadModel.from_pretrained(gpt2_dir).train()
    model = _on_meta(gpt2).train()
    attach(model, client=tierd.connect(daemon), weights=gpt2_dir)
    assert model.lm_head.weight is model.transformer.wte.weight   # still tied
    assert_same_weights(model, ref)
    # non-persistent buffers (transformers 4.x: the bool causal mask "bias" and
    # "masked_bias") re-created as from_pretrained has them
    want = dict(ref.named_buffers())
    assert want.keys() == dict(model.named_buffers()).keys()
    for name, buf in model.named_buffers():
        assert torch.equal(buf, want[name]), name
    _train_like_torch(model, ref)
    detach(model)   # a meta model comes back as an ordinary CPU model
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert_same_weights(model, ref)


def test_cpu_model_takes_the_checkpoint_values(llama_dir):
    ref = LlamaForCausalLM.from_pretrained(llama_dir)
    model = llama(seed=5)   # other values, replaced by the file's
    attach(model, client=LocalStore(), device="cpu", weights=llama_dir)
    assert_same_weights(model, ref)


def test_tied_weight_under_its_other_name(tmp_path):
    ref = gpt2()
    values = {k: v for k, v in ref.state_dict().items() if k != "transformer.wte.weight"}
    assert "lm_head.weight" in values
    save_file(values, tmp_path / "m.safetensors")
    model = attach(_on_meta(gpt2), client=LocalStore(), device="cpu",
                   weights=tmp_path / "m.safetensors")
    assert_same_weights(model, ref)


def test_lower_compute_dtype_keeps_exact_fp32_masters(llama_dir):
    ref = LlamaForCausalLM.from_pretrained(llama_dir)
    model = attach(_on_meta(llama), client=LocalStore(), device="cpu", weights=llama_dir,
                   compute_dtype="bf16", name="bf")
    assert_same_weights(model, ref)   # state_dict reads the fp32 masters
    w = "model.layers.0.mlp.up_proj.weight"
    keys = f"tierd-attach/bf/p/{w}", f"tierd-attach/bf/master/{w}"
    got = session_of(model).read(list(keys))
    assert got[keys[0]].dtype == torch.bfloat16
    assert torch.equal(got[keys[1]], ref.state_dict()[w])


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_memory_growth_during_load_is_bounded(tmp_path, daemon_factory):
    # 48 modules of 1 MiB: a load that read every tensor before storing
    # grows the process's private memory (RssAnon) by the model's 48 MiB; a
    # streamed one by about a module. The pool is shared memory (RssShmem)
    # and the checkpoint's pages stay in the page cache (read with pread).
    layers, width = 48, 512
    make = lambda: nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    g = torch.Generator().manual_seed(0)
    values = {f"{i}.weight": torch.randn(width, width, generator=g) for i in range(layers)}
    save_file(values, tmp_path / "big.safetensors")
    model_bytes = sum(v.numel() * 4 for v in values.values())
    del values
    client = tierd.connect(daemon_factory(pool="128MiB"))
    peak = [0]
    put_many = client.put_many

    def measured(items, dtypes=None):   # memory at each module's upload, the values in hand
        peak[0] = max(peak[0], _rss_anon())
        put_many(items, dtypes)
    client.put_many = measured
    model = _on_meta(make)
    before = _rss_anon()
    attach(model, client=client, weights=tmp_path / "big.safetensors")
    peak[0] = max(peak[0], _rss_anon())
    assert peak[0] - before < model_bytes // 4, (peak[0] - before, model_bytes)
    with safe_open(str(tmp_path / "big.safetensors"), framework="pt") as f:
        assert torch.equal(model.state_dict()["47.weight"], f.get_tensor("47.weight"))


# ---------------------------------------------------------------- bad input
def _small() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))


def _save_sharded(path, values: dict[str, torch.Tensor]) -> None:
    """Two shards and the index, as save_pretrained writes them."""
    names = list(values)
    shards = {"model-00001-of-00002.safetensors": names[:2],
              "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        save_file({k: values[k] for k in keys}, path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


def _refused(model: nn.Module, weights, match: str, **options) -> None:
    """attach raises ValueError matching ``match``; the model and store are as they were."""
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    store = LocalStore()
    with pytest.raises(ValueError, match=match):
        attach(model, client=store, device="cpu", weights=weights, **options)
    assert not is_attached(model)
    assert store.keys() == []
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    for k, p in params.items():
        assert after[k] is p and (p.is_meta or torch.equal(p, before[k])), k


def test_missing_shard(tmp_path):
    _save_sharded(tmp_path, _small().state_dict())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    _refused(_small(), tmp_path,
             r"shard .*model-00002-of-00002.safetensors is missing.*'1\.weight'")


def test_shape_mismatch(tmp_path):
    values = _small().state_dict()
    values["2.weight"] = torch.zeros(5, 8)
    _save_sharded(tmp_path, values)
    _refused(_small(), tmp_path, r"'2\.weight' in .*model-00002-of-00002.*shape \(5, 8\)")


def test_non_float_where_float_expected(tmp_path):
    values = _small().state_dict()
    values["0.bias"] = torch.arange(8)
    save_file(values, tmp_path / "m.safetensors")
    _refused(_on_meta(_small), tmp_path / "m.safetensors",
             r"'0\.bias' in .*m\.safetensors has dtype I64.*float")


def test_truncated_file(tmp_path):
    save_file(_small().state_dict(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-20])
    _refused(_small(), tmp_path, r"model\.safetensors.*tensors past its end: 2\.weight ")


def test_missing_and_unexpected_keys_listed(tmp_path):
    values = _small().state_dict()
    values["extra.weight"] = values.pop("1.weight")
    save_file(values, tmp_path / "m.safetensors")
    _refused(_small(), tmp_path / "m.safetensors",
             r"m\.safetensors does not match Sequential: missing keys \(1\): 1\.weight; "
             r"unexpected keys \(1\): extra\.weight")
    # not strict: the model keeps its own value for what the file lacks
    model = attach(_small(), client=LocalStore(), device="cpu",
                   weights=tmp_path / "m.safetensors", strict=False)
    assert torch.equal(model.state_dict()["1.weight"], _small().state_dict()["1.weight"])


@pytest.mark.parametrize("meta", [True, False])
def test_a_cap_too_small_with_weights(tmp_path, meta):
    save_file({k: v + 1 for k, v in _small().state_dict().items()}, tmp_path / "m.safetensors")
    _refused(_on_meta(_small) if meta else _small(), tmp_path / "m.safetensors",
             "a cap must be at least", gpu_memory_bytes=100)


def test_meta_model_without_weights():
    model = _on_meta(_small)
    with pytest.raises(ValueError, match=r"meta device \(0\.weight, 0\.bias, 1\.weight, \.\.\.\)"
                                         r".*weights=PATH"):
        attach(model, client=LocalStore(), device="cpu")
    assert not is_attached(model) and model[0].weight.is_meta


@pytest.mark.parametrize("with_weights", [True, False])
def test_store_full_mid_load_undoes_everything(tmp_path, with_weights):
    # the pool holds the first module but not the rest: the puts so far are
    # deleted and the model keeps its own Parameters and values
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    save_file({k: v + 1 for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    before = {k: (p, p.detach().clone()) for k, p in model.named_parameters()}
    store = LocalStore(pool_bytes=24 << 10)
    with pytest.raises(tierd.CapacityError):
        attach(model, client=store, device="cpu",
               weights=tmp_path / "m.safetensors" if with_weights else None)
    assert not is_attached(model) and store.keys() == []
    for k, p in model.named_parameters():
        assert p is before[k][0] and torch.equal(p, before[k][1]), k


class _WithBuffers(nn.Module):
    """Persistent buffers (BatchNorm's running stats, an int64 count) and a
    non-persistent one, as rotary embeddings have."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)


def test_buffers_of_a_meta_model(tmp_path):
    torch.manual_seed(0)
    ref = _WithBuffers()
    ref.norm(torch.randn(8, 4))   # running stats that differ from a fresh module's
    save_file(ref.state_dict(), tmp_path / "m.safetensors")
    # a non-persistent buffer has no value anywhere but the model's own code
    meta = _on_meta(_WithBuffers)
    _refused(meta, tmp_path / "m.safetensors", r"non-persistent buffers scale .*init_empty_weights")
    assert all(b.is_meta for b in meta.buffers())   # the loaded ones were put back
    from accelerate import init_empty_weights
    with init_empty_weights():   # parameters on meta, buffers built on the CPU
        model = _WithBuffers()
    assert model.lin.weight.is_meta and not model.scale.is_meta
    attach(model, client=LocalStore(), device="cpu", weights=tmp_path / "m.safetensors")
    assert_same_weights(model, ref)   # running_mean/var and num_batches_tracked too
    assert torch.equal(model.scale, ref.scale)


def test_tensors_are_read_bitwise_wherever_the_file_puts_them_and_a_short_file_fails(tmp_path):
    from tierd.client import weights
    g = torch.Generator().manual_seed(1)
    values = {"big": torch.randn(1000, 300, generator=g), "odd": torch.randn(7, generator=g)}
    values["half"] = torch.randn(3, generator=g).to(torch.bfloat16)
    values["flag"] = torch.tensor([True, False, True])   # 3 B: the next one starts unaligned
    values["zz"] = torch.arange(5, dtype=torch.int64)
    save_file(values, tmp_path / "w.safetensors")
    reader = weights.CheckpointReader(tmp_path / "w.safetensors")
    try:
        for name, value in values.items():
            assert torch.equal(reader.tensor(name), value), name
        with open(tmp_path / "w.safetensors", "r+b") as f:   # cut short after planning
            f.truncate(reader._where["big"].end - 1000)
        with pytest.raises(ValueError, match="cannot read tensor 'big'.*bytes early"):
            reader.tensor("big")
    finally:
        reader.close()


def test_a_tensor_the_file_does_not_align_reads_right(tmp_path):
    # safetensors does not require aligned offsets: a float32 at byte 3
    import struct
    from tierd.client import weights
    header = json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "u.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                             + bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.0))
    reader = weights.CheckpointReader(tmp_path / "u.safetensors")
    assert reader.tensor("a").tolist() == [1, 2, 3]
    assert reader.tensor("b").tolist() == [1.5, -2.0]
