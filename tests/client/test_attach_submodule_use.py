"""attach() on modules whose forward reads a child's parameters without calling
the child (``nn.MultiheadAttention`` and ``out_proj``): same losses, same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tests.client.models import assert_same_weights

DIM = 16


class _ChildWeightReader(nn.Module):
    """Owns no parameter itself: applies its child Linear through F.linear."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return F.linear(torch.tanh(x), self.proj.weight, self.proj.bias)


class _Block(nn.Module):
    def __init__(self, *, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, num_heads=2, batch_first=batch_first)
        self.norm = nn.LayerNorm(DIM)
        self.mix = _ChildWeightReader()

    def forward(self, x):
        h, _ = self.attn(x, x, x, need_weights=False)
        return self.mix(self.norm(x + h)) + x


class _Net(nn.Module):
    """Two blocks between an embedding and a head; ``ckpt`` checkpoints each block."""

    def __init__(self, *, ckpt: str | None = None, batch_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, DIM)
        self.blocks = nn.ModuleList(_Block(batch_first=batch_first) for _ in range(2))
        self.head = nn.Linear(DIM, 3)
        self.ckpt = ckpt

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            if self.ckpt is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(x)


def _storage_bytes(model: nn.Module) -> int:
    return sum(tp.storage_bytes for tp in session_of(model).params.values())


def _data(n: int, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, 4, generator=g), torch.randn(*shape, 3, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("ckpt", [None, "non-reentrant", "reentrant"])
def test_training_matches_torch_adamw_bitwise(daemon, ckpt):
    torch.manual_seed(0)
    ref = _Net(ckpt=ckpt)
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for x, y in _data(4, (5, 2)):   # (seq, batch): MultiheadAttention's default layout
        loss = F.mse_loss(model(x), y)
        assert _storage_bytes(model) == 0   # forward freed what it brought in
        loss.backward(); opt.step(); opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward(); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == want.item()
        assert _storage_bytes(model) == 0
    assert_same_weights(model, ref)


def test_gradients_reach_the_children_read_without_a_call(daemon):
    torch.manual_seed(0)
    ref = _Net()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    x, y = _data(1, (5, 2))[0]
    F.mse_loss(model(x), y).backward()
    F.mse_loss(ref(x), y).backward()
    got = session_of(model).gradients()
    for name, p in ref.named_parameters():
        assert torch.equal(got[name], p.grad), name
    assert "blocks.0.attn.out_proj.weight" in got and "blocks.1.mix.proj.bias" in got


@pytest.mark.parametrize("batch_first", [False, True])   # True: torch's fused fast path
def test_no_grad_inference_matches_torch_bitwise(daemon, batch_first):
    torch.manual_seed(0)
    ref = _Net(batch_first=batch_first).eval()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon)).eval()
    for x, _ in _data(3, (2, 5) if batch_first else (5, 2)):
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        assert _storage_bytes(model) == 0


class _HandTiedHead(nn.Module):
    """The root calls ``embed``, then reads its weight again as the output
    projection (weight tying written by hand): a child both called and read."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.mid = nn.Linear(DIM, DIM)

    def forward(self, x):
        return F.linear(torch.tanh(self.mid(self.embed(x))), self.embed.weight.t())


def test_root_reading_a_called_childs_weight_bitwise_and_prefetch_relearns(daemon):
    torch.manual_seed(0)
    ref = _HandTiedHead()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon), prefetch_bytes=1 << 20)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        x, y = torch.randn(5, 2, 3, generator=g), torch.randn(5, 2, 3, generator=g)
        loss = F.mse_loss(model(x), y)
        assert _storage_bytes(model) == 0
        loss.backward(); opt.step(); opt.zero_grad()
        want = F.mse_loss(ref(x), y)
        want.backward(); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == want.item()
    assert_same_weights(model, ref)
    planner = session_of(model).mover.planner   # the root unit holds both: one order
    assert planner.steps_followed >= 1 and planner.divergences == 0
