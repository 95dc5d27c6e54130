"""Compact optimizer state: bf16 or 8-bit AdamW moments, bf16 master weights.

[Note: compact optimizer state]
Exact fp32 AdamW keeps 16 B per trained parameter (bf16 compute copy 2,
fp32 master 4, two fp32 moments 8; 14 at rest once the gradient is
consumed). ``tierd.optim.AdamW(state=..., master=...)`` keeps less, by
choice only (the defaults are exact fp32 and unchanged):

- ``state="bf16"``: both moments in bf16 (round to nearest), 4 B.
- ``state="8bit"``: both moments block-quantized to 8 bits with the dynamic
  (tree) map of bitsandbytes and torchao's ``AdamW8bit``: each block of
  :data:`BLOCK` elements is scaled by its absolute maximum (kept in fp32),
  then each value becomes the nearest of 256 codes (signed map for
  ``exp_avg``, unsigned for ``exp_avg_sq``). A key holds one uint8 tensor:
  the codes, then the block scales' bytes (:func:`packed_numel`), so every
  path that moves a key moves the compact bytes as they are. As in
  bitsandbytes and torchao, a tensor with fewer than :data:`MIN_QUANTIZED`
  elements, or not whole blocks, keeps fp32 moments (biases and norms: a
  negligible share of a model, and the most sensitive).
- ``master="bf16"``: no fp32 master; a bf16 parameter's compute copy is
  its master, updated with stochastic rounding (round away from zero with
  the probability of the discarded low 16 bits), so that updates smaller
  than half a bf16 ulp still move the weight on average. Parameters that
  compute in fp32 keep their fp32 value (it is their master already).

Every compact setting updates with torchao's ``single_param_adam`` math
(fp32 arithmetic on the dequantized moments, ``exp_avg_sq`` by ``lerp``,
decoupled weight decay as ``p - lr * wd * p``), the same ops in the same
order, so a step is bitwise torchao's eager step on CPU
(tests/optim/test_compact.py). The kernels are plain torch ops on whatever
device the update runs (pool views on the host, device copies for a fused
or resident update). The setting is part of what a commit and a state dict
hold; a job resumed, or a dict loaded, with a different one raises instead
of reading bytes as another format ([Note: compact state on resume]).

[Note: compact state on resume]
A state key's bytes mean what the optimizer that wrote them says. A commit
of a compact optimizer stores its setting (:func:`format_key`), and the
optimizer built on resume compares it (absent: fp32) with its own before it
reads anything: a different setting is a StateError that names both, not
moments read as another format. Masters tell too: ``master="bf16"`` with a
stored fp32 master, or ``master="fp32"`` for a parameter that stepped
without one, are refused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: elements per quantization block (torchao's AdamW8bit, bitsandbytes)
BLOCK = 256
#: smaller tensors keep fp32 moments under state="8bit" (bitsandbytes' min_8bit_size)
MIN_QUANTIZED = 4096
STATES = ("fp32", "bf16", "8bit")
MASTERS = ("fp32", "bf16")


def dynamic_map(signed: bool) -> list[float]:
    """The 256 values of the 8-bit dynamic (tree) quantization map, sorted:
    bitsandbytes' ``create_dynamic_map`` (7 exponent bits, no zero padding),
    as torchao's ``AdamW8bit`` uses it."""
    exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(exponent_bits):
        items = 2 ** (i + non_sign_bits - exponent_bits) + 1 if signed \
            else 2 ** (i + non_sign_bits - exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, int(items))
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(exponent_bits - 1) + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return data


_QMAPS = {signed: tuple(dynamic_map(signed)) for signed in (True, False)}


def qmap(signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The dynamic map as an fp32 tensor on ``device``."""
    return torch.tensor(_QMAPS[signed], dtype=torch.float32, device=device)


def quantizable(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements gets 8-bit moments."""
    return numel >= MIN_QUANTIZED and numel % BLOCK == 0


def packed_numel(numel: int) -> int:
    """Bytes of one 8-bit moment of ``numel`` elements: codes, then fp32 block scales."""
    _check_blocks(numel)
    return numel + 4 * (numel // BLOCK)


def _check_blocks(numel: int) -> None:
    if numel <= 0 or numel % BLOCK:
        raise ValueError(f"8-bit block quantization needs whole blocks of {BLOCK} elements; "
                         f"got {numel} (tensors with fewer than {MIN_QUANTIZED} elements or "
                         "not whole blocks keep fp32 moments)")


def quantize_blockwise(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped as ``x``, fp32 scale per block): each block of
    :data:`BLOCK` scaled by its absolute maximum, then rounded to the nearest
    value of ``table`` (round half up), as torchao's ``scale_tensor`` and
    ``quantize_8bit_with_qmap``. The code below a value is found by one
    ``searchsorted`` (the largest code whose value is at most it: what
    torchao's eight-step binary search finds, in one pass over int32 codes
    instead of eight over int64), then rounded with torchao's own ops."""
    _check_blocks(x.numel())
    x = x.float()
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(1e-12)
    scaled = (blocks / scale.view(-1, 1)).view(x.shape)
    codes = (torch.searchsorted(table, scaled, right=True, out_int32=True) - 1).clip(min=0)
    up = (codes + 1).clip(max=255)
    low, high = table[codes], table[up]
    codes = torch.where(scaled - low >= (high - low) * 0.5, up, codes)
    return codes.to(torch.uint8), scale


def dequantize_blockwise(codes: torch.Tensor, scale: torch.Tensor,
                         table: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (any shape) with their block ``scale``."""
    out = table[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return out.view(codes.shape)


def unpack(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one packed 8-bit moment (:func:`packed_numel`
    bytes); the codes are a view, the scales a view where aligned, else a copy."""
    if packed.dtype != torch.uint8 or packed.numel() != packed_numel(numel):
        raise ValueError(f"a packed 8-bit moment of {numel} elements is "
                         f"{packed_numel(numel)} uint8 bytes; got {packed.dtype} "
                         f"with {packed.numel()} elements")
    flat = packed.reshape(-1)
    raw = flat[numel:]
    try:
        scale = raw.view(torch.float32)
    except RuntimeError:   # a storage offset not a multiple of 4
        scale = raw.clone().view(torch.float32)
    return flat[:numel], scale


def pack_into(packed: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Write ``codes`` and ``scale`` into ``packed`` in place."""
    flat = packed.view(-1)
    n = codes.numel()
    flat[:n].copy_(codes.reshape(-1))
    flat[n:].copy_(scale.contiguous().view(torch.uint8))


def stochastic_round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) to bf16, rounded away from zero with the probability of
    its low 16 bits over 2^16 (torchao's ``_fp32_to_bf16_sr``: one
    ``torch.randint`` draw of the default generator on ``x``'s device)."""
    draw = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    bits = x.contiguous().view(torch.int32)
    toward_zero = bits & -65536   # 0xFFFF0000 as a signed 32-bit mask
    bits = torch.where(draw < (bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return bits.view(torch.float32).bfloat16()


@dataclass(frozen=True)
class CompactState:
    """How an AdamW keeps its moments (``state``) and master weights
    (``master``): see [Note: compact optimizer state]. The default is exact
    fp32 AdamW.

    Example:
        >>> CompactState(state="8bit", master="bf16").bytes_per_param(torch.bfloat16)
        4.03125
        >>> CompactState().exact
        True
    """

    state: str = "fp32"
    master: str = "fp32"

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state={self.state!r} is not a moment format; use one of "
                             f"{', '.join(map(repr, STATES))} (default 'fp32': exact AdamW)")
        if self.master not in MASTERS:
            raise ValueError(f"master={self.master!r} is not a master format; use one of "
                             f"{', '.join(map(repr, MASTERS))} (default 'fp32')")

    @property
    def exact(self) -> bool:
        """fp32 moments and masters: torch's AdamW, bitwise."""
        return self.state == "fp32" and self.master == "fp32"

    @property
    def text(self) -> str:
        return f"state={self.state!r}, master={self.master!r}"

    @classmethod
    def from_text(cls, text: str) -> "CompactState":
        """The setting :attr:`record` wrote."""
        fields = dict(part.split("=", 1) for part in text.split(";"))
        return cls(state=fields.get("state", "fp32"), master=fields.get("master", "fp32"))

    @property
    def record(self) -> str:
        """What a commit stores ([Note: compact state on resume])."""
        return f"state={self.state};master={self.master}"

    # ------------------------------------------------------------- forms
    def master_in_compute(self, param: torch.Tensor) -> bool:
        """A trainable ``param`` (its compute copy) is its own master: bf16
        under ``master="bf16"``, or fp32 (always its own master)."""
        return param.dtype == torch.float32 or (self.master == "bf16"
                                                and param.dtype == torch.bfloat16)

    def moment_like(self, param: torch.Tensor) -> torch.Tensor:
        """A meta tensor with the dtype and shape of one stored moment of ``param``."""
        if self.state == "bf16":
            return torch.empty(param.shape, dtype=torch.bfloat16, device="meta")
        if self.state == "8bit" and quantizable(param.numel()):
            return torch.empty(packed_numel(param.numel()), dtype=torch.uint8, device="meta")
        return torch.empty(param.shape, dtype=torch.float32, device="meta")

    def moment_nbytes(self, param: torch.Tensor) -> int:
        like = self.moment_like(param)
        return like.numel() * like.element_size()

    def bytes_per_param(self, compute_dtype: torch.dtype, *, numel: int = 1 << 20) -> float:
        """Bytes a trained parameter keeps at rest (compute copy, master, two
        moments; the gradient is consumed by the update) for a tensor of
        ``numel`` elements in ``compute_dtype``."""
        like = torch.empty(numel, dtype=compute_dtype, device="meta")
        compute = compute_dtype.itemsize
        master = 0 if self.master_in_compute(like) else 4
        return compute + master + 2 * self.moment_nbytes(like) / numel

    # ------------------------------------------------------------- values
    def encode(self, value: torch.Tensor, like: torch.Tensor, signed: bool) -> torch.Tensor:
        """``value`` (fp32 moment, param-shaped) in the stored form of ``like``."""
        if like.dtype == torch.uint8:
            codes, scale = quantize_blockwise(value, qmap(signed, value.device))
            out = torch.empty(like.shape, dtype=torch.uint8, device=value.device)
            pack_into(out, codes, scale)
            return out
        return value.to(like.dtype).reshape(like.shape)


class _Moment:
    """One stored moment during an update: its fp32 values, written back
    into the stored form (:meth:`store`)."""

    def __init__(self, stored: torch.Tensor, shape: torch.Size, table: torch.Tensor | None):
        self.stored, self.shape, self.table = stored, shape, table
        if table is None:
            self.values = stored.float().view(shape)
        else:
            codes, scale = unpack(stored, shape.numel())
            self.values = dequantize_blockwise(codes, scale, table).view(shape)

    def store(self, new: torch.Tensor) -> None:
        if self.table is None:
            self.stored.view(self.shape).copy_(new)
            return
        codes, scale = quantize_blockwise(new, self.table)
        pack_into(self.stored, codes, scale)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: float, lr: float, beta1: float,
               beta2: float, weight_decay: float, eps: float, maximize: bool,
               stochastic: bool, tables: dict[bool, torch.Tensor] | None = None) -> None:
    """One AdamW step of one tensor on compact state, in place: torchao's
    ``single_param_adam`` (AdamW, no amsgrad) op for op, with ``lr`` and
    ``step`` as fp32 CPU scalars as torchao holds them (on CUDA too: a CPU
    scalar joins a device op without a copy or a sync). ``exp_avg`` and
    ``exp_avg_sq`` are stored moments (fp32, bf16, or packed 8-bit uint8: see
    [Note: compact optimizer state]); ``param`` is the master (fp32) or, with
    ``stochastic``, a bf16 compute copy rounded stochastically. ``tables``
    keeps the quantization maps on ``param``'s device between calls (by
    signedness; made here when missing)."""
    tables = {} if tables is None else tables

    def table(signed: bool, stored: torch.Tensor) -> torch.Tensor | None:
        if stored.dtype != torch.uint8:
            return None
        if signed not in tables:
            tables[signed] = qmap(signed, param.device)
        return tables[signed]

    shape = param.shape
    m = _Moment(exp_avg, shape, table(True, exp_avg))
    v = _Moment(exp_avg_sq, shape, table(False, exp_avg_sq))
    lr_t = torch.tensor(lr, dtype=torch.float32)
    step_t = torch.tensor(step, dtype=torch.float32)
    p32 = param.float()
    g32 = grad.float()
    if maximize:
        g32 = -g32
    p32 = p32 - lr_t * weight_decay * p32
    bias_correction1 = 1 - beta1 ** step_t
    bias_correction2 = 1 - beta2 ** step_t
    m32 = m.values.lerp(g32, 1 - beta1)
    v32 = v.values.lerp(g32.square(), 1 - beta2)
    m.store(m32)
    v.store(v32)
    denom = (v32.sqrt() / bias_correction2.sqrt()) + eps
    p32 = p32 - lr_t * (m32 / bias_correction1) / denom
    param.copy_(stochastic_round_bf16(p32) if stochastic else p32)
