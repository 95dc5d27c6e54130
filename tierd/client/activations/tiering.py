"""Activation tiering: what autograd saves in a model's forward goes to the pool.

``tier_activations(model, client, policy=...)`` installs, for every forward of
``model`` that records a graph, ``torch.autograd.graph.saved_tensors_hooks``
whose pack hook copies saved tensors of at least ``min_bytes`` into the job's
pool (:mod:`tierd.client.activations_store`: chunks, records, NVMe spill) and
whose unpack hook brings them back in backward, in reverse order, ahead of use.
Policies:

- ``"offload"``: every block's (and the rest's) saved tensors go to the pool;
- ``"recompute"``: each block runs under non-reentrant activation
  checkpointing (only its inputs are saved; the rest stays);
- ``"auto"``: the first step offloads and measures (bytes saved and forward
  time per block, copy bandwidth), then picks keep / offload / recompute per
  block to be fastest within ``budget_bytes`` (:mod:`activations_plan`) and
  prints the plan; on CUDA the plan's first step reads the device memory it
  takes at the hooks and, if that went over the budget, the plan is made once
  more counting what the model missed, and printed again (see [Note: measured
  memory correction] in :mod:`activations_plan`);
- ``None``: nothing is installed.

Blocks are the items of the model's largest ``nn.ModuleList`` (GPT-2's ``h``,
Llama's ``layers``) unless given. Tensors whose storage belongs to a
parameter or buffer (``nn.Parameter``, tierd's ``TieredParameter``: attach
moves those) and leaves that require grad are never copied: autograd keeps
its reference, as without tiering.

Example:
    >>> handle = tier_activations(model, tierd.connect(), policy="offload")  # doctest: +SKIP
    >>> model(**batch).loss.backward()                                          # doctest: +SKIP
    >>> handle.close()                                                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tierd.client.activations_plan import (BlockMode, BlockProfile, MemoryCheck, Plan,
                                           StepMemory, check_plan, choose_plan)
from tierd.client.activations_store import ActivationStore, SavedActivation
from tierd.client.copy_stream import CopyStream, register_pool

POLICIES = ("offload", "recompute", "auto", None)


@dataclass(frozen=True, kw_only=True)
class ActivationConfig:
    """How saved activations are tiered.

    Example:
        >>> ActivationConfig(policy="auto", budget_bytes=8 << 30).policy
        'auto'
    """

    #: "offload", "recompute", "auto" or None (see the module docstring).
    policy: str | None = "offload"
    #: Device bytes ``auto`` may leave saved activations in (None: no limit);
    #: on CUDA also what else its plan makes a step hold beyond keeping all
    #: (see [Note: measured memory correction] in :mod:`activations_plan`).
    budget_bytes: int | None = None
    #: Saved tensors smaller than this stay where they are.
    min_bytes: int = 1 << 20
    #: Size of the pool chunks saved tensors are packed into (at most an
    #: eighth of the pool is used, so the pool can spill and swap).
    chunk_bytes: int = 64 << 20
    #: Bytes of saved tensors brought back ahead of use in backward.
    prefetch_bytes: int = 128 << 20
    #: Print the ``auto`` plan when it is made.
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}; use one of {POLICIES}")
        for f in ("min_bytes", "chunk_bytes", "prefetch_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0")
        if self.chunk_bytes == 0:
            raise ValueError("chunk_bytes=0; give a chunk size such as 64 << 20")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be >= 0 or None")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The items of the largest ``nn.ModuleList`` (most items, then most
    parameters): the repeated blocks of a transformer."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))
    return list(best)


def _tensor_bytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(values)[0]
               if isinstance(t, torch.Tensor))


def _in_backward() -> bool:
    # A forward re-run by activation checkpointing runs inside a graph task.
    return torch._C._current_graph_task_id() != -1


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


class AutoStage(enum.Enum):
    """Where the ``auto`` policy is; every other policy is DONE from the start."""

    PROFILE = "profile"   # this step offloads every block and measures them
    CHECK = "check"       # this step runs the plan; device memory is read at the hooks
    DONE = "done"         # the plan stays


class _StepMeter:
    """The largest growth of allocated device bytes over a forward's start,
    per point of the cost model, through one step (see [Note: measured memory
    correction] in :mod:`activations_plan`). Hooks move it from point to point
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


class ActivationTiering:
    """The handle :func:`tier_activations` returns; :meth:`close` undoes it all."""

    def __init__(self, model: nn.Module, client, config: ActivationConfig, *,
                 blocks: list[nn.Module] | None = None,
                 device: torch.device | None = None) -> None:
        self.model, self.client, self.config = model, client, config
        self.device = device or _model_device(model)
        self.blocks = find_blocks(model) if blocks is None else list(blocks)
        self.plan: Plan | None = None
        self.profiles: list[BlockProfile] | None = None
        #: The plan's first step against the model (CUDA, ``auto`` with a budget).
        self.check: MemoryCheck | None = None
        self.copy = CopyStream(self.device)
        register_pool(client, self.device)
        pool = int(client.stats()["pool_bytes"])
        self.store = ActivationStore(
            client, self.copy, f"tierd-act/{uuid.uuid4().hex[:12]}",
            chunk_bytes=max(64 << 10, min(config.chunk_bytes, pool // 8)),
            prefetch_bytes=min(config.prefetch_bytes, pool // 4))
        self._probe_bytes = max(1 << 20, min(64 << 20, pool // 8))
        self.modes = self._initial_modes()
        self._lock = threading.RLock()
        self._handles: list[Any] = []
        self._stack: list[int] = []            # blocks whose forward runs now
        self._contexts: list[Any] = []         # entered saved_tensors_hooks (root depth)
        self._forwards: list[int] = []         # store tokens of running root forwards
        self._checkpoints: dict[int, list[Any]] = {}
        self._tasks: set[int] = set()
        self._keep_storages: set[int] = set()
        self.stage = AutoStage.PROFILE if config.policy == "auto" else AutoStage.DONE
        self._read_allocated = _allocated_reader(self.device)
        self._meter: _StepMeter | None = None    # while CHECK
        self._prof = [_Profile(self.device) for _ in range(len(self.blocks) + 1)]
        self._closed = False
        if config.policy is not None:
            self._install()
        self._finalizer = weakref.finalize(model, self.store.close)

    def _initial_modes(self) -> list[BlockMode]:
        """Mode per block, then one for everything outside blocks (last)."""
        n = len(self.blocks)
        match self.config.policy:
            case "recompute":
                return [BlockMode.RECOMPUTE] * n + [BlockMode.KEEP]
            case None:
                return [BlockMode.KEEP] * (n + 1)
            case _:   # offload, and the profiling step of auto
                return [BlockMode.OFFLOAD] * (n + 1)

    # ---------------------------------------------------------------- hooks
    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre))
        self._handles.append(self.model.register_forward_hook(self._root_post, always_call=True))
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(
                self._block_pre(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(
                self._block_post(i), always_call=True))

    def _root_pre(self, module: nn.Module, args: Any) -> None:
        if _in_backward() or not torch.is_grad_enabled():
            self._contexts.append(None)
            return
        self._keep_storages = {t.untyped_storage()._cdata for t in
                               [*self.model.parameters(), *self.model.buffers()]}
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._contexts.append(ctx)
        self._forwards.append(self.store.begin_forward())
        if self._meter is not None:
            self._meter.start()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:   # an earlier pre-hook raised before ours ran
            return
        ctx = self._contexts.pop()
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        forward = self._forwards.pop()
        if self._meter is not None:
            self._meter.move(True, len(self.blocks))
        if output is None and sys.exc_info()[0] is not None:
            self._stack.clear()
            self.store.abandon(forward)   # the step is abandoned: give its space back

    def _block_pre(self, index: int):
        def hook(module: nn.Module, args: Any, kwargs: dict) -> None:
            if _in_backward():
                if self._meter is not None:
                    self._meter.move(True, index)   # rebuilt for its backward
                return
            if not self._contexts or self._contexts[-1] is None:
                return
            self._stack.append(index)
            if self._meter is not None:
                self._meter.move(False, index)
            if self.stage is AutoStage.PROFILE:
                self._prof[index].begin(args, kwargs, self.store.stats.save_seconds)
            if self.modes[index] is BlockMode.RECOMPUTE and torch.is_grad_enabled():
                gen = torch.utils.checkpoint._checkpoint_without_reentrant_generator(
                    module, True, torch.utils.checkpoint.noop_context_fn, "default",
                    False, True, *args, **kwargs)
                next(gen)
                self._checkpoints.setdefault(index, []).append(gen)
        return hook

    def _block_post(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._stack or self._stack[-1] != index:
                if self._meter is not None and _in_backward():
                    self._meter.sample()   # rebuilt
                return
            gens = self._checkpoints.get(index)
            if gens:
                with contextlib.suppress(StopIteration):
                    next(gens.pop())
            self._stack.pop()
            if self.stage is AutoStage.PROFILE:
                self._prof[index].end(self.store.stats.save_seconds)
            if self._meter is not None:
                self._meter_block_end(index, output)
        return hook

    def _meter_block_end(self, index: int, output: Any) -> None:
        """Block ``index``'s forward ended; its backward begins once its
        output's gradient is complete (a tensor hook: blocks have no other)."""
        meter = self._meter
        meter.move(False, len(self.blocks))
        out = next((t for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None:
            out.register_hook(lambda grad: meter.move(True, index))

    def _pack(self, t: torch.Tensor) -> Any:
        block = self._stack[-1] if self._stack else len(self.blocks)
        nbytes = t.numel() * t.element_size()
        if self.stage is AutoStage.PROFILE and not self._is_model_state(t):
            self._prof[block].saved_bytes(t, nbytes)
        if self._meter is not None:
            self._meter.sample()
        if self.modes[block] is not BlockMode.OFFLOAD or not self._eligible(t, nbytes):
            # not ``t`` itself: a saved output that holds its own grad_fn is a
            # reference cycle autograd never frees (every step leaked those)
            return t.detach()
        with self._lock:
            return self.store.save(t)

    def _eligible(self, t: torch.Tensor, nbytes: int) -> bool:
        if nbytes < max(1, self.config.min_bytes) or t.device != self.device:
            return False
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False   # parameters (nn.Parameter subclasses), tensor subclasses
        if t.is_leaf and t.requires_grad:
            return False   # the caller owns it: copying would free nothing
        return not self._is_model_state(t)

    def _is_model_state(self, t: torch.Tensor) -> bool:
        """A parameter or buffer, or a view of one: attach moves those."""
        return isinstance(t, nn.Parameter) or t.untyped_storage()._cdata in self._keep_storages

    def _unpack(self, packed: Any) -> torch.Tensor:
        if self._meter is not None:
            self._meter.sample()
            with self._lock:
                self._watch_backward()   # its end ends the check, offloaded or not
        if not isinstance(packed, SavedActivation):
            return packed
        with self._lock:
            self._watch_backward()
            return self.store.load(packed)

    def _watch_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._tasks:
            self._tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_backward(task))

    def _end_backward(self, task: int) -> None:
        with self._lock:
            self._tasks.discard(task)
            if self._tasks:
                return   # a nested backward (reentrant checkpoint) ended
            self.store.end_backward()
            if self.stage is AutoStage.PROFILE:
                self._make_plan()
            elif self.stage is AutoStage.CHECK:
                self._check_plan()

    # ----------------------------------------------------------------- auto
    def _make_plan(self) -> None:
        if self.copy.on_device:
            torch.cuda.synchronize(self.device)
        self.profiles = [p.profile(f"{i}", True) for i, p in enumerate(self._prof[:-1])]
        self.profiles.append(self._prof[-1].profile("rest", False))
        bandwidth = measure_bandwidth(self.client, self.copy, self._probe_bytes)
        self.bandwidth = bandwidth
        self.plan = choose_plan(self.profiles, budget=self.config.budget_bytes,
                                bandwidth=bandwidth, overlap=self.copy.on_device,
                                prefetch_bytes=self.store.prefetch_bytes)
        self.modes = list(self.plan.modes)
        if self._read_allocated is not None and self.config.budget_bytes is not None:
            self.stage, self._meter = AutoStage.CHECK, _StepMeter(self._read_allocated,
                                                                  len(self.blocks))
        else:
            self.stage = AutoStage.DONE
        if self.config.verbose:
            print(self.plan.describe(self.profiles, self.config.budget_bytes)
                  + f" (copy {bandwidth / 1e9:.1f} GB/s)", file=sys.stderr)

    def _check_plan(self) -> None:
        """The plan's first step ended: plan again if it went over the budget."""
        measured = self._meter.result()
        if measured is None:   # a backward of a graph from before the plan
            return
        self.stage, self._meter = AutoStage.DONE, None
        budget = self.config.budget_bytes
        self.check = check_plan(self.profiles, self.plan, measured, budget=budget,
                                bandwidth=self.bandwidth, overlap=self.copy.on_device,
                                prefetch_bytes=self.store.prefetch_bytes)
        if self.check.plan is None:
            if self.check.measured > budget and self.config.verbose:
                print(f"tierd activations: the plan's step held "
                      f"~{self.check.measured / 2**20:.1f} MiB beyond keep-all's overhead, "
                      f"over the budget of {budget / 2**20:.1f} MiB, and no plan fits it: "
                      "the plan stays (raise activation_budget_bytes)", file=sys.stderr)
            return
        self.plan = self.check.plan
        self.modes = list(self.plan.modes)
        if self.config.verbose:
            print(self.plan.describe(self.profiles, budget)
                  + f" (made again: the first plan's step held ~{self.check.measured / 2**20:.1f}"
                  f" MiB beyond keep-all's overhead at peak, ~"
                  f"{self.check.predicted / 2**20:.1f} MiB planned)", file=sys.stderr)

    # ------------------------------------------------------------- lifetime
    def stats(self) -> dict:
        s = self.store.stats
        return {"d2h_bytes": s.d2h_bytes, "h2d_bytes": s.h2d_bytes, "records": s.records,
                "deduped": s.deduped, "chunks": s.chunks, "requests": s.requests,
                "live_chunks": self.store.live_chunks()}

    def close(self) -> None:
        """Remove the hooks and give back every byte of pool (idempotent).

        Saved tensors of a graph not yet backpropagated cannot be loaded after it."""
        if self._closed:
            return
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._finalizer()

    def __enter__(self) -> "ActivationTiering":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        key = (t.untyped_storage()._cdata, t.storage_offset())
        if key not in self._seen:   # a tensor saved twice counts once
            self._seen.add(key)
            self.saved += nbytes
            self.largest = max(self.largest, nbytes)

    def profile(self, name: str, recomputable: bool) -> BlockProfile:
        return BlockProfile(name, self.saved, self.inputs, self.timer.seconds(), recomputable,
                            largest=self.largest)


def measure_bandwidth(client, copy: CopyStream, nbytes: int, repeats: int = 3) -> float:
    """Bytes/s of a device <-> pool round trip on the copy stream (best of
    ``repeats``), through one reserved, then aborted, pool slot."""
    from tierd import protocol as P
    key = f"tierd-act-probe/{uuid.uuid4().hex[:12]}"
    spec = P.TensorSpec(key, "uint8", (nbytes,), nbytes)
    view = client._submit(P.Reserve((spec,)), client._leased).result()[0].tensor
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
        client._submit(P.Abort((key,))).result()


def _model_device(model: nn.Module) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def tier_activations(model: nn.Module, client, *, policy: str | None = "offload",
                     budget_bytes: int | None = None, min_bytes: int = 1 << 20,
                     blocks: list[nn.Module] | None = None,
                     device: str | torch.device | None = None,
                     **options) -> ActivationTiering:
    """Tier what autograd saves in ``model``'s forward (see the module docstring).

    ``budget_bytes``: device bytes of saved activations ``auto`` plans for
    (None: no limit). ``min_bytes``: saved tensors smaller than this stay on
    the device (default 1 MiB: a small copy frees little and costs its
    per-copy overhead); ``stats()["d2h_bytes"]`` says how much went to the pool.
    ``options`` are further :class:`ActivationConfig` fields (``chunk_bytes``,
    ``prefetch_bytes``, ``verbose``). ``device`` is the compute device (default:
    that of the model's first parameter; pass it when attach has emptied them).

    Example:
        >>> h = tier_activations(model, client, policy="auto", budget_bytes=8 << 30)  # doctest: +SKIP
        >>> for batch in loader: model(**batch).loss.backward()                     # doctest: +SKIP
        >>> h.close()                                                               # doctest: +SKIP
    """
    config = ActivationConfig(policy=policy, budget_bytes=budget_bytes,
                              min_bytes=min_bytes, **options)
    return ActivationTiering(model, client, config, blocks=blocks,
                             device=torch.device(device) if device is not None else None)
