"""An attached model's parameters between uses ([Note: the two tensors of a
parameter]): every read gives the detached model's values, writes land in
tierd, conversions raise before anything changes, and no case crashes the
process. Tiny Hugging Face models, fp32, on the in-process store."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.store import LocalStore
from tierd.client.tiered_param import DeviceParameter, TieredParameter
from tierd.errors import StateError
from tests.client.models import batches, gpt2, llama, train

#: reads a user makes of a parameter between steps: (got, want) from p, its
#: name n, the model m and the state dict sd taken before
READS = {
    "sum": "p.sum(), sd[n].sum()",
    "mean": "p.mean(), sd[n].mean()",
    "norm": "p.norm(), sd[n].norm()",
    "detach_clone": "p.detach().clone(), sd[n]",
    "data_sum": "p.data.sum(), sd[n].sum()",
    "isfinite": "torch.isfinite(p), torch.isfinite(sd[n])",
    "numpy": "torch.from_numpy(p.detach().cpu().numpy()), sd[n]",
    "tolist": "torch.tensor(p.tolist()), sd[n]",
    "parameters_to_vector": ("torch.nn.utils.parameters_to_vector(m.parameters()), "
                             "torch.cat([sd[k].reshape(-1) for k, _ in m.named_parameters()])"),
    "foreach_norm": ("torch.stack(torch._foreach_norm(list(m.parameters()))), "
                     "torch.stack(torch._foreach_norm([sd[k] for k, _ in m.named_parameters()]))"),
    "print": "torch.tensor(len(repr(p)) > 0 and n in repr(p)), torch.tensor(True)",
    "to_double": "p.double(), sd[n].double()",
}

_CASE = textwrap.dedent("""
    import sys, torch, tierd, tierd.optim
    from tierd.client.attach import attach
    from tierd.client.store import LocalStore
    from tests.client.models import batches, gpt2, llama, train
    for make in (llama, gpt2):
        m = attach(make(), client=LocalStore(), device="cpu")
        train(m, tierd.optim.AdamW(m.parameters(), lr=1e-3), batches(2))
        sd = {{k: v.clone() for k, v in m.state_dict().items()}}
        n, p = next(iter(m.named_parameters()))
        got, want = {read}
        assert torch.equal(got, want), (make.__name__, got, want)
    print("same values")
""")


@pytest.mark.parametrize("case", sorted(READS))
def test_a_read_between_steps_gives_the_detached_values(case):
    """Each read in its own process: a crash (a signal) fails it as clearly as
    a wrong value."""
    done = subprocess.run([sys.executable, "-c", _CASE.format(read=READS[case])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same values" in done.stdout, (
        f"exit {done.returncode}\n{done.stderr[-3000:]}")


def _attached(make=llama, **options):
    model = attach(make(), client=LocalStore(), device="cpu", **options)
    return model, tierd.optim.AdamW(model.parameters(), lr=1e-3)


def test_between_steps_the_model_holds_tiered_parameters_and_inside_a_block_plain_ones():
    model, opt = _attached()
    assert all(isinstance(p, TieredParameter) and isinstance(p, nn.Parameter)
               for p in model.parameters())
    seen = []
    block = model.model.layers[0]
    handle = block.mlp.register_forward_pre_hook(
        lambda mod, args: seen.append(type(mod.up_proj.weight)))
    train(model, opt, batches(1))
    handle.remove()
    assert seen == [DeviceParameter]   # a plain tensor on the device inside the unit
    assert all(isinstance(p, TieredParameter) for p in model.parameters())
    assert session_of(model).units[0].name == "<root>"
    assert [u.name for u in session_of(model).units[1:]] == ["model.layers.0", "model.layers.1"]


def test_an_ema_over_the_parameters_equals_torchs_bitwise():
    model, opt = _attached()
    ref = llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    ema = [p.detach().clone() for p in model.parameters()]
    ref_ema = [p.detach().clone() for p in ref.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ema, ref_ema))
    for ids in batches(3):
        assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 0.1)     # one batched read
            for e, p in zip(ref_ema, ref.parameters()):
                e.lerp_(p, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(ema, ref_ema))
    with torch.no_grad():   # the per-parameter form reads the same values
        for e, p in zip(ema, model.parameters()):
            e.lerp_(p, 0.5)
        for e, p in zip(ref_ema, ref.parameters()):
            e.lerp_(p, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(ema, ref_ema))


def test_writes_between_steps_change_the_parameter_as_in_torch():
    model, opt = _attached(resident_below_bytes=1024)   # norms resident on the device
    ref = llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    assert train(model, opt, batches(1)) == train(ref, ref_opt, batches(1))
    other = llama(seed=4).state_dict()
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            p.data.copy_(other[name])     # .data of a TieredParameter is a view of it
            q.data.copy_(other[name])
        model.model.norm.weight.mul_(0.5)   # resident: its device copy changes too
        ref.model.norm.weight.mul_(0.5)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
    data = batches(2, seed=9)
    assert train(model, opt, data) == train(ref, ref_opt, data)   # the moments stay
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())


def test_load_state_dict_writes_every_copy_exactly_even_below_fp32():
    """An fp32 state dict into a bf16-compute model: the fp32 masters take the
    values exactly, the compute copies their bf16 rounding."""
    model, opt = _attached(compute_dtype="bf16", resident_below_bytes=1024)
    train(model, opt, batches(1))
    want = llama(seed=5).state_dict()
    model.load_state_dict(want)
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(model.model.norm.weight.detach(),          # resident compute copy
                       want["model.norm.weight"].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="size mismatch"):   # torch's own check, nothing written
        model.load_state_dict({**want, "lm_head.weight": torch.zeros(3, 3)})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    model.load_state_dict(llama(seed=6).state_dict(), assign=True)   # assign: values taken
    assert all(isinstance(p, (TieredParameter, DeviceParameter)) for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in llama(seed=6).state_dict().items())


@pytest.mark.parametrize("convert", ["half", "double", "to_meta", "float_of_bf16"])
def test_converting_an_attached_model_raises_before_anything_changes(convert):
    model, _ = _attached(compute_dtype="bf16" if convert == "float_of_bf16" else "fp32")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: (b.dtype, b.device) for k, b in model.named_buffers()}
    call = {"half": model.half, "double": model.double, "to_meta": lambda: model.to("meta"),
            "float_of_bf16": model.float}[convert]
    with pytest.raises(StateError, match="converting an attached model"):
        call()
    assert {k: (b.dtype, b.device) for k, b in model.named_buffers()} == buffers
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    model.to("cpu")   # changes nothing: allowed (a Trainer moves the model so)
    detach(model)
    getattr(model, "half" if convert == "half" else "double")()   # an ordinary model again


def test_what_cannot_be_applied_raises_naming_the_fix():
    model, opt = _attached()
    with pytest.raises(StateError, match="assigning .data of 'model.norm.weight'"):
        model.model.norm.weight.data = torch.zeros(model.config.hidden_size)
    with pytest.raises(StateError, match="use tierd.optim.AdamW"):
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    before = llama()
    stale = torch.optim.SGD(before.parameters(), lr=0.1)   # built before attach
    attach(before, client=LocalStore(), device="cpu")
    with pytest.raises(StateError, match="built before tierd.attach"):
        stale.step()
    torch.optim.SGD(llama().parameters(), lr=0.1).step()   # other models are left alone


def test_a_unit_kept_whole_on_the_device_runs_without_hooks():
    model, opt = _attached(resident_below_bytes=1 << 30)   # every parameter resident
    hooks = session_of(model).hooks
    assert hooks._unit_handles == {}
    assert all(isinstance(p, DeviceParameter) for p in model.parameters())
    ref = llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    assert train(model, opt, batches(2)) == train(ref, ref_opt, batches(2))
    streamed, _ = _attached()
    assert sorted(session_of(streamed).hooks._unit_handles) == [0, 1, 2]


def test_unit_modules_picks_the_units():
    from transformers.models.llama.modeling_llama import LlamaMLP
    model, opt = _attached(unit_modules=LlamaMLP)
    names = [u.name for u in session_of(model).units]
    assert names == ["<root>", "model.layers.0.mlp", "model.layers.1.mlp"]
    ref = llama()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    assert train(model, opt, batches(2)) == train(ref, ref_opt, batches(2))
    with pytest.raises(ValueError, match="unit_modules"):
        attach(llama(), client=LocalStore(), device="cpu", unit_modules="mlp")


def test_a_model_returning_a_namespace_brings_its_rest_back_for_backward():
    """The rest of the model (embedding, head) is one unit whose only output
    is the root's: its pre-backward must find the tensors in an object
    torch's pytree does not open (a SimpleNamespace)."""
    from types import SimpleNamespace

    class Namespaced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(20, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, 20)

        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = torch.tanh(block(x))
            logits = self.head(x)
            return SimpleNamespace(loss=logits.logsumexp(-1).mean(), logits=logits)

    ref = Namespaced()
    model = attach(Namespaced(), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for m, o in ((model, opt), (ref, ref_opt)):
            m(ids).loss.backward()
            o.step()
            o.zero_grad()
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_a_checkpointed_block_recomputes_on_its_compute_tensors(monkeypatch, reentrant):
    """[Note: a unit's modules in its backward]: whether transformers
    checkpoints a layer's ``__call__`` (hooks inside) or its ``forward``
    (5.2x: hooks outside), its recompute in backward reads no parameter from
    the tiers; training is bitwise torch's, and between steps the modules
    hold the tensors for between uses again."""
    import tierd.client.values as values

    reads = []
    real = values.run_op
    monkeypatch.setattr(values, "run_op", lambda func, args, kwargs: (
        reads.append(func), real(func, args, kwargs))[1])
    kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    ref = llama().train()
    ref.gradient_checkpointing_enable(**kwargs)
    model = llama().train()
    model.gradient_checkpointing_enable(**kwargs)
    model = attach(model, client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert reads == []
    assert all(isinstance(p, TieredParameter) for p in model.parameters())
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())


_BACKWARD_HOOK = textwrap.dedent("""
    import torch, tierd.optim
    from tierd.client.attach import attach
    from tierd.client.store import LocalStore
    from tests.client.models import batches, llama, train
    ref = llama().train()
    model = llama().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = attach(model, client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    seen = []
    model.model.layers[1].register_full_backward_hook(
        lambda mod, gin, gout: seen.append(mod.mlp.up_proj.weight.detach().clone()))
    for ids in batches(2):
        before = ref.model.layers[1].mlp.up_proj.weight.detach().clone()
        train(ref, ref_opt, [ids])
        after = ref.model.layers[1].mlp.up_proj.weight.detach()
        train(model, opt, [ids])
        assert torch.equal(seen[-1], before) or torch.equal(seen[-1], after)
    print("same values")
""")


def test_a_backward_hook_reads_a_parameter_its_backward_freed():
    """[Note: a unit's modules in its backward]: a block's backward hook
    reading its weights after autograd accumulated (and tierd freed) them
    reads a value (the step's, or the updated one: the fused update runs in
    backward), never freed memory. In its own process: a crash fails it."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _BACKWARD_HOOK],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same values" in done.stdout, (
        f"exit {done.returncode}\n{done.stderr[-3000:]}")
