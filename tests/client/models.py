"""Tiny Hugging Face models built from configs (random weights, no download)
and a training loop shared by the attach and optim tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 100


def gpt2(*, n_layer: int = 2, n_embd: int = 64, vocab: int = VOCAB, tie: bool = True,
         seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab,
                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).train()


def llama(*, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).train()


def batches(n: int, *, batch: int = 2, seq: int = 12, vocab: int = VOCAB, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def train(model, opt, data, *, accumulate: int = 1, clip: float | None = None) -> list[float]:
    """``len(data) // accumulate`` optimizer steps; returns every micro-batch loss.
    ``clip`` clips with torch (for the reference; tierd clips inside its optimizer)."""
    losses = []
    for i, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss / accumulate
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses


def assert_same_weights(model, ref, *, atol: float = 0.0) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        if atol == 0.0:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, atol=atol, rtol=atol, msg=name)
