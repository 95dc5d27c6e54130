"""The compact AdamW update compiled (what CUDA runs), against the eager
ops (torchao's, bitwise: tests/optim/test_compact.py), on the CPU's inductor."""

from __future__ import annotations

import logging

import pytest
import torch

from tierd.optim import compact, compact_compiled

N = 3 * 4096 + 512   # whole blocks, several pieces at a small run limit
KW = dict(step=3.0, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
          maximize=False)


def _tensors(state: str, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """A parameter, its gradient and its two moments stored as ``state`` keeps them."""
    gen = torch.Generator().manual_seed(seed)
    setting = compact.CompactState(state=state)
    like = torch.empty(N, dtype=dtype)
    m = setting.encode(torch.randn(N, generator=gen) * 1e-3, setting.moment_like(like), True)
    v = setting.encode(torch.rand(N, generator=gen) * 1e-5, setting.moment_like(like), False)
    return [torch.randn(N, generator=gen).to(dtype), torch.randn(N, generator=gen) * 1e-2, m, v]


def _compiled_step(p, g, m, v, monkeypatch, *, run_numel: int = 4096) -> int:
    """adamw_pieces over the tensors cut as adamw_step cuts them."""
    monkeypatch.setattr(compact_compiled, "_broken", [])
    pieces = compact._pieces([p], [g], [m], [v], run_numel)
    scalars = dict(compact._scalars(KW["lr"], KW["step"], KW["beta1"], KW["beta2"],
                                    KW["weight_decay"]),
                   beta1=KW["beta1"], beta2=KW["beta2"], eps=KW["eps"], maximize=False)
    return compact_compiled.adamw_pieces(pieces, compact.codebook(True), compact.codebook(False),
                                         **scalars)


def test_compiled_8bit_update_is_the_eager_ops_within_rounding(monkeypatch):
    """fp32 masters, 8-bit moments, in several pieces: the masters within an
    ulp or two, and the codes the same but for the few values the fused
    arithmetic's rounding moves across a code boundary."""
    eager, compiled = _tensors("8bit", torch.float32), _tensors("8bit", torch.float32)
    compact.adamw_step(*[[t] for t in eager], **KW)
    assert _compiled_step(*compiled, monkeypatch) == 4   # four pieces, all compiled
    torch.testing.assert_close(compiled[0], eager[0], rtol=3e-7, atol=1e-9)
    for i in (2, 3):
        codes_e, scale_e = compact.unpack(eager[i], N)
        codes_c, scale_c = compact.unpack(compiled[i], N)
        assert (codes_c == codes_e).float().mean() > 0.995
        assert (codes_c.int() - codes_e.int()).abs().max() <= 1
        torch.testing.assert_close(scale_c, scale_e, rtol=1e-6, atol=0)


def test_compiled_bf16_master_rounds_to_a_neighbour_of_the_eager_value(monkeypatch):
    """bf16 masters with bf16 moments: the compiled draw is its own, so each
    new weight is the eager fp32 value rounded down or up to bf16."""
    eager, compiled = _tensors("bf16", torch.bfloat16), _tensors("bf16", torch.bfloat16)
    exact = [eager[0].float()] + eager[1:]   # the fp32 values before any rounding
    compact.adamw_step(*[[t] for t in exact], **KW)
    assert _compiled_step(*compiled, monkeypatch) == 4
    down = exact[0].bfloat16()
    up = torch.nextafter(down, torch.where(exact[0] > down.float(), torch.inf, -torch.inf)
                         .bfloat16())
    assert bool(((compiled[0] == down) | (compiled[0] == up)).all())
    torch.testing.assert_close(compiled[2].float(), eager[2].float(), rtol=8e-3, atol=0)


def test_a_failed_compile_leaves_the_rest_to_the_eager_ops_and_says_so(monkeypatch, caplog):
    """A backend that cannot compile changes nothing: adamw_step runs the
    eager ops (bitwise torchao's), and tells once why it is slower."""
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler for this device")
    eager, fallback = _tensors("8bit", torch.float32), _tensors("8bit", torch.float32)
    compact.adamw_step(*[[t] for t in eager], **KW)   # the CPU: eager ops
    monkeypatch.setattr(compact_compiled, "_compiled_piece", broken)
    with caplog.at_level(logging.WARNING, logger="tierd.optim.compact_compiled"):
        monkeypatch.setattr(compact_compiled, "_broken", [])
        compact.adamw_step(*[[t] for t in fallback], **KW,
                           compiled=compact_compiled.adamw_pieces)
    assert all(torch.equal(a, b) for a, b in zip(fallback, eager))
    assert "could not be compiled (RuntimeError: no compiler for this device)" in caplog.text
    assert compact_compiled._broken   # and never tried again
    assert _compiled_step(*_tensors("8bit", torch.float32), monkeypatch) == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_only_cuda_updates_run_compiled(device):
    assert not compact_compiled.usable(torch.device(device))
