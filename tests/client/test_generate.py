"""Generation (``model.generate``, KV cache, greedy) on an attached Hugging Face
Llama whose cap keeps some units on the device and streams the rest: the same
tokens and logits as the plain torch model, on the in-process store (CPU,
explicit ``gpu_memory_bytes``, fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.placement import Place
from tierd.client.placer import PlacerState
from tierd.client.store import LocalStore
from tests.client.models import batches, train

VOCAB = 100
NEW_TOKENS = 8


def llama(layers: int = 6) -> LlamaForCausalLM:
    """Enough blocks for a cap to keep some and stream others; no end-of-sequence
    token, so every generation runs its ``max_new_tokens``."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=128, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def lora(model):
    peft = pytest.importorskip("peft")
    # random adapter values (peft's default B = 0 would change nothing)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def prompt(batch: int = 1, length: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def greedy(model, ids: torch.Tensor, mask: torch.Tensor | None = None):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                          do_sample=False, use_cache=True, return_dict_in_generate=True,
                          output_logits=True)


def assert_same_generation(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits) == NEW_TOKENS
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


def cap_for_some(make) -> int:
    """Room for the weights of some units, not all: one unit's compute copy
    and fp32 state (the least cap attach takes), 2 % more."""
    probe = attach(make(), client=LocalStore(), device="cpu")
    units = session_of(probe).units
    cap = max(u.nbytes for u in units) * 4 * 51 // 50
    assert cap < sum(u.nbytes for u in units)
    detach(probe)
    return cap


def attached(ref, cap: int):
    return attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", gpu_memory_bytes=cap)


def test_greedy_generation_keeps_some_units_streams_the_rest_and_matches_torch():
    ref = llama().eval()
    model = attached(ref, cap_for_some(llama))
    want, got = greedy(ref, prompt()), greedy(model, prompt())
    assert_same_generation(got, want)
    session = session_of(model)
    placer = session.placer
    # the prompt's forward was measured; every token's forward ran on one plan
    assert session.stats()["steps"] == NEW_TOKENS
    assert placer.state is PlacerState.PLACED and placer.replans == 0
    streamed = set(placer.plan.units_at(Place.STREAM))
    assert streamed and placer.plan.units_at(Place.WEIGHTS)
    assert set(session.mover.planner.trace) == streamed   # only those move per token
    assert_same_generation(greedy(model, prompt()), want)   # again, on the same plan
    assert placer.replans == 0


def test_generation_after_fine_tuning_keeps_the_training_plan():
    ref = llama().train()
    model = attached(ref, cap_for_some(llama))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    data = batches(3, vocab=VOCAB)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    placer = session_of(model).placer
    plan = placer.plan.places
    ref.eval(), model.eval()
    assert_same_generation(greedy(model, prompt()), greedy(ref, prompt()))
    # forwards without autograd leave a training plan alone
    assert placer.plan.places == plan and placer.replans == 0
    model.train(), ref.train()
    more = batches(2, vocab=VOCAB, seed=5)
    assert train(model, opt, more) == train(ref, ref_opt, more)


def test_a_padded_batch_generates_as_torch_does():
    ref = llama().eval()
    model = attached(ref, cap_for_some(llama))
    ids = prompt(batch=2)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0   # left padding
    assert_same_generation(greedy(model, ids, mask), greedy(ref, ids, mask))


def test_generation_with_a_lora_adapter_matches_torch():
    ref = lora(llama()).eval()
    model = attached(ref, cap_for_some(lambda: lora(llama())))
    assert_same_generation(greedy(model, prompt()), greedy(ref, prompt()))


def test_generation_through_peft_begins_steps_and_places():
    ref = lora(llama()).eval()
    model = attached(ref, cap_for_some(lambda: lora(llama())))
    greedy(model, prompt())
    session = session_of(model)
    assert session.stats()["steps"] == NEW_TOKENS
    assert session.placer.state is PlacerState.PLACED
