"""The ``auto`` activation policy's plan: keep, offload or recompute per block.

Plain code, no torch: the measurements of the first step go in, a plan comes out.

[Note: activation cost model]
Per block the first step measured ``saved`` (bytes autograd saved inside it),
``inputs`` (its tensor inputs: what checkpointing keeps), ``largest`` (its
largest saved tensor) and ``forward_s``; what runs outside the blocks is one
more profile, "rest", saved last (lm_head, loss) and not recomputable. The
copy bandwidth (bytes/s each way) was measured on the copy stream. A plan is
scored by replaying one step block by block, as the store runs it:

- forward, in block order. With ``overlap`` (CUDA: copies on their own
  streams) an offloaded block's copy out starts when its forward is done and
  the copy-out channel is free: it hides only behind the forward after it.
- backward, in reverse (the rest first). A block's backward takes
  ``backward_factor`` x its forward, plus its forward again if recomputed,
  and starts once its offloaded bytes are back. The store copies nothing back
  before the first unpack, which first waits for every copy out to end; from
  there copies in run back to back in backward order (taken as the host
  running ahead of the device, asking for them early). So the first
  offloaded block of backward waits for all of its bytes, later ones hide
  behind the backward between them, and the rest (last out, first in) costs
  twice its copy time.
- without ``overlap`` (CPU) every copy costs its full time.

A plan's cost is the replayed step less the all-keep step. Two things make
it err towards offload costing more: the host usually reaches the first
unpack before the device does (so that copy can start earlier than modelled),
and the rest's own compute is not measured (taken as none).

Its memory is the most device bytes of saved activations at the end of any
block's forward or the start of any block's backward: kept blocks' ``saved``
and recomputed blocks' ``inputs`` up to that block (in backward those after it
are freed), the block's own ``saved`` while its backward runs (kept, rebuilt
or copied back), and two things the store holds for offloaded blocks:

- copies out: the store lets go of a copy's source only when it next looks,
  at a later save or at the first unpack of backward. An offloaded block's
  bytes stay until a later offloaded block saves after its copy ended, else
  until backward reaches the first offloaded block (so the last offloaded
  block frees nothing).
- copies back ahead of use: after the first unpack, up to half its
  ``prefetch_bytes`` plus one tensor (it may overshoot by one) of the
  offloaded blocks still to come.

Not counted: gradients and the backward's workspace, which grow in backward
as saved activations are freed (the budget is for saved activations only).

The search tries every plan up to ``exhaustive_max_blocks`` blocks, else the
greedy candidates of :func:`_greedy_candidates`; the fastest that fits wins
(ties: fewest blocks moved, the earliest), else the smallest.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass
from typing import Callable


class BlockMode(enum.Enum):
    """What happens to the tensors autograd saves inside a block."""

    KEEP = "keep"            # stay where they are (device memory)
    OFFLOAD = "offload"      # copied to the pool, brought back in backward
    RECOMPUTE = "recompute"  # not saved: the block's forward reruns in backward


K, O, R = BlockMode.KEEP, BlockMode.OFFLOAD, BlockMode.RECOMPUTE   # short, for the sums below


@dataclass(frozen=True)
class BlockProfile:
    """First-step measurements of one block (or of everything outside blocks)."""

    name: str
    saved: int                # bytes saved inside it
    inputs: int = 0           # bytes of its tensor inputs (kept by recompute)
    forward_s: float = 0.0    # forward compute seconds
    recomputable: bool = True
    largest: int | None = None   # bytes of its largest saved tensor (None: ``saved``)


@dataclass(frozen=True)
class Plan:
    modes: tuple[BlockMode, ...]
    memory: int          # estimated peak device bytes of saved activations
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
                + f"; ~{self.memory / 2**20:.1f} MiB at peak, ~{self.extra_s * 1e3:.1f} ms added")


def _copy_s(nbytes: int, bandwidth: float) -> float:
    if nbytes == 0:
        return 0.0
    return nbytes / bandwidth if bandwidth > 0 else math.inf


def _forward(blocks: list[BlockProfile], modes: list[BlockMode], bandwidth: float,
             overlap: bool) -> tuple[list[tuple[float, float]], dict[int, float]]:
    """Each block's forward (start, end), and when each offloaded block's copy
    out ends (with ``overlap``; on CPU it is done inside the forward)."""
    spans, outs, t, free = [], {}, 0.0, 0.0
    for i, (b, m) in enumerate(zip(blocks, modes)):
        spans.append((t, t + b.forward_s))
        t += b.forward_s
        if m is O and overlap:
            free = max(free, t) + _copy_s(b.saved, bandwidth)
            outs[i] = free
    return spans, outs


def _let_go(spans: list[tuple[float, float]], outs: dict[int, float]) -> dict[int, float]:
    """When the store lets go of each copy out's source: at the first save (in
    a later offloaded block's forward) after the copy ended, else at the first
    unpack of backward (``inf``)."""
    moved = sorted(outs)
    times = {}
    for n, i in enumerate(moved):
        later = next((j for j in moved[n + 1:] if spans[j][1] >= outs[i]), None)
        times[i] = math.inf if later is None else max(outs[i], spans[later][0])
    return times


def plan_memory(blocks: list[BlockProfile], modes: list[BlockMode], *, bandwidth: float,
                overlap: bool, prefetch_bytes: int = 128 << 20) -> int:
    """Peak device bytes of saved activations (see [Note: activation cost model])."""
    spans, outs = _forward(blocks, modes, bandwidth, overlap)
    let_go = _let_go(spans, outs)
    resident = [b.saved if m is K else b.inputs if m is R else 0 for b, m in zip(blocks, modes)]
    peak = below = 0
    held: dict[int, float] = {}
    for i, b in enumerate(blocks):   # the end of each block's forward
        held = {j: t for j, t in held.items() if t > spans[i][0]}   # let go before it
        if i in let_go:
            held[i] = let_go[i]
        below += resident[i]
        peak = max(peak, below + sum(blocks[j].saved for j in held))
    first = max((i for i, m in enumerate(modes) if m is O), default=-1)   # first unpack
    until_unpack = sum(blocks[j].saved for j, t in let_go.items() if t == math.inf)
    below = ahead = largest = 0
    for i, (b, m) in enumerate(zip(blocks, modes)):   # the start of each block's backward
        extra = until_unpack if i > first else min(ahead, prefetch_bytes // 2 + largest)
        peak = max(peak, below + b.saved + (b.inputs if m is R else 0) + extra)
        below += resident[i]
        if m is O:
            ahead += b.saved
            largest = max(largest, b.saved if b.largest is None else b.largest)
    return peak


def plan_seconds(blocks: list[BlockProfile], modes: list[BlockMode], *, bandwidth: float,
                 overlap: bool, backward_factor: float = 2.0) -> float:
    """Seconds the plan adds to the all-keep step (see [Note: activation cost model])."""
    recompute = sum(b.forward_s for b, m in zip(blocks, modes) if m is R)
    if not overlap:
        return recompute + sum(2 * _copy_s(b.saved, bandwidth)
                               for b, m in zip(blocks, modes) if m is O)
    spans, outs = _forward(blocks, modes, bandwidth, overlap)
    t = spans[-1][1] if spans else 0.0
    copy_in: float | None = None   # when the copy-in channel is next free
    waited = 0.0
    for i in reversed(range(len(blocks))):
        b = blocks[i]
        if modes[i] is O:
            start = max(t, max(outs.values())) if copy_in is None else copy_in
            copy_in = start + _copy_s(b.saved, bandwidth)
            if copy_in > t:
                waited, t = waited + copy_in - t, copy_in
        t += backward_factor * b.forward_s + (b.forward_s if modes[i] is R else 0.0)
    return recompute + waited


Score = Callable[[list[BlockMode]], tuple[int, float]]


def choose_plan(blocks: list[BlockProfile], *, budget: int | None, bandwidth: float,
                overlap: bool, backward_factor: float = 2.0, prefetch_bytes: int = 128 << 20,
                exhaustive_max_blocks: int = 8) -> Plan:
    """The fastest keep/offload/recompute choice per block within ``budget``
    bytes of saved activations (see [Note: activation cost model]);
    ``prefetch_bytes`` is the store's. Up to ``exhaustive_max_blocks``
    blocks every choice is tried (the best plan); beyond, a greedy search
    (see :func:`_greedy_candidates`; it may miss the best plan, or a plan that
    fits when only an odd mix would).

    Example:
        >>> b = [BlockProfile("h.0", saved=100, inputs=10, forward_s=0.01),
        ...      BlockProfile("h.1", saved=100, inputs=10, forward_s=0.01)]
        >>> [m.value for m in choose_plan(b, budget=None, bandwidth=1e3, overlap=False).modes]
        ['keep', 'keep']
        >>> [m.value for m in choose_plan(b, budget=150, bandwidth=1e9, overlap=False).modes]
        ['offload', 'keep']
    """
    scores: dict[tuple[BlockMode, ...], tuple[int, float]] = {}

    def score(modes: list[BlockMode]) -> tuple[int, float]:
        key = tuple(modes)
        if key not in scores:
            scores[key] = (plan_memory(blocks, modes, bandwidth=bandwidth, overlap=overlap,
                                       prefetch_bytes=prefetch_bytes),
                           plan_seconds(blocks, modes, bandwidth=bandwidth, overlap=overlap,
                                        backward_factor=backward_factor))
        return scores[key]

    keep_all = [K] * len(blocks)
    if budget is None or score(keep_all)[0] <= budget:
        return Plan(tuple(keep_all), score(keep_all)[0], 0.0, True)
    if len(blocks) <= exhaustive_max_blocks:
        choices = [(K, O, R) if b.recomputable else (K, O) for b in blocks]
        candidates = (list(c) for c in itertools.product(*choices))
    else:
        candidates = _greedy_candidates(blocks, budget, score)
    return _fastest(candidates, budget, score)


def _greedy_candidates(blocks: list[BlockProfile], budget: int, score: Score):
    """Recompute the k blocks that free the most bytes per second (or the k
    earliest: each rebuild then sits on the fewest kept bytes) and keep the
    rest; where that does not fit, also offload the fewest kept blocks,
    earliest first (their copies have the most compute to hide behind), that
    make it fit (a binary search: more offloaded, less memory, roughly)."""
    can = [i for i, b in enumerate(blocks) if b.recomputable]
    by_rate = sorted(can, key=lambda i: (-(blocks[i].saved - blocks[i].inputs)
                                         / max(blocks[i].forward_s, 1e-9), i))
    for order in (by_rate, can):
        for k in range(len(order) + 1):
            modes = [R if i in order[:k] else K for i in range(len(blocks))]
            yield modes
            kept = [i for i, m in enumerate(modes) if m is K and blocks[i].saved > 0]
            if score(modes)[0] <= budget or not kept:
                continue
            lo, hi = 1, len(kept)
            while lo < hi:
                mid = (lo + hi) // 2
                if score(_offload(modes, kept[:mid]))[0] <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            yield _offload(modes, kept[:lo])


def _offload(modes: list[BlockMode], which: list[int]) -> list[BlockMode]:
    return [O if i in which else m for i, m in enumerate(modes)]


def _fastest(candidates, budget: int, score: Score) -> Plan:
    """The fastest candidate that fits (ties: fewest blocks moved, then the
    earliest), else the smallest."""
    best: tuple | None = None
    smallest: tuple | None = None
    for modes in candidates:
        mem, secs = score(modes)
        if mem <= budget:
            moved = [i for i, m in enumerate(modes) if m is not K]
            rank = (round(secs, 12), len(moved), moved)
            if best is None or rank < best[0]:
                best = (rank, mem, secs, modes)
        if smallest is None or (mem, secs) < smallest[:2]:
            smallest = (mem, secs, modes)
    if best is not None:
        return Plan(tuple(best[3]), best[1], best[2], True)
    mem, secs, modes = smallest
    return Plan(tuple(modes), mem, secs, False)
