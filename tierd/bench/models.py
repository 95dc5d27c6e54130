"""The benchmark models (random weights from a transformers config) and steps."""

from __future__ import annotations

import time

from types import SimpleNamespace

import torch
from torch import nn

#: name -> GPT2Config fields. "gpt2-1.3b" is the model the project's figures use.
MODELS = {
    "gpt2-1.3b": dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257),
    "gpt2-124m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
    "tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000),
    "torch-tiny": dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000),
}


class Block(nn.Module):
    """Pre-norm attention + MLP; every Linear is called as a module (so hooks see it)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A GPT-shaped model in plain torch (no transformers import: CPU smoke runs
    start faster); ``model(input_ids=, labels=).loss`` like a Hugging Face LM."""

    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab_size: int) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab_size, n_embd)
        self.transformer.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.transformer.wte(input_ids)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                               labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def build(name: str, seq: int, device: torch.device):
    """A GPT2LMHeadModel with random weights, fp32, in train mode, on ``device``."""
    torch.manual_seed(0)
    if name == "torch-tiny":
        with torch.device(device):
            return TinyLM(**MODELS[name]).train()
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(**MODELS[name], n_positions=max(seq, 64), resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    return model.train()


def describe(name: str) -> str:
    m = MODELS[name]
    kind = "plain-torch GPT-like LM" if name == "torch-tiny" else f"GPT-2 {name}"
    return f"{kind} ({m['n_layer']} layers, d={m['n_embd']}, {m['n_head']} heads)"


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def batch(name: str, b: int, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(b)
    return torch.randint(0, MODELS[name]["vocab_size"], (b, seq), generator=g).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, ids, device) -> float:
    """Seconds for one forward + backward + optimizer step (device synchronized)."""
    sync(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def forward_step(model, ids, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        model(input_ids=ids)
    sync(device)
    return time.perf_counter() - t0
