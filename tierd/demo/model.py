"""A GPT-2 in plain PyTorch (no transformers, no downloads) for the demo.

Byte-level: token ids are the bytes of UTF-8 text, so no tokenizer is needed.
The output head shares its weight with the token embedding, as in GPT-2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model; ``vocab_size`` must be at least 256 (bytes)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int = 256

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 256 (byte tokens)")


#: The demo's models. gpt2-1.3b is the benchmark model (GPT-2 XL-like, vocab
#: padded to 50304 as usual so its size matches); byte tokens use its first rows.
PRESETS = {
    "gpt2-small": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256),
    "gpt2-1.3b": GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=1024,
                           vocab_size=50304),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """``GPT(cfg)(ids, targets)`` returns ``(logits, loss)`` (loss None without targets).

    Example:
        >>> model = GPT(PRESETS["gpt2-small"])
        >>> logits, loss = model(torch.zeros(1, 8, dtype=torch.long))
        >>> tuple(logits.shape)
        (1, 8, 256)
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for block in self.blocks:   # GPT-2: scale residual projections by depth
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None):
        t = ids.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size={self.cfg.block_size}")
        x = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss
