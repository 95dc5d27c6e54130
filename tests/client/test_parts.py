"""Unit tests of the client's parts on the in-process store (no daemon):
a failure here names the part that broke (TieredParam, the mover, the
backward tracker, the fused optimizer), not "attach"."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.copy_stream import CopyStream
from tierd.client.keys import ModelKeys
from tierd.client.store import LocalStore
from tierd.client.tiered_param import ParamState, DeviceParameter, TieredParam
from tierd.errors import CapacityError, StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama, train

CPU = torch.device("cpu")


def _mlp(seed: int = 0, width: int = 16, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _storage_bytes(model: nn.Module) -> int:
    return sum(tp.storage_bytes for tp in session_of(model).params.values())


# ------------------------------------------------------------------ TieredParam
def test_tiered_param_moves_host_device_host_and_refuses_illegal_moves():
    param = DeviceParameter(torch.empty(3), requires_grad=True)
    tp = TieredParam(name="w", keys=ModelKeys("m"), param=param, orig_dtype=torch.float32,
                     orig_device=CPU, resident=False, session=None)
    param.untyped_storage().resize_(0)
    assert tp.state is ParamState.HOST and tp.key == "m/p/w" and tp.master_key == "m/p/w"
    with pytest.raises(StateError, match=r"cannot free parameter 'w': it is HOST"):
        tp.free()
    stream = CopyStream(CPU)
    tp.start_swap_in(torch.tensor([1.0, 2.0, 3.0]), ("m/p/w",), stream)
    assert tp.state is ParamState.H2D_INFLIGHT
    with pytest.raises(StateError, match="H2D_INFLIGHT"):
        tp.free()
    tp.finish_swap_in(stream)
    assert tp.state is ParamState.DEVICE and param.tolist() == [1.0, 2.0, 3.0]
    tp.free()
    assert tp.state is ParamState.HOST and tp.storage_bytes == 0


def test_bf16_param_has_a_separate_fp32_master_key():
    param = DeviceParameter(torch.empty(2, dtype=torch.bfloat16), requires_grad=True)
    tp = TieredParam(name="w", keys=ModelKeys("m"), param=param, orig_dtype=torch.float32,
                     orig_device=CPU, resident=False, session=None)
    assert tp.has_master and tp.master_key == "m/master/w" and tp.nbytes == 4


# ------------------------------------------------------------------ the mover
def test_mover_brings_a_unit_in_for_its_forward_and_frees_it_after():
    want = dict(_mlp().named_parameters())
    model = attach(_mlp(), client=LocalStore(), device="cpu")
    session = session_of(model)
    unit = session.units[1]
    assert all(tp.state is ParamState.HOST for tp in unit.params)
    session.mover.hold(unit)
    assert all(tp.state is ParamState.DEVICE for tp in unit.params)
    assert all(torch.equal(tp.param, want[tp.name]) for tp in unit.params)
    session.mover.release_after_forward(unit, task=-1)
    assert all(tp.state is ParamState.HOST for tp in unit.params)
    assert _storage_bytes(model) == 0
    detach(model)


def test_mover_prefetches_the_learned_order_within_the_budget():
    one_unit = 16 * 16 * 4 + 16 * 4
    model = attach(_mlp(), client=LocalStore(), device="cpu", gpu_budget_bytes=2 * one_unit,
                   prefetch_bytes=2 * one_unit)
    session, x = session_of(model), torch.randn(2, 16)
    seen = []
    with torch.no_grad():
        model(x)   # learns the order
        for m in model:
            m.register_forward_pre_hook(lambda m, a: seen.append(session.mover._device_bytes))
        model(x)   # follows it
        model(x)
    planner = session.mover.planner
    assert planner.trace == (0, 1, 2, 3)
    assert planner.steps_followed == 1 and planner.divergences == 0
    assert max(seen) == 2 * one_unit   # prefetched ahead, never above the budget
    assert _storage_bytes(model) == 0


def test_backward_frees_each_parameter_once_its_gradient_is_taken():
    store = LocalStore()
    model = attach(_mlp(depth=3), client=store, device="cpu")
    session = session_of(model)
    loss = model(torch.randn(4, 16)).square().sum()
    assert _storage_bytes(model) == 0   # forward freed everything
    loss.backward()
    assert _storage_bytes(model) == 0 and not session.backward.active
    assert set(session.gradients()) == {n for n, _ in model.named_parameters()}
    assert session.counters.backwards == 1


class _AdaptedBlock(nn.Module):
    """A frozen base layer and a small trainable adapter beside it (LoRA's shape)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.down = nn.Linear(width, 2, bias=False)
        self.up = nn.Linear(2, width, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.up(self.down(x)))


class _AdaptedStack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 6, *, checkpoint: str = "none",
                 twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(width, width).requires_grad_(False)
        self.blocks = nn.ModuleList(_AdaptedBlock(width) for _ in range(depth))
        self.checkpoint, self.twice = checkpoint, twice

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            for _ in range(2 if self.twice else 1):
                if self.checkpoint == "none":
                    x = block(x)
                else:
                    x = torch.utils.checkpoint.checkpoint(
                        block, x, use_reentrant=self.checkpoint == "reentrant")
        return x


def _frozen_on_device(model: nn.Module) -> int:
    """Blocks whose frozen weight is on the device now."""
    return sum(tp.storage_bytes > 0 for tp in session_of(model).params.values()
               if tp.name.endswith("base.weight"))


@pytest.mark.parametrize("checkpoint", ["none", "non-reentrant", "reentrant"])
def test_backward_frees_a_units_frozen_parameters_once_its_backward_is_done(checkpoint):
    """A frozen parameter gets no gradient to say when it is done with: it is
    freed when the gradients of its unit's inputs are computed, not when the
    whole backward ends (a LoRA base of 70B held every streamed block at once)."""
    ref = _AdaptedStack(checkpoint=checkpoint)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    seen = []
    for block in model.blocks:
        block.register_full_backward_pre_hook(lambda m, g: seen.append(_frozen_on_device(model)))
    opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                foreach=False)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step), requires_grad=True)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert seen and max(seen) <= 2   # the running block's, and the next one's prefetched
    assert _storage_bytes(model) == 0
    assert_same_weights(model, ref)
    detach(model)


def test_a_unit_run_twice_keeps_its_frozen_parameters_for_both_backwards():
    ref = _AdaptedStack(depth=3, twice=True)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                foreach=False)
    x = torch.randn(4, 16, requires_grad=True)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().sum().backward()
        o.step()
    assert_same_weights(model, ref)
    assert _storage_bytes(model) == 0
    detach(model)


def test_a_full_pool_fails_clearly_and_keeps_the_model_usable():
    model = _mlp(depth=2)
    store = LocalStore(pool_bytes=1024)   # smaller than the parameters
    with pytest.raises(CapacityError, match="do not fit"):
        attach(copy.deepcopy(model), client=store, device="cpu")


# ------------------------------------------------------------------ fused optimizer
def test_fused_adamw_on_the_local_store_matches_torch_bitwise():
    ref = llama()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = batches(4)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert opt._fused and all(f.learned for f in opt._fused)
    assert_same_weights(model, ref)


def test_fused_training_keeps_no_gradient_keys_after_the_learning_step():
    """The first step sums gradients in the store; once updates run inside
    backward those keys are deleted, and an accumulation window makes them again."""
    ref = llama()
    store = LocalStore()
    model = attach(copy.deepcopy(ref), client=store, device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    grad_keys = lambda: [k for k in store.keys() if "/grad/" in k]   # noqa: E731
    data = batches(3)
    assert train(model, opt, data[:1]) == train(ref, ref_opt, data[:1])
    assert grad_keys() == []
    assert train(model, opt, data[1:]) == train(ref, ref_opt, data[1:])
    assert grad_keys() == []
    assert_same_weights(model, ref)
    opt.zero_grad()
    tierd.optim.AdamW(model.parameters(), lr=1e-3, fused=False)   # sums in the store again
    model(input_ids=data[0], labels=data[0]).loss.backward()
    assert grad_keys()


def test_commit_and_resume_on_the_local_store():
    store = LocalStore(job="run1")
    model = attach(gpt2(), client=store, job="run1", device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(2))
    tierd.commit(model, opt, 2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, batches(1, seed=5))   # not committed: lost at the restart
    store.restart()
    object.__delattr__(model, "_tierd_session")
    again = attach(gpt2(seed=3), client=store, job="run1", resume=True, device="cpu")
    assert tierd.resumed_step(again) == 2
    got = again.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
