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
as saved activations are freed; on CUDA the first step of a plan measures
them (see [Note: measured memory correction]).

The search tries every plan up to ``exhaustive_max_blocks`` blocks, else the
greedy candidates of :func:`_greedy_candidates`; the fastest that fits wins
(ties: fewest blocks moved, the earliest), else the smallest.

[Note: measured memory correction]
What the model leaves out grows where it does not look: parameter gradients
pile up in backward while early kept blocks wait for theirs; a rebuilt block
has its temporaries; autocast keeps the weights' casts of recomputed blocks
to the end of the forward (of kept blocks they are saved, so counted). So on
CUDA the first step of a plan reads the allocator's allocated bytes at the
hooks (a host read, no synchronize, peak statistics untouched) and keeps the
largest growth over the forward's start per point of the model: a block's
forward (its pre- to post-hook), the rest's (outside blocks), the rest's
backward (from the forward's end to the first block output's gradient) and
each block's (from its output's gradient on). ``step - modelled`` per point
is what the model missed there. On CPU nothing is read and nothing corrected.

Not all of it is the plan's: keep-all's own peak, at the start of backward,
holds the logits and the loss's gradients besides the saved activations. So
the budget bounds the step's peak less what keep-all holds there beyond its
saved activations (the bench's cap: ``peak(none) - saved + f x saved``). That
*baseline* is the excess at the rest's backward point of the same step: the
same ops on the same tensors whatever the plan (which blocks are kept is
modelled), so it stands for keep-all's. ``extra = max(0, excess - baseline)``
per point is what the plan holds beyond both (never below 0: the budget
still bounds saved bytes at every point). If the step's peak less the
baseline is over the budget, :func:`check_plan` plans once more with
``extra`` added to the model at every point and the budget lowered by a
margin, the larger of 1 % and the largest tensor a block saves: reads at
hooks miss what one autograd node allocates between them, and ``extra`` was
measured under the first plan's modes (a block recomputed now adds its own).

Not the profiling step's excess as the baseline: it offloads everything, and
what the device then holds depends on when copies end, which the model gets
wrong (the host blocks in the store, stretching the forward): for GPT-2 1.3B
at B=8 on an H200 the model puts all-offload at ~32 GiB of saved
activations; the bench's offload row peaked at 20 GiB. That excess is mostly
the copy timeline's error, not what a keep/recompute plan misses. Reads at
hooks also miss part of the loss's gradients in the rest's backward (GPT-2:
the log-softmax's input gradient, fp32 logits-sized, 1.5 GiB at B=8), which
lowers the baseline: where a plan peaks elsewhere the check errs by about
that towards planning again (less kept, never over the budget).
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class StepMemory:
    """Bytes at each point of the cost model: ``forward[i]`` at the end of
    block i's forward, ``backward[i]`` at the start of its backward (the last
    index is the rest; see [Note: activation cost model])."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]

    def peak(self) -> int:
        return max((*self.forward, *self.backward), default=0)

    def plus(self, other: "StepMemory") -> "StepMemory":
        return StepMemory(tuple(map(operator.add, self.forward, other.forward)),
                          tuple(map(operator.add, self.backward, other.backward)))


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


def memory_points(blocks: list[BlockProfile], modes: list[BlockMode], *, bandwidth: float,
                  overlap: bool, prefetch_bytes: int = 128 << 20) -> StepMemory:
    """Device bytes of saved activations at each point of the step (see
    [Note: activation cost model])."""
    spans, outs = _forward(blocks, modes, bandwidth, overlap)
    let_go = _let_go(spans, outs)
    resident = [b.saved if m is K else b.inputs if m is R else 0 for b, m in zip(blocks, modes)]
    forward, below = [], 0
    held: dict[int, float] = {}
    for i, b in enumerate(blocks):   # the end of each block's forward
        held = {j: t for j, t in held.items() if t > spans[i][0]}   # let go before it
        if i in let_go:
            held[i] = let_go[i]
        below += resident[i]
        forward.append(below + sum(blocks[j].saved for j in held))
    first = max((i for i, m in enumerate(modes) if m is O), default=-1)   # first unpack
    until_unpack = sum(blocks[j].saved for j, t in let_go.items() if t == math.inf)
    backward, below, ahead, largest = [], 0, 0, 0
    for i, (b, m) in enumerate(zip(blocks, modes)):   # the start of each block's backward
        extra = until_unpack if i > first else min(ahead, prefetch_bytes // 2 + largest)
        backward.append(below + b.saved + (b.inputs if m is R else 0) + extra)
        below += resident[i]
        if m is O:
            ahead += b.saved
            largest = max(largest, b.saved if b.largest is None else b.largest)
    return StepMemory(tuple(forward), tuple(backward))


def plan_memory(blocks: list[BlockProfile], modes: list[BlockMode], *, bandwidth: float,
                overlap: bool, prefetch_bytes: int = 128 << 20,
                extra: StepMemory | None = None) -> int:
    """Peak device bytes of saved activations (see [Note: activation cost
    model]), with ``extra`` bytes added at each point (see [Note: measured
    memory correction])."""
    points = memory_points(blocks, modes, bandwidth=bandwidth, overlap=overlap,
                           prefetch_bytes=prefetch_bytes)
    return (points if extra is None else points.plus(extra)).peak()


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
                exhaustive_max_blocks: int = 8, extra: StepMemory | None = None) -> Plan:
    """The fastest keep/offload/recompute choice per block within ``budget``
    bytes of saved activations (see [Note: activation cost model]);
    ``prefetch_bytes`` is the store's; ``extra``: measured bytes the model
    misses, per point (see :func:`check_plan`). Up to ``exhaustive_max_blocks``
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
                                       prefetch_bytes=prefetch_bytes, extra=extra),
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


@dataclass(frozen=True)
class MemoryCheck:
    """The first step of a plan against the model (see [Note: measured memory
    correction]); bytes are growth over the forward's start."""

    ran: Plan            # the plan the step ran
    step: StepMemory     # what the step held at each point (measured)
    baseline: int        # what it held beyond the model at the rest's backward
    extra: StepMemory    # per point, beyond the model and the baseline (>= 0)
    plan: Plan | None    # the plan made again, or None: the step kept within the
                         # budget, or no plan fits even with what was measured

    @property
    def predicted(self) -> int:
        """The modelled peak of the plan the step ran."""
        return self.ran.memory

    @property
    def measured(self) -> int:
        """The step's peak less the baseline: comparable to ``predicted`` and the budget."""
        return self.step.peak() - self.baseline


def check_plan(blocks: list[BlockProfile], plan: Plan, step: StepMemory, *, budget: int,
               bandwidth: float, overlap: bool, backward_factor: float = 2.0,
               prefetch_bytes: int = 128 << 20, exhaustive_max_blocks: int = 8) -> MemoryCheck:
    """Compare the bytes a step of ``plan`` held at each point (``step``)
    with the model, and plan again once if its peak, less keep-all's overhead,
    went over ``budget`` (see [Note: measured memory correction]). The other
    arguments are :func:`choose_plan`'s.

    Example: keep-all fits the model; the step held 10 bytes more at the
    rest's backward (the loss's gradients: the baseline), 40 more at block 1's
    backward and 50 at block 0's (parameter gradients). Block 1's point went
    over by 10, so the plan is made again, with those bytes counted:
        >>> b = [BlockProfile("h.0", saved=100, inputs=10, forward_s=0.01, largest=5),
        ...      BlockProfile("h.1", saved=100, inputs=10, forward_s=0.01, largest=5),
        ...      BlockProfile("rest", saved=20, recomputable=False)]
        >>> plan = choose_plan(b, budget=230, bandwidth=1e3, overlap=False)
        >>> [m.value for m in plan.modes], plan.memory
        (['keep', 'keep', 'keep'], 220)
        >>> step = StepMemory(forward=(100, 200, 225), backward=(160, 250, 230))
        >>> check = check_plan(b, plan, step, budget=230, bandwidth=1e3, overlap=False)
        >>> check.baseline, check.measured, check.extra.backward
        (10, 240, (50, 40, 0))
        >>> [m.value for m in check.plan.modes], check.plan.memory
        (['recompute', 'keep', 'keep'], 160)
    """
    modelled = memory_points(blocks, list(plan.modes), bandwidth=bandwidth, overlap=overlap,
                             prefetch_bytes=prefetch_bytes)
    baseline = step.backward[-1] - modelled.backward[-1]

    def beyond(got: tuple[int, ...], model: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(max(0, g - m - baseline) for g, m in zip(got, model))

    extra = StepMemory(beyond(step.forward, modelled.forward),
                       beyond(step.backward, modelled.backward))
    check = MemoryCheck(plan, step, baseline, extra, None)
    if check.measured <= budget:
        return check
    largest = max((b.saved if b.largest is None else b.largest
                   for b in blocks if b.recomputable), default=0)
    again = choose_plan(blocks, budget=max(0, budget - max(budget // 100, largest)),
                        bandwidth=bandwidth, overlap=overlap, backward_factor=backward_factor,
                        prefetch_bytes=prefetch_bytes,
                        exhaustive_max_blocks=exhaustive_max_blocks, extra=extra)
    # Nothing fits: the plan that ran stays. The model's "smallest" plan would
    # be one nobody measured (on the H200 its offloads held more than
    # recompute-all, and ran slower).
    return replace(check, plan=again if again.fits else None)


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
