"""The hooks that tier one model's saved activations, and the handle that owns them."""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any

import torch
from torch import nn

from tierd.client.activations.auto import AutoPlanner, AutoStage, measure_bandwidth
from tierd.client.activations.config import ActivationConfig
from tierd.client.activations.plan import BlockMode, BlockProfile, MemoryCheck, Plan
from tierd.client.activations.store import ActivationStore, SavedActivation
from tierd.client.copy_stream import CopyStream, register_pool
from tierd.client.keys import activation_prefix
from tierd.client.store import Store
from tierd.client.torch_internals import (checkpoint_without_reentrant, current_graph_task,
                                          in_backward, queue_engine_callback, storage_id,
                                          tree_flatten)


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The items of the largest ``nn.ModuleList`` (most items, then most
    parameters): the repeated blocks of a transformer."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    best = max(lists, key=lambda m: (len(m), sum(p.numel() for p in m.parameters())))
    return list(best)


def _model_device(model: nn.Module) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


class ActivationTiering:
    """The handle :func:`tier_activations` returns; :meth:`close` undoes it all."""

    def __init__(self, model: nn.Module, client: Store, config: ActivationConfig, *,
                 blocks: list[nn.Module] | None = None,
                 device: torch.device | None = None) -> None:
        self.model, self.client, self.config = model, client, config
        self.device = device or _model_device(model)
        self.blocks = find_blocks(model) if blocks is None else list(blocks)
        self.copy = CopyStream(self.device)
        register_pool(client, self.device)
        pool = int(client.stats()["pool_bytes"])
        self.store = ActivationStore(
            client, self.copy, activation_prefix(),
            chunk_bytes=max(64 << 10, min(config.chunk_bytes, pool // 8)),
            prefetch_bytes=min(config.prefetch_bytes, pool // 4))
        self._probe_bytes = max(1 << 20, min(64 << 20, pool // 8))
        self.auto = AutoPlanner(config, self.device, blocks=len(self.blocks),
                                overlap=self.copy.on_device,
                                prefetch_bytes=self.store.prefetch_bytes)
        self.modes = self._initial_modes()
        self._lock = threading.RLock()
        self._handles: list[Any] = []
        self._stack: list[int] = []            # blocks whose forward runs now
        self._contexts: list[Any] = []         # entered saved_tensors_hooks (root depth)
        self._forwards: list[int] = []         # store tokens of running root forwards
        self._checkpoints: dict[int, list[Any]] = {}
        self._tasks: set[int] = set()
        self._keep_storages: set[int] = set()
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

    # ------------------------------------------------- the auto policy's state
    @property
    def stage(self) -> AutoStage:
        return self.auto.stage

    @property
    def plan(self) -> Plan | None:
        return self.auto.plan

    @property
    def profiles(self) -> list[BlockProfile] | None:
        return self.auto.profiles

    @property
    def check(self) -> MemoryCheck | None:
        """The plan's first step against the model (CUDA, ``auto`` with a budget)."""
        return self.auto.check

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
        if in_backward() or not torch.is_grad_enabled():
            self._contexts.append(None)
            return
        self._keep_storages = {storage_id(t) for t in
                               [*self.model.parameters(), *self.model.buffers()]}
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._contexts.append(ctx)
        self._forwards.append(self.store.begin_forward())
        if self.auto.meter is not None:
            self.auto.meter.start()

    def _root_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:   # an earlier pre-hook raised before ours ran
            return
        ctx = self._contexts.pop()
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        forward = self._forwards.pop()
        if self.auto.meter is not None:
            self.auto.meter.move(True, len(self.blocks))
        if output is None and sys.exc_info()[0] is not None:
            self._stack.clear()
            self.store.abandon(forward)   # the step is abandoned: give its space back

    def _block_pre(self, index: int):
        def hook(module: nn.Module, args: Any, kwargs: dict) -> None:
            meter = self.auto.meter
            if in_backward():
                if meter is not None:
                    meter.move(True, index)   # rebuilt for its backward
                return
            if not self._contexts or self._contexts[-1] is None:
                return
            self._stack.append(index)
            if meter is not None:
                meter.move(False, index)
            if self.auto.profiling:
                self.auto.block_begun(index, args, kwargs, self.store.stats.save_seconds)
            if self.modes[index] is BlockMode.RECOMPUTE and torch.is_grad_enabled():
                gen = checkpoint_without_reentrant(module, *args, **kwargs)
                next(gen)
                self._checkpoints.setdefault(index, []).append(gen)
        return hook

    def _block_post(self, index: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._stack or self._stack[-1] != index:
                if self.auto.meter is not None and in_backward():
                    self.auto.meter.sample()   # rebuilt
                return
            gens = self._checkpoints.get(index)
            if gens:
                with contextlib.suppress(StopIteration):
                    next(gens.pop())
            self._stack.pop()
            if self.auto.profiling:
                self.auto.block_ended(index, self.store.stats.save_seconds)
            if self.auto.meter is not None:
                self._meter_block_end(index, output)
        return hook

    def _meter_block_end(self, index: int, output: Any) -> None:
        """Block ``index``'s forward ended; its backward begins once its
        output's gradient is complete (a tensor hook: blocks have no other)."""
        meter = self.auto.meter
        meter.move(False, len(self.blocks))
        out = next((t for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if out is not None:
            out.register_hook(lambda grad: meter.move(True, index))

    def _pack(self, t: torch.Tensor) -> Any:
        block = self._stack[-1] if self._stack else len(self.blocks)
        nbytes = t.numel() * t.element_size()
        if self.auto.profiling and not self._is_model_state(t):
            self.auto.saved(block, t, nbytes)
        if self.auto.meter is not None:
            self.auto.meter.sample()
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
        return isinstance(t, nn.Parameter) or storage_id(t) in self._keep_storages

    def _unpack(self, packed: Any) -> torch.Tensor:
        if self.auto.meter is not None:
            self.auto.meter.sample()
        offloaded = isinstance(packed, SavedActivation)
        if offloaded or self.auto.stage is not AutoStage.DONE:
            with self._lock:
                # its end ends the profile or the check, offloaded or not (a
                # model whose every activation is under min_bytes offloads none)
                self._watch_backward()
        if not offloaded:
            return packed
        with self._lock:
            return self.store.load(packed)

    def _watch_backward(self) -> None:
        task = current_graph_task()
        if task != -1 and task not in self._tasks:
            self._tasks.add(task)
            queue_engine_callback(lambda: self._end_backward(task))

    def _end_backward(self, task: int) -> None:
        with self._lock:
            self._tasks.discard(task)
            if self._tasks:
                return   # a nested backward (reentrant checkpoint) ended
            self.store.end_backward()
            match self.auto.stage:
                case AutoStage.PROFILE:
                    if self.copy.on_device:   # the profile's CUDA events must have run
                        torch.cuda.synchronize(self.device)
                    self._use(self.auto.make_plan(measure_bandwidth(
                        self.client, self.copy, self._probe_bytes)))
                case AutoStage.CHECK:
                    self._use(self.auto.check_plan())

    def _use(self, plan: Plan | None) -> None:
        if plan is not None:
            self.modes = list(plan.modes)

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


def tier_activations(model: nn.Module, client: Store, *, policy: str | None = "offload",
                     budget_bytes: int | None = None, min_bytes: int = 1 << 20,
                     blocks: list[nn.Module] | None = None,
                     device: str | torch.device | None = None,
                     **options) -> ActivationTiering:
    """Tier what autograd saves in ``model``'s forward (see :mod:`tierd.client.activations`).

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
