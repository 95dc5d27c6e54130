"""The demo's training text: generated deterministically, nothing downloaded.

Sentences from a small grammar about tiers and tensors, drawn with a fixed
seed, so every run trains on the same bytes and a byte-level model can learn
the words and their order within a few steps.
"""

from __future__ import annotations

import random

import torch

_SUBJECTS = ["the daemon", "the pool", "a tensor", "the optimizer", "each job", "the planner",
             "the copy stream", "a gradient", "the NVMe file", "every parameter"]
_VERBS = ["moves", "keeps", "streams", "writes back", "prefetches", "evicts", "leases",
          "reads", "updates", "releases"]
_OBJECTS = ["the weights", "a slot", "the moments", "its bytes", "the next block",
            "a pinned segment", "the master copy", "the activations", "an extent", "the key"]
_PLACES = ["to the GPU", "into the pool", "onto NVMe", "before it is used", "after its last use",
           "on the copy stream", "in the first step", "without a round trip"]


def generate(n_bytes: int = 200_000, seed: int = 0) -> str:
    """About ``n_bytes`` of text; the same for the same arguments.

    >>> generate(60, seed=1) == generate(60, seed=1)
    True
    """
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        sentence = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                    f"{rng.choice(_PLACES)}.")
        sentence = sentence[0].upper() + sentence[1:] + ("\n" if rng.random() < 0.2 else " ")
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


class Batches:
    """Random windows of the byte-encoded text: ``(inputs, targets)`` shifted by one."""

    def __init__(self, text: str, batch_size: int, seq_len: int, seed: int = 0) -> None:
        self.data = torch.tensor(list(text.encode()), dtype=torch.long)
        if len(self.data) <= seq_len + 1:
            raise ValueError(f"text of {len(self.data)} bytes is too short for --seq-len {seq_len}")
        self.batch_size, self.seq_len = batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        window = torch.stack([self.data[s:s + self.seq_len + 1] for s in starts])
        return window[:, :-1], window[:, 1:]
