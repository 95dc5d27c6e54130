"""The ``auto`` policy: profile one step, plan, check the plan's first step.

:class:`AutoPlanner` owns the policy's stage (:class:`AutoStage`), what the
profiling step measured and the plan; the hooks in :mod:`.tiering` feed it
and ask it which mode each block runs in. The plan itself is plain code
(:mod:`.plan`).
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable

import torch

from tierd.client.activations.config import ActivationConfig
from tierd.client.activations.plan import (BlockMode, BlockProfile, MemoryCheck, Plan,
                                           StepMemory, check_plan, choose_plan)
from tierd.client.copy_stream import CopyStream
from tierd.client.keys import activation_prefix
from tierd.client.store import Store
from tierd.client.torch_internals import storage_id, tree_flatten
from tierd.errors import StateError

log = logging.getLogger("tierd.activations")


class AutoStage(enum.Enum):
    """Where the ``auto`` policy is; every other policy is DONE from the start.

    PROFILE -make_plan-> CHECK (CUDA with a budget) or DONE; CHECK -check_plan-> DONE.
    """

    PROFILE = "profile"   # this step offloads every block and measures them
    CHECK = "check"       # this step runs the plan; device memory is read at the hooks
    DONE = "done"         # the plan stays


def _tensor_bytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(values)[0]
               if isinstance(t, torch.Tensor))


class _BlockTimer:
    """Forward compute time of one block in the profiling step.

    The profiling step offloads, and the host may block inside the store
    (reserving pool chunks, waiting for copies); meanwhile the device idles
    and that idle time is inside the block's span. So the host time spent
    in the store during the block is taken off the span, on CUDA as on CPU
    (where the copies themselves run on the host). Counting a wait the device
    did not idle through errs towards a short forward, which makes offload
    look costlier (its copies hide behind less compute), never cheaper.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.spans: list[Any] = []

    def start(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, begun: Any, stalled: float) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((begun, end, stalled))
        else:
            self.spans.append(max(0.0, time.perf_counter() - begun - stalled))

    def seconds(self) -> float:
        if self._cuda:
            return sum(max(0.0, a.elapsed_time(b) / 1e3 - stalled)
                       for a, b, stalled in self.spans)
        return sum(self.spans)


class _Profile:
    """What the profiling step saw of one block."""

    def __init__(self, device: torch.device) -> None:
        self.timer = _BlockTimer(device)
        self.saved = 0
        self.inputs = 0
        self.largest = 0
        self._seen: set[tuple[int, int]] = set()
        self._begun: Any = None
        self._store0 = 0.0

    def begin(self, args: Any, kwargs: dict, store_seconds: float) -> None:
        self.inputs = max(self.inputs, _tensor_bytes((args, kwargs)))
        self._store0 = store_seconds
        self._begun = self.timer.start()

    def end(self, store_seconds: float) -> None:
        if self._begun is not None:
            self.timer.stop(self._begun, store_seconds - self._store0)
            self._begun = None

    def saved_bytes(self, t: torch.Tensor, nbytes: int) -> None:
        key = (storage_id(t), t.storage_offset())
        if key not in self._seen:   # a tensor saved twice counts once
            self._seen.add(key)
            self.saved += nbytes
            self.largest = max(self.largest, nbytes)

    def profile(self, name: str, recomputable: bool) -> BlockProfile:
        return BlockProfile(name, self.saved, self.inputs, self.timer.seconds(), recomputable,
                            largest=self.largest)


class _StepMeter:
    """The largest growth of allocated device bytes over a forward's start,
    per point of the cost model, through one step (see [Note: measured memory
    correction] in :mod:`.plan`). Hooks move it from point to point
    and read at the events they see (saves, unpacks, block boundaries)."""

    def __init__(self, read: Callable[[], int], blocks: int) -> None:
        self._read, self._rest = read, blocks
        self._base: int | None = None

    def start(self) -> None:
        """A root forward begins: what an earlier one read is dropped."""
        self._base = self._read()
        self._forward = [-1] * (self._rest + 1)
        self._backward = [-1] * (self._rest + 1)
        self._at = (self._forward, self._rest)   # outside blocks: the rest

    def sample(self) -> None:
        if self._base is not None:
            points, i = self._at
            points[i] = max(points[i], self._read() - self._base)

    def move(self, backward: bool, index: int) -> None:
        """Read for the point being left, then count reads for block ``index``'s
        forward or backward (``index`` = the number of blocks: the rest)."""
        self.sample()
        if self._base is not None:
            self._at = (self._backward if backward else self._forward, index)

    def result(self) -> StepMemory | None:
        """The figures; None if no forward began since, or its backward did not."""
        if self._base is None or self._backward[-1] < 0:
            return None
        return StepMemory(tuple(max(0, b) for b in self._forward),
                          tuple(max(0, b) for b in self._backward))


def _allocated_reader(device: torch.device) -> Callable[[], int] | None:
    """Reads the allocator's allocated bytes on ``device``; None off CUDA."""
    if device.type != "cuda":
        return None
    # not memory_allocated(): it flattens and sorts every statistic at each read
    return lambda: torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"][
        "current"]


def measure_bandwidth(client: Store, copy: CopyStream, nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of a device <-> pool round trip on the copy stream (best of
    ``repeats``), through one reserved, then aborted, pool slot."""
    key = f"{activation_prefix()}/bandwidth-probe"
    like = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    view = client.reserve_async({key: like}).result()[0].tensor
    try:
        src = torch.ones(nbytes, dtype=torch.uint8, device=copy.device)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = copy.copy_out(view, src, (key,))
            out.synchronize()
            back = copy.copy_in_many([(dst, view)], (key,))
            back.synchronize()
            best = min(best, (time.perf_counter() - t0) / 2)
        return nbytes / max(best, 1e-9)
    finally:
        client.abort([key])


class AutoPlanner:
    """The ``auto`` policy of one model: its stage, what was measured, the plan.

    ``stage`` changes only in :meth:`make_plan` (PROFILE to CHECK, or to
    DONE where nothing can be checked: off CUDA or without a budget) and
    :meth:`check_plan` (CHECK to DONE).

    Example:
        >>> a = AutoPlanner(ActivationConfig(policy="auto"), torch.device("cpu"), blocks=2,
        ...                 overlap=False, prefetch_bytes=0)
        >>> a.stage
        <AutoStage.PROFILE: 'profile'>
    """

    def __init__(self, config: ActivationConfig, device: torch.device, *, blocks: int,
                 overlap: bool, prefetch_bytes: int) -> None:
        self.config, self._overlap, self._prefetch = config, overlap, prefetch_bytes
        self.stage = AutoStage.PROFILE if config.policy == "auto" else AutoStage.DONE
        self.plan: Plan | None = None
        self.profiles: list[BlockProfile] | None = None
        self.bandwidth: float | None = None
        #: The plan's first step against the model (CUDA, ``auto`` with a budget).
        self.check: MemoryCheck | None = None
        #: Reads device memory at the hooks while CHECK; None otherwise.
        self.meter: _StepMeter | None = None
        self._read_allocated = _allocated_reader(device)
        self._blocks = blocks
        self._prof = [_Profile(device) for _ in range(blocks + 1)]

    @property
    def profiling(self) -> bool:
        return self.stage is AutoStage.PROFILE

    def _expect(self, transition: str, stage: AutoStage) -> None:
        if self.stage is not stage:
            raise StateError(f"the auto activation policy is at stage {self.stage.value}: "
                             f"it cannot {transition} (only at {stage.value})")

    # ---------------------------------------------- measurements (PROFILE)
    def block_begun(self, index: int, args: Any, kwargs: dict, store_seconds: float) -> None:
        self._prof[index].begin(args, kwargs, store_seconds)

    def block_ended(self, index: int, store_seconds: float) -> None:
        self._prof[index].end(store_seconds)

    def saved(self, index: int, t: torch.Tensor, nbytes: int) -> None:
        self._prof[index].saved_bytes(t, nbytes)

    # ------------------------------------------------------- transitions
    def make_plan(self, bandwidth: float) -> Plan:
        """PROFILE ends (its backward did; on CUDA the device has synchronized):
        choose the plan from what the step measured and ``bandwidth``."""
        self._expect("make a plan", AutoStage.PROFILE)
        profiles = [p.profile(f"{i}", True) for i, p in enumerate(self._prof[:-1])]
        profiles.append(self._prof[-1].profile("rest", False))
        budget = self.config.budget_bytes
        plan = choose_plan(profiles, budget=budget, bandwidth=bandwidth,
                           overlap=self._overlap, prefetch_bytes=self._prefetch)
        self.profiles, self.bandwidth, self.plan = profiles, bandwidth, plan
        if self._read_allocated is not None and budget is not None:
            self.stage = AutoStage.CHECK
            self.meter = _StepMeter(self._read_allocated, self._blocks)
        else:
            self.stage = AutoStage.DONE
        if self.config.verbose:
            log.info("%s (copy %.1f GB/s)", plan.describe(profiles, budget), bandwidth / 1e9)
        return plan

    def check_plan(self) -> Plan | None:
        """The plan's first step ended: the plan made again if that step went
        over the budget, else None (the plan stays). Stays at CHECK if the
        backward that ended was of a graph from before the plan."""
        self._expect("check its plan", AutoStage.CHECK)
        measured = self.meter.result()
        if measured is None:
            return None
        self.stage, self.meter = AutoStage.DONE, None
        budget = self.config.budget_bytes
        self.check = check_plan(self.profiles, self.plan, measured, budget=budget,
                                bandwidth=self.bandwidth, overlap=self._overlap,
                                prefetch_bytes=self._prefetch)
        if self.check.plan is None:
            if self.check.measured > budget and self.config.verbose:
                log.warning("tierd activations: the plan's step held ~%.1f MiB beyond "
                            "keep-all's overhead, over the budget of %.1f MiB, and no plan "
                            "fits it: the plan stays (raise activation_budget_bytes)",
                            self.check.measured / 2**20, budget / 2**20)
            return None
        self.plan = self.check.plan
        if self.config.verbose:
            log.info("%s (made again: the first plan's step held ~%.1f MiB beyond keep-all's "
                     "overhead at peak, ~%.1f MiB planned)",
                     self.plan.describe(self.profiles, budget),
                     self.check.measured / 2**20, self.check.predicted / 2**20)
        return self.plan
