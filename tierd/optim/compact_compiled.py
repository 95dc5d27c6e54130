"""The compact AdamW update on CUDA as one compiled kernel per piece.

[Note: the compact update compiled on CUDA]
Eager, the compact update is some 35 elementwise ops per run of pieces
([Note: a compact update is a few dozen launches] in tierd.optim.compact),
each reading and writing fp32 temporaries of the whole run: memory traffic
of hundreds of bytes per parameter, where the stored state is 10 to 28.
torchao runs its ``single_param_adam`` under ``torch.compile`` for this
reason; here each piece's update (dequantize, the AdamW math, quantize or
round, in the same order as the eager ops) is one ``torch.compile``d
function over 1-D pieces with dynamic sizes, so a model compiles a handful
of graphs (one per combination of stored forms) and each piece reads its
stored bytes once and writes them once, in place from inside the graph
(only an 8-bit moment's block scales come back, 1/256 of its elements,
since their bytes need not be fp32-aligned). The per-step scalars travel as
one small tensor on the device (a Python float would be a constant of the
graph, and a new ``lr`` or step count a recompile). Results are the eager
ops' values up to the fusion's rounding (inductor may fuse and reorder fp32
arithmetic), which tests/optim checks within a few ulps on the CPU's
inductor; the stochastic rounding draws from inductor's Philox stream, not
the eager generator's. Where compiling fails (no compiler backend) the
eager update runs, with one warning; it also runs inside a graph being
compiled, and on the CPU, where the eager ops are torchao's bit for bit.
"""

from __future__ import annotations

import functools
import logging

import torch

from tierd.optim.compact import BLOCK, Codebook, Moment, nearest_codes

log = logging.getLogger(__name__)

_broken: list[str] = []   # why compiling failed, once


def usable(device: torch.device) -> bool:
    """Whether an update on ``device`` runs compiled."""
    return device.type == "cuda" and not _broken and not torch.compiler.is_compiling()


@functools.lru_cache(maxsize=256)
def scalars_on(device: torch.device, lr: float, decay: float, bias_correction1: float,
               bias_correction2_sqrt: float) -> torch.Tensor:
    """The step's scalars as one fp32 tensor on ``device`` (kept for the
    update calls of a step, which share them)."""
    return torch.tensor([lr, decay, bias_correction1, bias_correction2_sqrt],
                        dtype=torch.float32, device=device)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (values[codes.int()].view(-1, BLOCK) * scale.view(-1, 1)).view(-1)


def _quantize(x: torch.Tensor, book: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """tierd.optim.compact.quantize_blockwise's ops, on a 1-D ``x``."""
    blocks = x.view(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(1e-12)
    scaled = (blocks / scale.view(-1, 1)).view(-1)
    return nearest_codes(scaled, book), scale


def _load(moment, book: Codebook | None):
    if isinstance(moment, tuple):
        return _dequantize(moment[0], moment[1], book.values)
    return moment.float()


def _store(value: torch.Tensor, moment, book: Codebook | None):
    """Write ``value`` into ``moment`` in its stored form, in place: a
    tensor, or the codes of (codes, scales); returns the new block scales of
    an 8-bit moment (the caller writes their bytes, which need not be
    fp32-aligned), else None."""
    if isinstance(moment, tuple):
        codes, scale = _quantize(value, book)
        moment[0].copy_(codes)
        return scale
    moment.copy_(value)
    return None


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """tierd.optim.compact.stochastic_round_bf16's ops (its own draw)."""
    draw = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    bits = x.view(torch.int32)
    toward_zero = bits & -65536
    bits = torch.where(draw < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return bits.view(torch.float32).bfloat16()


def _piece(param, grad, exp_avg, exp_avg_sq, m_book, v_book, scalars, *, beta1: float,
           beta2: float, eps: float, maximize: bool):
    """One piece's update (tierd.optim.compact._adamw_run's ops, in order),
    written in place: ``param``, and ``exp_avg`` and ``exp_avg_sq`` in their
    stored forms; returns the moments' new block scales (None for a moment
    that has none). Writing inside the graph lets inductor store each result
    from the kernel that makes it, where returning new tensors cost a copy
    kernel of each (three more reads and writes of the piece)."""
    lr, decay, bias_correction1, bias_correction2_sqrt = scalars.unbind()
    p = param.float()
    g = grad.float()
    if maximize:
        g = -g
    m = _load(exp_avg, m_book)
    v = _load(exp_avg_sq, v_book)
    p = p - p * decay
    m = m.lerp(g, 1 - beta1)
    v = v.lerp(g * g, 1 - beta2)
    denom = v.sqrt() / bias_correction2_sqrt + eps
    p = p - m / bias_correction1 * lr / denom
    param.copy_(_round_bf16(p) if param.dtype == torch.bfloat16 else p)
    return _store(m, exp_avg, m_book), _store(v, exp_avg_sq, v_book)


_compiled_piece = torch.compile(_piece, dynamic=True)


def adamw_pieces(pieces: list[tuple], m_book: Codebook | None,
                 v_book: Codebook | None, *, lr: float, decay: float,
                 bias_correction1: float, bias_correction2_sqrt: float, beta1: float,
                 beta2: float, eps: float, maximize: bool) -> int:
    """Update ``pieces`` ((param, grad, exp_avg, exp_avg_sq) 1-D views, an
    8-bit moment as (codes, the scales' raw bytes)) in place, compiled, in
    order; returns how many were updated: all of them, or those before the
    first that could not be compiled, which the caller updates eagerly
    ([Note: the compact update compiled on CUDA])."""
    device = pieces[0][0].device
    scalars = scalars_on(device, lr, decay, bias_correction1, bias_correction2_sqrt)
    for done, (param, grad, exp_avg, exp_avg_sq) in enumerate(pieces):
        if _broken:
            return done
        try:
            scales = _compiled_piece(param, grad, _as_float_scales(exp_avg),
                                     _as_float_scales(exp_avg_sq), m_book, v_book, scalars,
                                     beta1=beta1, beta2=beta2, eps=eps, maximize=maximize)
        except Exception as exc:   # noqa: BLE001 - a backend's failure: eager from here on
            _broken.append(f"{type(exc).__name__}: {exc}")
            log.warning("tierd: the compact AdamW update could not be compiled (%s); it "
                        "runs as eager ops from now on, slower", _broken[0].splitlines()[0])
            return done
        for moment, scale in zip((exp_avg, exp_avg_sq), scales):
            if scale is not None:
                moment[1].copy_(scale.view(torch.uint8))
    return len(pieces)


def _as_float_scales(moment: Moment):
    """An 8-bit moment's (codes, fp32 scales): the scales' bytes copied out
    as fp32 (1/256 of the moment's elements). Never a view: the codes are
    written in the graph, and aot_autograd refuses a mutated input whose
    storage another input views as another dtype. Other moments as they are."""
    if not isinstance(moment, tuple):
        return moment
    codes, raw = moment
    return codes, raw.clone().view(torch.float32)
