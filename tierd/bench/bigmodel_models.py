"""The models of ``tierd.bench.bigmodel``: Llama shapes by name, their sizes and FLOPs.

Names: ``8B`` (Llama-3-8B's shape), ``13B`` (Llama-2-13B's), ``tiny`` (the CPU
smoke run), and ``L<n>``: the 8B shape with ``n`` decoder layers (the largest-
model ladder; each layer is 218M parameters), ``tiny-L<n>`` the same at the
tiny width. Sizes and FLOPs are computed from the shape, so a row that failed
before building anything still says what it tried.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A Llama decoder's shape (what ``LlamaConfig`` takes)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def __post_init__(self) -> None:
        for f in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 1")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads="
                             f"{self.kv_heads}: heads must divide hidden and kv_heads heads")

    @property
    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: embedding, layers, final norm and the untied LM head."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

    def flops_per_token(self, seq: int) -> int:
        """Model FLOPs of one trained token (forward and backward, recompute not
        counted): 6 per matmul parameter (every parameter but the input
        embedding, a lookup) plus 12 * layers * hidden * seq for attention's
        score and value products (``tflops`` in :mod:`tierd.bench.bigmodel`)."""
        matmul = self.params - self.vocab * self.hidden
        return 6 * matmul + 12 * self.layers * self.hidden * seq


BASES = {
    "8B": Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
    "13B": Shape(hidden=5120, intermediate=13824, layers=40, heads=40, kv_heads=40, vocab=32000),
    "tiny": Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256),
}
_LADDER = re.compile(r"^(?:(tiny|13B)-)?L([1-9][0-9]*)$")


def shape_of(name: str) -> Shape:
    """The shape a model name stands for.

    >>> shape_of("L80").layers, shape_of("L80").hidden
    (80, 4096)
    >>> shape_of("13B-L8").layers, shape_of("13B-L8").hidden   # a 13B's compute reference
    (8, 5120)
    """
    if name in BASES:
        return BASES[name]
    m = _LADDER.match(name)
    if m is None:
        raise ValueError(f"unknown model {name!r}; use one of {sorted(BASES)}, L<layers> "
                         "(the 8B shape with that many layers), 13B-L<layers> or tiny-L<layers>")
    return replace(BASES[m.group(1) or "8B"], layers=int(m.group(2)))


def rung_name(layers: int, tiny: bool) -> str:
    """The ladder's model name for ``layers`` layers (at the tiny width if ``tiny``)."""
    return f"{'tiny-' if tiny else ''}L{layers}"


def llama_config(shape: Shape, seq: int):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                       tie_word_embeddings=False, max_position_embeddings=max(seq, 4096),
                       use_cache=False, attn_implementation="sdpa")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules in ``dtype`` (what ``from_pretrained(torch_dtype=)`` does),
    so a bf16 model never exists in fp32 first."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpointed(model, on: bool = True):
    """Activation checkpointing on, as every system of the benchmark runs it
    by default (``on=False``: off, ``--checkpointing off``); the model in train mode."""
    if not on:
        return model.train()
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def build(shape: Shape, seq: int, device: torch.device | str, dtype: torch.dtype,
          checkpointing: bool = True):
    """A randomly initialised ``LlamaForCausalLM`` of ``shape``, built on ``device``."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(llama_config(shape, seq))
    return checkpointed(model, checkpointing)


def build_meta(shape: Shape, seq: int, checkpointing: bool = True):
    """The model on the meta device (no memory), fp32: FSDP2's starting point."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape, seq))
    return checkpointed(model, checkpointing)


@torch.no_grad()
def init_materialised(model, device: torch.device) -> None:
    """Give a model materialised from meta (``to_empty``) Llama's initial values:
    normal(0, initializer_range) for matrices and embeddings, 1 for norms; and
    its rotary buffers, rebuilt on ``device`` (the values ``to_empty`` left are
    garbage). Works on DTensor parameters through their local shards. Values
    for parameters elsewhere are drawn on ``device`` and copied in: CPU
    sampling of 8B values takes about a minute, a GPU's well under a second."""
    std = model.config.initializer_range
    torch.manual_seed(0)
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if param.ndim == 1:
            local.fill_(1.0)   # RMSNorm weights (Llama has no biases)
        elif local.device == device:
            local.normal_(0.0, std)
        else:
            local.copy_(torch.empty(local.shape, dtype=local.dtype, device=device)
                        .normal_(0.0, std))
    rotary = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=model.config)
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                raise RuntimeError(f"buffer {key} of {type(module).__name__} is on "
                                   f"{buf.device}, not {device}: not rebuilt")
