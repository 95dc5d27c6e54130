"""The ``auto`` activation policy's plan: keep, offload or recompute per block.

Plain code, no torch: the measurements of the first step go in, a plan comes out.

[Note: activation cost model]
Per block i the first step measured ``saved`` (bytes autograd saved inside it),
``inputs`` (bytes of its tensor inputs: what checkpointing keeps) and
``forward_s`` (its forward compute time); the copy bandwidth ``bandwidth``
(bytes/s) was measured on the copy stream. Choices:

- keep: costs ``saved`` bytes of device memory, no time;
- recompute: costs ``inputs`` bytes, and ``forward_s`` more time (the forward
  runs again in backward);
- offload: costs no lasting memory; its bytes cross the bus twice. With
  ``overlap`` (CUDA: a copy stream beside the compute stream) the copies out
  hide behind the forward and the copies in behind the backward
  (``backward_factor`` x the forward), so only the excess costs time; without
  it (CPU) every copy costs its full time.

A block that is not kept is rebuilt whole in backward, one at a time, so the
largest such block's ``saved`` is counted once on top (transient). The search
tries k = 0..n recomputed blocks (best bytes-per-second first); for each, it
offloads the fewest bytes that make the rest fit, earliest blocks first (they
are needed last in backward, so their copies have the most time to come back);
the fastest plan that fits wins, ties going to fewer recomputes.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class BlockMode(enum.Enum):
    """What happens to the tensors autograd saves inside a block."""

    KEEP = "keep"            # stay where they are (device memory)
    OFFLOAD = "offload"      # copied to the pool, brought back in backward
    RECOMPUTE = "recompute"  # not saved: the block's forward reruns in backward


@dataclass(frozen=True)
class BlockProfile:
    """First-step measurements of one block (or of everything outside blocks)."""

    name: str
    saved: int                # bytes saved inside it
    inputs: int = 0           # bytes of its tensor inputs (kept by recompute)
    forward_s: float = 0.0    # forward compute seconds
    recomputable: bool = True


@dataclass(frozen=True)
class Plan:
    modes: tuple[BlockMode, ...]
    memory: int          # estimated device bytes of saved activations
    extra_s: float       # estimated seconds added to the step
    fits: bool

    def describe(self, blocks: list[BlockProfile], budget: int | None) -> str:
        runs: list[str] = []
        start = 0
        for i in range(1, len(self.modes) + 1):
            if i == len(self.modes) or self.modes[i] is not self.modes[start] \
                    or blocks[i].recomputable != blocks[start].recomputable:
                names = blocks[start].name if i - start == 1 else \
                    f"{blocks[start].name}..{blocks[i - 1].name}"
                runs.append(f"{names}: {self.modes[start].value}")
                start = i
        fit = "" if self.fits else " (does NOT fit: smallest plan chosen)"
        limit = "none" if budget is None else f"{budget / 2**20:.1f} MiB"
        return (f"tierd activations plan, budget {limit}{fit}: " + ", ".join(runs)
                + f"; ~{self.memory / 2**20:.1f} MiB kept, ~{self.extra_s * 1e3:.1f} ms added")


def plan_memory(blocks: list[BlockProfile], modes: list[BlockMode]) -> int:
    kept = sum(b.saved for b, m in zip(blocks, modes) if m is BlockMode.KEEP)
    inputs = sum(b.inputs for b, m in zip(blocks, modes) if m is BlockMode.RECOMPUTE)
    transient = max((b.saved for b, m in zip(blocks, modes) if m is not BlockMode.KEEP),
                    default=0)
    return kept + inputs + transient


def plan_seconds(blocks: list[BlockProfile], modes: list[BlockMode], bandwidth: float,
                 *, overlap: bool, backward_factor: float = 2.0) -> float:
    recompute = sum(b.forward_s for b, m in zip(blocks, modes) if m is BlockMode.RECOMPUTE)
    moved = sum(b.saved for b, m in zip(blocks, modes) if m is BlockMode.OFFLOAD)
    one_way = moved / bandwidth if bandwidth > 0 else (float("inf") if moved else 0.0)
    if not overlap:
        return recompute + 2 * one_way
    forward = sum(b.forward_s for b in blocks)
    return recompute + max(0.0, one_way - forward) + \
        max(0.0, one_way - backward_factor * forward)


def _offload_to_fit(blocks: list[BlockProfile], modes: list[BlockMode],
                    budget: int) -> None:
    """Offload kept blocks until the plan fits (or none is left), in place."""
    while plan_memory(blocks, modes) > budget:
        kept = [i for i, m in enumerate(modes) if m is BlockMode.KEEP and blocks[i].saved > 0]
        if not kept:
            return
        need = plan_memory(blocks, modes) - budget
        enough = [i for i in kept if blocks[i].saved >= need]
        # the smallest block that closes the gap, else the largest; earliest on ties
        pick = min(enough, key=lambda i: (blocks[i].saved, i)) if enough else \
            min(kept, key=lambda i: (-blocks[i].saved, i))
        modes[pick] = BlockMode.OFFLOAD


def choose_plan(blocks: list[BlockProfile], *, budget: int | None, bandwidth: float,
                overlap: bool, backward_factor: float = 2.0,
                exhaustive_max_blocks: int = 8) -> Plan:
    """The fastest keep/offload/recompute choice per block within ``budget``
    bytes of saved activations (see [Note: activation cost model]). Up to
    ``exhaustive_max_blocks`` blocks every choice is tried (the best plan);
    beyond, a greedy search (fits whenever any plan fits, not always the best).

    Example:
        >>> b = [BlockProfile("h.0", saved=100, inputs=10, forward_s=0.01),
        ...      BlockProfile("h.1", saved=100, inputs=10, forward_s=0.01)]
        >>> [m.value for m in choose_plan(b, budget=None, bandwidth=1e3, overlap=False).modes]
        ['keep', 'keep']
        >>> [m.value for m in choose_plan(b, budget=150, bandwidth=1e9, overlap=False).modes]
        ['offload', 'offload']
    """
    def seconds(modes: list[BlockMode]) -> float:
        return plan_seconds(blocks, modes, bandwidth, overlap=overlap,
                            backward_factor=backward_factor)

    keep_all = [BlockMode.KEEP] * len(blocks)
    if budget is None or plan_memory(blocks, keep_all) <= budget:
        return Plan(tuple(keep_all), plan_memory(blocks, keep_all), 0.0, True)
    if len(blocks) <= exhaustive_max_blocks:
        return _best_of_all(blocks, budget, seconds)
    order = sorted((i for i, b in enumerate(blocks) if b.recomputable),
                   key=lambda i: (-(blocks[i].saved - blocks[i].inputs)
                                  / max(blocks[i].forward_s, 1e-9), i))
    best: tuple[float, int, list[BlockMode]] | None = None
    smallest: tuple[int, float, list[BlockMode]] | None = None
    for k in range(len(order) + 1):
        modes = list(keep_all)
        for i in order[:k]:
            modes[i] = BlockMode.RECOMPUTE
        _offload_to_fit(blocks, modes, budget)
        mem, secs = plan_memory(blocks, modes), seconds(modes)
        if mem <= budget and (best is None or secs < best[0] - 1e-12):
            best = (secs, k, modes)
        if smallest is None or (mem, secs) < smallest[:2]:
            smallest = (mem, secs, modes)
    if best is not None:
        return Plan(tuple(best[2]), plan_memory(blocks, best[2]), best[0], True)
    mem, secs, modes = smallest
    return Plan(tuple(modes), mem, secs, False)


def _best_of_all(blocks: list[BlockProfile], budget: int, seconds) -> Plan:
    """Every keep/offload/recompute combination; the fastest that fits, else
    the smallest."""
    choices = [(BlockMode.KEEP, BlockMode.OFFLOAD)
               + ((BlockMode.RECOMPUTE,) if b.recomputable else ()) for b in blocks]
    def rank(secs: float, modes: list[BlockMode]) -> tuple:
        # ties: fewest blocks moved, and the earliest ones (their activations
        # are needed last in backward, so they have the longest to come back)
        moved = [i for i, m in enumerate(modes) if m is not BlockMode.KEEP]
        return round(secs, 12), len(moved), moved

    best: tuple[tuple, int, float, list[BlockMode]] | None = None
    smallest: tuple[int, float, list[BlockMode]] | None = None
    for combo in itertools.product(*choices):
        modes = list(combo)
        mem, secs = plan_memory(blocks, modes), seconds(modes)
        if mem <= budget and (best is None or rank(secs, modes) < best[0]):
            best = (rank(secs, modes), mem, secs, modes)
        if smallest is None or (mem, secs) < smallest[:2]:
            smallest = (mem, secs, modes)
    if best is not None:
        return Plan(tuple(best[3]), best[1], best[2], True)
    mem, secs, modes = smallest
    return Plan(tuple(modes), mem, secs, False)
