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
or resident update), over all the tensors of an update at once ([Note: a
compact update is a few dozen launches]). The setting is part of what a commit and a state dict
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

[Note: a compact update is a few dozen launches]
torchao's step is some 25 eager ops per tensor, twice that with 8-bit
moments (dequantize, quantize). Tensor by tensor over GPT-2's 148 tensors
that is thousands of small kernel launches a step, which the GPU waits on:
on the H200 a compact step cost over twice an exact one (torch's fused
AdamW, one pass per tensor). So :func:`adamw_step` takes all the tensors of
an update (a bucket) at once, in runs of up to :data:`RUN_NUMEL` elements
(a larger tensor in pieces of whole blocks, which bounds the fp32
temporaries: tensor by tensor, the update of an 8B-wide model's 525M-element
embedding makes a dozen fp32 temporaries of 2.1 GB, which the first step's
measured peak then takes from placement): values that need a cast, and the
8-bit codes and scales, go through one flat buffer per stored form, and the
arithmetic runs as ``torch._foreach_*`` ops over the run: a few dozen
launches per run. It stays torchao's math bit for bit: on the CPU a foreach
op is the single-tensor op applied tensor by tensor; pieces and flat
buffers change no value (the ops are elementwise, and quantization is per
block: pieces are cut at block boundaries and a quantized tensor is whole
blocks); the stochastic rounding of a run is one draw of the CPU generator,
the same bits as one draw per tensor in order (tests/optim/test_compact.py
checks it all against torchao). No op is left per tensor. On CUDA the same
ops run compiled, piece by piece ([Note: the compact update compiled on
CUDA] in tierd.optim.compact_compiled), not claimed bitwise torchao's;
every update path runs this same function.

[Note: 8-bit codes by a value's top bits]
torchao finds a scaled value's code by a binary search over the map's 256
values and then rounds it to the nearer neighbour (:func:`_searched_codes`,
the definition): eight dependent gathers and four more per element, which
made quantizing most of an 8-bit update's time. That code is a
non-decreasing step function of the value: inside one searched interval the
rounding test ``x - low >= (high - low) * 0.5`` is monotone in ``x``, and at
a map value both intervals give the same code. Its steps lie further apart
than the span of the fp32 values that share their top 16 bits (sign,
exponent and 7 mantissa bits: a span of 2^-7 of the power of two below
them; the closest steps are 1.35 such spans apart, in the unsigned map just
below 1), so within such a key at most one step falls: a value's code is ``above[key]`` if it is at least
``threshold[key]``, else ``below[key]`` (:class:`Codebook`,
:func:`nearest_codes`: three gathers from tables of 65536 entries). The
tables come from the definition itself (:func:`_lookup`: each key's two
ends, and its threshold by a binary search over its 65536 values, checking
that no key holds two steps), so every fp32 value gets torchao's code,
NaN and the infinities too (their keys keep their codes).
tests/optim/test_compact.py checks every key's ends and both sides of each
threshold against the definition, and the quantizer against torchao.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

#: elements per quantization block (torchao's AdamW8bit, bitsandbytes)
BLOCK = 256
#: smaller tensors keep fp32 moments under state="8bit" (bitsandbytes' min_8bit_size)
MIN_QUANTIZED = 4096
#: elements one multi-tensor update works on at once (a larger tensor in
#: pieces of whole blocks): bounds its fp32 temporaries ([Note: a compact
#: update is a few dozen launches])
RUN_NUMEL = 1 << 24
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


class Codebook(NamedTuple):
    """An 8-bit map on one device: its 256 sorted fp32 ``values``, and by
    each fp32 value's top 16 bits (its key) the code of the key's values
    below ``threshold`` and of those at or above it ([Note: 8-bit codes by
    a value's top bits])."""
    values: torch.Tensor
    threshold: torch.Tensor   # (65536,) fp32
    below: torch.Tensor       # (65536,) uint8
    above: torch.Tensor       # (65536,) uint8


def codebook(signed: bool, device: torch.device | str = "cpu") -> Codebook:
    """The signed (``exp_avg``) or unsigned (``exp_avg_sq``) map's :class:`Codebook`
    on ``device``."""
    return Codebook(*(t.to(device) for t in _lookup(signed)))


def nearest_codes(scaled: torch.Tensor, book: Codebook) -> torch.Tensor:
    """uint8 codes of the nearest map values to fp32 ``scaled`` (round half
    up): :func:`_searched_codes` exactly, by three gathers."""
    key = (scaled.view(torch.int32) >> KEY_SHIFT) & (KEYS - 1)
    return torch.where(scaled >= book.threshold[key], book.above[key], book.below[key])


def _searched_codes(scaled: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The definition of a value's code, torchao's ``quantize_8bit_with_qmap``:
    the largest code whose value is at most it (one ``searchsorted``: what
    torchao's eight-step binary search finds), then the code above it where
    the value is at least halfway there, with torchao's own ops (int32)."""
    codes = (torch.searchsorted(values, scaled, right=True, out_int32=True) - 1).clip(min=0)
    up = (codes + 1).clip(max=255)
    low, high = values[codes], values[up]
    return torch.where(scaled - low >= (high - low) * 0.5, up, codes)


KEY_SHIFT = 16
KEYS = 1 << (32 - KEY_SHIFT)


@functools.lru_cache(maxsize=2)
def _lookup(signed: bool) -> tuple[torch.Tensor, ...]:
    """(values, threshold, below, above) of :class:`Codebook` on the CPU, from
    :func:`_searched_codes` itself ([Note: 8-bit codes by a value's top bits])."""
    values = qmap(signed)
    keys = torch.arange(KEYS, dtype=torch.int64)
    negative = keys >= KEYS // 2
    last = (1 << KEY_SHIFT) - 1

    def nth(i: torch.Tensor) -> torch.Tensor:
        """The ``i``-th smallest fp32 value of each key (bits of a negative
        value grow as it falls)."""
        bits = (keys << KEY_SHIFT) | torch.where(negative, last - i, i)
        return bits.to(torch.int32).view(torch.float32)   # two's complement wrap: the bits

    def code(x: torch.Tensor) -> torch.Tensor:
        return _searched_codes(x, values)

    first, final = torch.zeros_like(keys), torch.full_like(keys, last)
    below, above = code(nth(first)), code(nth(final))
    special = (keys & 0x7F80) == 0x7F80   # infinity and NaN
    steps = torch.where(special, 0, above - below)
    if not bool(((steps == 0) | (steps == 1)).all()):
        raise RuntimeError("two steps of the 8-bit map share a key: shift by fewer bits")
    lo, hi = first.clone(), final.clone()   # the least index coded `above`: in (lo, hi]
    for _ in range(KEY_SHIFT):
        mid = (lo + hi) // 2
        right = code(nth(mid)) < above
        lo, hi = torch.where(right, mid + 1, lo), torch.where(right, hi, mid)
    threshold = torch.where(steps == 1, nth(hi), torch.inf)
    # a key of infinity and NaNs: its infinity (the only value >= +-inf there)
    # gets infinity's code, the NaNs (never >= anything) NaN's
    nan = code(torch.tensor([torch.nan]))
    inf = torch.where(negative, -torch.inf, torch.inf)
    threshold = torch.where(special, torch.where((keys & 0x7FFF) == 0x7F80, inf, torch.inf),
                            threshold)
    below = torch.where(special, nan, below)
    above = torch.where(special, code(inf), torch.where(steps == 1, above, below))
    return values, threshold, below.to(torch.uint8), above.to(torch.uint8)


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


def quantize_blockwise(x: torch.Tensor, book: Codebook) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes shaped as ``x``, fp32 scale per block): each block of
    :data:`BLOCK` scaled by its absolute maximum, then rounded to the nearest
    value of ``book`` (round half up: :func:`nearest_codes`), as torchao's
    ``scale_tensor`` and ``quantize_8bit_with_qmap``."""
    _check_blocks(x.numel())
    x = x.float()
    blocks = x.reshape(-1, BLOCK)
    scale = blocks.abs().amax(-1).clip(1e-12)
    scaled = (blocks / scale.view(-1, 1)).view(x.shape)
    return nearest_codes(scaled, book), scale


def dequantize_blockwise(codes: torch.Tensor, scale: torch.Tensor,
                         values: torch.Tensor) -> torch.Tensor:
    """fp32 values of ``codes`` (any shape) with their block ``scale``, from
    the map's 256 ``values``."""
    out = values[codes.int()].view(scale.shape[0], -1) * scale.view(-1, 1)
    return out.view(codes.shape)


def split_packed(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, the block scales' raw bytes) of one packed 8-bit moment
    (:func:`packed_numel` uint8 bytes), both views of it."""
    if packed.dtype != torch.uint8 or packed.numel() != packed_numel(numel):
        raise ValueError(f"a packed 8-bit moment of {numel} elements is "
                         f"{packed_numel(numel)} uint8 bytes; got {packed.dtype} "
                         f"with {packed.numel()} elements")
    flat = packed.reshape(-1)
    return flat[:numel], flat[numel:]


def _float32(raw: torch.Tensor) -> torch.Tensor:
    """uint8 bytes read as fp32: a view where aligned, else a copy."""
    try:
        return raw.view(torch.float32)
    except RuntimeError:   # a storage offset not a multiple of 4
        return raw.clone().view(torch.float32)


def unpack(packed: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of one packed 8-bit moment (:func:`packed_numel`
    bytes); the codes are a view, the scales a view where aligned, else a copy."""
    codes, raw = split_packed(packed, numel)
    return codes, _float32(raw)


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
            codes, scale = quantize_blockwise(value, codebook(signed, value.device))
            out = torch.empty(like.shape, dtype=torch.uint8, device=value.device)
            pack_into(out, codes, scale)
            return out
        return value.to(like.dtype).reshape(like.shape)


#: one stored moment of a piece during an update: an fp32 or bf16 tensor, or
#: the codes and the block scales' bytes of an 8-bit one (:func:`split_packed`)
Moment = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """1-D ``tensors`` one after another in one tensor (the tensor itself if one)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _fp32(tensors: list[torch.Tensor]):
    """fp32 values of 1-D ``tensors``: fp32 ones as they are (the same
    tensors), the others cast into one flat buffer. Returns (the list, the
    buffer or None, the positions cast)."""
    out = list(tensors)
    where = [i for i, t in enumerate(tensors) if t.dtype != torch.float32]
    if not where:
        return out, None, where
    flat = _flat([tensors[i] for i in where]).float()
    for i, view in zip(where, flat.split([tensors[i].numel() for i in where])):
        out[i] = view
    return out, flat, where


class _Moments:
    """One moment of a run of pieces during an update: fp32 values
    (``values``: the stored pieces themselves where stored in fp32, else
    views of one flat buffer per stored form), written back into the stored
    forms by :meth:`store`. Blocks never span pieces (a quantized tensor is
    whole blocks, cut at block boundaries), so the 8-bit ones are
    (de)quantized as one flat tensor: per block, the values of tensor by tensor."""

    def __init__(self, stored: list[Moment], book: Codebook | None):
        self.stored, self.book = stored, book
        # fp32: the stored pieces themselves, changed in place
        self.values = [s if isinstance(s, torch.Tensor) and s.dtype == torch.float32 else None
                       for s in stored]
        self.bf16 = [i for i, s in enumerate(stored)
                     if isinstance(s, torch.Tensor) and s.dtype == torch.bfloat16]
        self.packed = [i for i, s in enumerate(stored) if isinstance(s, tuple)]
        self._bf16_flat = self._packed_flat = None
        if self.bf16:
            self._bf16_flat = _flat([stored[i] for i in self.bf16]).float()
            self._fill(self.bf16, self._bf16_flat)
        if self.packed:
            codes = _flat([stored[i][0] for i in self.packed])
            scale = _float32(_flat([stored[i][1] for i in self.packed]))
            self._packed_flat = dequantize_blockwise(codes, scale, book.values)
            self._fill(self.packed, self._packed_flat)

    def _sizes(self, where: list[int]) -> list[int]:
        return [self.values[i].numel() if self.values[i] is not None
                else self.stored[i][0].numel() if isinstance(self.stored[i], tuple)
                else self.stored[i].numel() for i in where]

    def _fill(self, where: list[int], flat: torch.Tensor) -> None:
        for i, view in zip(where, flat.split(self._sizes(where))):
            self.values[i] = view

    def store(self) -> None:
        """The (changed) values into the stored forms, in place."""
        if self.bf16:
            rounded = self._bf16_flat.bfloat16()
            torch._foreach_copy_([self.stored[i] for i in self.bf16],
                                 list(rounded.split(self._sizes(self.bf16))))
        if self.packed:
            codes, scale = quantize_blockwise(self._packed_flat, self.book)
            n = self._sizes(self.packed)
            parts = [self.stored[i] for i in self.packed]
            torch._foreach_copy_(
                [c for c, _ in parts] + [b for _, b in parts],
                list(codes.split(n)) + list(scale.view(torch.uint8).split(
                    [4 * k // BLOCK for k in n])))


def _whole(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a 1-D view (updated in place through it)."""
    if not t.is_contiguous():
        raise ValueError(f"compact AdamW updates contiguous tensors in place; the {what} of "
                         f"shape {tuple(t.shape)} is not contiguous")
    return t.view(-1)


def _moment(stored: torch.Tensor, numel: int) -> Moment:
    if stored.dtype == torch.uint8:
        return split_packed(stored, numel)
    if stored.dtype not in (torch.float32, torch.bfloat16) or stored.numel() != numel:
        raise ValueError(f"a stored AdamW moment of a {numel}-element tensor is {numel} fp32 "
                         f"or bf16 values, or packed 8-bit uint8; got {stored.dtype} with "
                         f"{stored.numel()} elements")
    return _whole(stored, "moment")


def _cut(moment: Moment, a: int, b: int) -> Moment:
    """Elements ``a:b`` of a moment (whole blocks of an 8-bit one)."""
    if isinstance(moment, tuple):
        codes, raw = moment
        return codes[a:b], raw[4 * a // BLOCK:4 * b // BLOCK]
    return moment[a:b]


def _pieces(params, grads, exp_avgs, exp_avg_sqs, limit: int) -> list[tuple]:
    """Every tensor as 1-D pieces of at most ``limit`` elements (whole
    blocks), in order: (param, grad, exp_avg, exp_avg_sq) views of each."""
    out = []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        n = p.numel()
        if g.numel() != n:
            raise ValueError(f"a gradient of {g.numel()} elements for a parameter of "
                             f"shape {tuple(p.shape)}")
        whole = (_whole(p, "parameter"), g.reshape(-1), _moment(m, n), _moment(v, n))
        if n <= limit:
            out += [whole] if n else []
            continue
        out += [tuple(_cut(x, a, min(n, a + limit)) for x in whole)
                for a in range(0, n, limit)]
    return out


def _runs(sizes: list[int], limit: int) -> list[slice]:
    """Consecutive runs of pieces of ``sizes`` elements, at most ``limit`` in
    all: what one multi-tensor update works on at once."""
    runs, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and size + n > limit:
            runs.append(slice(start, i))
            start, size = i, 0
        size += n
    return runs + [slice(start, len(sizes))] if sizes else runs


@functools.lru_cache(maxsize=64)
def _scalars(lr: float, step: float, beta1: float, beta2: float,
             weight_decay: float) -> dict[str, float]:
    """torchao's scalars, computed as it computes them (fp32 CPU tensors),
    as numbers: a multi-tensor op takes the same fp32 value as a Python
    scalar, exactly. Kept for the calls of a step (they share them)."""
    lr_t = torch.tensor(lr, dtype=torch.float32)
    step_t = torch.tensor(step, dtype=torch.float32)
    return dict(lr=lr_t.item(), decay=(lr_t * weight_decay).item(),
                bias_correction1=(1 - beta1 ** step_t).item(),
                bias_correction2_sqrt=(1 - beta2 ** step_t).sqrt().item())


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor],
               exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
               step: float, lr: float, beta1: float, beta2: float, weight_decay: float,
               eps: float, maximize: bool,
               books: dict[bool, Codebook] | None = None,
               compiled: Callable[..., int] | None = None) -> None:
    """One AdamW step of several tensors on compact state, in place: for each
    tensor, torchao's ``single_param_adam`` (AdamW, no amsgrad) op for op,
    bitwise on the CPU, run as multi-tensor ops over runs of up to
    :data:`RUN_NUMEL` elements ([Note: a compact update is a few dozen
    launches]). ``exp_avgs`` and ``exp_avg_sqs`` are stored moments (fp32,
    bf16, or packed 8-bit uint8: see [Note: compact optimizer state]); each
    ``params`` entry is its master: fp32, or a bf16 compute copy rounded
    stochastically. Tensors are updated in place and must be contiguous.
    ``books`` keeps the 8-bit maps' :class:`Codebook` on the parameters'
    device between calls (by signedness; made here when missing). ``compiled``, where given
    (:func:`tierd.optim.compact_compiled.adamw_pieces`), updates each run's
    pieces first and returns how many it did; the eager ops do the rest."""
    odd = [p.dtype for p in params if p.dtype not in (torch.float32, torch.bfloat16)]
    if odd:
        raise ValueError(f"compact AdamW updates fp32 masters or bf16 compute copies; got "
                         f"a {odd[0]} parameter")
    assert RUN_NUMEL % BLOCK == 0, "a run is cut at block boundaries"
    pieces = _pieces(params, grads, exp_avgs, exp_avg_sqs, RUN_NUMEL)
    if not pieces:
        return
    books = {} if books is None else books
    for signed, stored in ((True, exp_avgs), (False, exp_avg_sqs)):
        if signed not in books and any(s.dtype == torch.uint8 for s in stored):
            books[signed] = codebook(signed, params[0].device)
    scalars = dict(_scalars(float(lr), float(step), beta1, beta2, weight_decay),
                   beta1=beta1, beta2=beta2, eps=eps, maximize=maximize)
    for run in _runs([piece[0].numel() for piece in pieces], RUN_NUMEL):
        run_pieces = pieces[run]
        if compiled is not None:   # [Note: the compact update compiled on CUDA]
            run_pieces = run_pieces[compiled(run_pieces, books.get(True), books.get(False),
                                             **scalars):]
        if run_pieces:
            _adamw_run(run_pieces, books.get(True), books.get(False), **scalars)


def _adamw_run(pieces: list[tuple], m_book: Codebook | None,
               v_book: Codebook | None, *, lr: float, decay: float,
               bias_correction1: float, bias_correction2_sqrt: float, beta1: float,
               beta2: float, eps: float, maximize: bool) -> None:
    """:func:`adamw_step` of one run of pieces: torchao's ops, each over the run."""
    params, grads, exp_avgs, exp_avg_sqs = (list(x) for x in zip(*pieces))
    p32, p_flat, rounded = _fp32(params)   # fp32 masters are changed in place
    g32, _, _ = _fp32(grads)               # gradients are not changed
    if maximize:
        g32 = torch._foreach_neg(g32)
    m = _Moments(exp_avgs, m_book)
    v = _Moments(exp_avg_sqs, v_book)
    # p = p - lr * weight_decay * p
    torch._foreach_sub_(p32, torch._foreach_mul(p32, decay))
    torch._foreach_lerp_(m.values, g32, 1 - beta1)
    torch._foreach_lerp_(v.values, torch._foreach_mul(g32, g32), 1 - beta2)
    m.store()
    v.store()
    # denom = v.sqrt() / bias_correction2.sqrt() + eps
    denom = torch._foreach_sqrt(v.values)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    # p = p - lr * (m / bias_correction1) / denom
    delta = torch._foreach_div(m.values, bias_correction1)
    torch._foreach_mul_(delta, lr)
    torch._foreach_div_(delta, denom)
    torch._foreach_sub_(p32, delta)
    if rounded:   # bf16 compute copies: one draw for the run, in order
        new = stochastic_round_bf16(p_flat)
        torch._foreach_copy_([params[i] for i in rounded],
                             list(new.split([params[i].numel() for i in rounded])))
