"""One attached model: its parts, built in one place, and the hook entry points.

An :class:`AttachSession` is owned by the model it attaches, so two attached
models in one process share nothing but (optionally) the store client. It
builds its parts, each the one owner of its concern:

- :class:`~tierd.client.registry.ParamRegistry`: the TieredParams and units;
- :class:`~tierd.client.mover.Mover`: swap-in, prefetch, frees, the device budget;
- :class:`~tierd.client.backward.BackwardTracker`: when a backward pass begins and ends;
- :class:`~tierd.client.grads.GradBucket`: gradients written to the pool;
- :class:`~tierd.client.rank_share.RankShare`: owners, reduction and publishing,
  only under torch.distributed;
- :class:`~tierd.client.hooks.ModuleHooks` and activation tiering, which call in here.

The hooks call one method each (``pre_forward``, ``post_forward``,
``pre_backward``, the gradient hook); ``tierd.optim`` uses the leases, the
copy stream and the methods under "values".

[Note: units and when parameters are resident]
A *unit* is a block of the model, or the rest of it ([Note: units are the
model's blocks] in ``tierd.client.registry``). Before a unit's forward its
parameters are brought onto the device and its modules hold their compute
tensors; after it they are freed, unless the forward
is a re-run inside backward (activation checkpointing), where they stay until
backward is done with them. In backward a unit's parameters are made resident
when the first gradient of the unit's outputs arrives (a multi-grad hook on
the outputs, like FSDP2's pre-backward). A parameter that requires grad is
freed right after autograd has accumulated its gradient, which is after every
backward node that takes it as input has run; a frozen one when its unit's
backward is done ([Note: frozen parameters freed after their unit's
backward]), else when the backward graph task that brought it in ends (an
engine callback). Freeing resizes the storage to 0, see [Note: why resize
the storage instead of swapping ``.data``] in ``tiered_param``.

[Note: a unit's modules in its backward]
transformers 5.24 checkpoints a decoder layer's ``forward``, not its
``__call__`` as 5.17 did (so FSDP2's module hooks stay outside the
checkpoint): the recompute in backward runs no pre-forward hook, and the
layer's modules held the tensors for between uses, so every op of the
recompute read its parameter from the tiers (``tierd.client.values``),
settling the session each time: 576 such reads a step for a 64-layer Llama,
whose step on the CPU took 4.3 s against 3.5 s without them. So, as FSDP2's
pre-backward unshards, a unit's pre-backward puts its compute tensors into
its modules, and the next unit's pre-backward (or the end of backward, or
the next step) puts the tensors for between uses back; a parameter freed
in its unit's backward gets its tensor for between uses back at once, so a
backward hook reading it reads its value, not freed memory. Autograd reads
saved tensors, not modules; only the recompute reads the modules, and it
runs inside the unit's own backward.

[Note: frozen parameters freed after their unit's backward]
A frozen parameter gets no gradient, so nothing autograd does says when the
last node that reads it has run. Held until the backward ended, a LoRA step
over a 70B frozen base held every streamed block at once (H200, capped at
80 GB: the first step peaked at 142 GB, and placement, reading that, kept
nothing on the GPU). So, as FSDP2 does, a unit whose streamed parameters
include frozen ones hooks the tensors its forward takes that require grad
(a multi-grad hook, mode "all"): once their gradients are computed, every
backward node between the unit's outputs and its inputs has run, and its
frozen parameters brought in by backward are freed. A unit run twice in a
step is entered by backward twice; its pre-backward hooks and these are
counted per unit (``Mover.after_backward``), and it is freed when the
count falls to zero, so the earlier run still finds its parameters. A unit
whose inputs need no gradient (the first block of a frozen base), or a
model compiled whole (no hook is traced there), keeps the rule above: freed
when the backward ends. What this cannot see: a frozen weight read by a
node whose gradient flows only into a trainable parameter of the same
unit, never to its inputs (``W @ adapter`` as a parameter's own path);
such a node may run after the inputs' gradients and find the weight freed
(an error, not a wrong value); LoRA and the models tierd is measured on
have no such node.

"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import torch
from torch import nn

from tierd.client.access_plan import AccessPlanSender
from tierd.client.activations import ActivationTiering
from tierd.client.attach_config import AttachConfig, resolve_cap
from tierd.client.backward import BackwardTracker
from tierd.client.copy_stream import CopyStream, register_pool
from tierd.client.distributed import Ranks
from tierd.client.grad_view import GradViews
from tierd.client.grads import GradBucket, free_grads, unused_grads
from tierd.client.hooks import ModuleHooks
from tierd.client.keys import ModelKeys
from tierd.client.leases import LeaseTable
from tierd.client.mover import Mover
from tierd.client.placer import Placer
from tierd.client.rank_share import RankShare
from tierd.client.registry import ParamRegistry, Unit, ValueSource, same_storage
from tierd.client.releases import PendingReleases
from tierd.client.store import Store
from tierd.client.tiered_param import ParamState, TieredParam, tiered_of
from tierd.client.torch_internals import current_graph_task
from tierd.errors import StateError
from tierd.updates.engine import SessionUpdates

_SESSION_ATTR = "_tierd_session"

log = logging.getLogger("tierd.attach")

#: Bytes of stored values read into host memory at a time ([Note: values read back in parts])
READ_CHUNK_BYTES = 1 << 30


@dataclass
class SessionStats:
    """Counters of one attached model since attach (see :meth:`AttachSession.stats`)."""

    hook_seconds: float = 0.0      # host time inside tierd's hooks (optimizer included)
    optimizer_seconds: float = 0.0  # of which: launching fused optimizer updates
    wait_seconds: float = 0.0      # host time blocked on replies, copies, collectives (hooks and step())
    lease_wait_seconds: float = 0.0  # of which: on the daemon's lease replies
    lease_wait_weights_s: float = 0.0  # ... of which: first asked for a compute copy
    lease_wait_grads_s: float = 0.0    # ... for a gradient
    lease_wait_state_s: float = 0.0    # ... for a master or optimizer state
    requests: int = 0              # requests sent to the daemon
    master_copy_bytes: int = 0     # compute copies cast from fetched fp32 masters, not copied in
    forward_update_bytes: int = 0  # optimizer state updated in a forward, not its backward
    steps: int = 0                 # root forwards that began a step
    backwards: int = 0             # outermost backward passes that ended


@dataclass(frozen=True)
class Resumed:
    """What a resuming attach found in the job ([Note: resume] in tierd.client.checkpoint):
    the keys stored under the prefix (not uploaded again) and the commit's step."""

    keys: frozenset[str] = frozenset()
    step: int | None = None


class AttachSession:
    """Everything one attached model needs (see the module docstring).

    Example:
        >>> session = AttachSession(model, store, AttachConfig(), owns_store=False)  # doctest: +SKIP
        >>> session.stats()["steps"]                                                # doctest: +SKIP
        0
    """

    def __init__(self, model: nn.Module, client: Store, config: AttachConfig, *,
                 owns_store: bool, resumed: Resumed = Resumed(),
                 ranks: Ranks | None = None, source: ValueSource | None = None,
                 kept: dict | None = None) -> None:
        self.model = model
        self.closed = False   # detached: its parameters' values left tierd
        self.client = client
        self.config = config
        self.owns_client = owns_store
        self.resumed_keys = resumed.keys
        self.resumed_step = resumed.step
        self.device = config.resolved_device()
        self.keys = ModelKeys.for_name(config.name)
        self.prefix = self.keys.prefix
        self.copy = CopyStream(self.device)
        self.counters = SessionStats()
        self.leases = LeaseTable(client, self.counters)
        self.releases = PendingReleases(self.leases)
        self.pool_bytes = int(client.stats()["pool_bytes"])
        self.held_bytes = 0
        # Leases held for prefetch, gradient buckets and optimizer blocks pin
        # pool space; each gets at most a quarter of the pool so together they
        # can never ask for more than it holds (that would be a CapacityError).
        self.lease_cap = max(1, self.pool_bytes // 4)
        self.grads = GradBucket(client, self.leases, self.copy, self.releases,
                                min(config.grad_bucket_bytes, self.lease_cap))
        self.grad_views = GradViews(self, self.leases)   # p.grad as users see it
        self.optimizers: list = []   # tierd.optim updaters fused into backward
        self.updates = SessionUpdates(self)   # what they do, as the placer asks it
        register_pool(client, self.device)
        # [Note: masters made when first needed] in tierd.client.registry (every
        # rank reads the owners' masters under torch.distributed: stored there)
        self.lazy_masters = ranks is None
        self.registry = ParamRegistry(model, self, store=client, stored=resumed.keys,
                                      on_grad=self.on_grad, source=source, kept=kept,
                                      distributed=ranks is not None)
        self.params = self.registry.params
        self.units = self.registry.units
        # [Note: the job's access plan] in tierd.server.readahead
        plans = AccessPlanSender(client, self.prefix,
                                 spills=lambda: self._model_bytes() > self.pool_bytes) \
            if config.read_ahead and ranks is None else None
        self.mover = Mover(self.registry, config.mover(self.lease_cap), copy=self.copy,
                           leases=self.leases, releases=self.releases,
                           counters=self.counters, optimizers=self.optimizers, plans=plans)
        self.backward = BackwardTracker(on_begin=self._begin_backward, on_end=self._end_backward)
        # [Note: a unit's modules in its backward]: the unit so installed, and
        # where its modules hold its parameters
        self._backward_unit: Unit | None = None
        self._backward_holders: dict[TieredParam, list] = {}
        self.share = None if ranks is None else RankShare(
            ranks, self.registry, store=client, leases=self.leases, releases=self.releases,
            copy=self.copy, counters=self.counters, device=self.device,
            dtype=config.compute_dtype, deliver=self._deliver_grad,
            gpu_tier=config.gpu_tier, device_masters=self.updates.device_masters)
        tps = [tp for tp in self.params.values() if not tp.resident]
        self.try_hold([tp.key for tp in tps], sum(tp.nbytes for tp in tps))
        cap = resolve_cap(self.device, config.gpu_memory_bytes,   # kept: the plan's already
                          leaving=sum(tp.nbytes for tp in self.params.values() if not tp.in_store))
        self.placer = Placer(self, cap, explicit=config.gpu_memory_bytes is not None)
        self.hooks = ModuleHooks(model, self.registry, self, self.counters)
        self.activations = None if config.activations is None else ActivationTiering(
            model, client, config.activations, device=self.device)
        object.__setattr__(model, _SESSION_ATTR, self)

    def try_hold(self, keys: list[str], nbytes: int) -> bool:
        """Hold leases on ``keys`` for good if all held bytes stay under
        ``hold_fraction`` of the pool (see [Note: held leases] in leases.py)."""
        if self.held_bytes + nbytes > self.config.hold_fraction * self.pool_bytes:
            if self.held_bytes and self._model_bytes() + nbytes > self.pool_bytes:
                # the model spills to NVMe: a held key pins its pool bytes where
                # they are, and the holes around it cannot take a large tensor
                log.info("tierd: the model's keys exceed the pool (%d B); leasing per use "
                         "so every key may spill", self.pool_bytes)
                self.leases.end_holds()
                self.held_bytes = 0
            return False
        if not self.leases.hold(keys):
            return False
        self.held_bytes += nbytes
        return True

    def drop_keys(self, keys: list[str], sizes: dict[str, int]) -> None:
        """Delete ``keys`` from the store (``sizes``: their bytes, for the
        hold budget); a hold on them ends first. No other lease may be pending."""
        self.held_bytes -= sum(sizes[k] for k in self.leases.unhold(keys))
        self.releases.drain(block=True)
        self.client.delete(keys)

    def _model_bytes(self) -> int:
        """Bytes of the model's values in the store (compute copies and fp32 masters)."""
        return (sum(tp.nbytes for tp in self.params.values())
                + self.updates.master_bytes(self.params.values()))

    def owns(self, tp: TieredParam) -> bool:
        """This rank keeps ``tp``'s optimizer state (always, without torch.distributed)."""
        return self.share is None or self.share.owns(tp)

    def stats(self) -> dict:
        """Counters since attach: hook seconds, daemon requests, bytes copied in
        and out, steps and backwards. Diff two calls to get one step's figures.

        Example:
            >>> before = session.stats(); train_step(); after = session.stats()  # doctest: +SKIP
            >>> after["h2d_bytes"] - before["h2d_bytes"]                           # doctest: +SKIP
        """
        out = {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}
        control = getattr(self.client, "control", None)   # none in-process
        out.update(h2d_bytes=self.copy.h2d_bytes, d2h_bytes=self.copy.d2h_bytes,
                   held_bytes=self.held_bytes, **self.placer.stats(),
                   # this process's connection (every model on it): pool
                   # segments made usable here, seconds and bytes, where
                   # needed and ahead ([Note: segments mapped ahead])
                   pool_map_seconds=getattr(control, "map_seconds", 0.0),
                   pool_mapped_bytes=getattr(control, "mapped_bytes", 0),
                   pool_map_ahead_seconds=getattr(control, "ahead_seconds", 0.0),
                   pool_mapped_ahead_bytes=getattr(control, "ahead_bytes", 0))
        return out

    # ------------------------------------------------------------- hooks
    def begin_step(self, signature: tuple = ()) -> None:
        """Root forward starts a step (unless it is a re-run inside backward);
        ``signature``: the shapes of its inputs (see tierd.client.placer)."""
        if current_graph_task() != -1:
            return
        # Held leases mean a step may send no request at all: ask the kernel
        # (one poll of the control socket) so a dead daemon is seen every step.
        self.client.check_alive()
        self.grad_views.apply_ops()   # p.grad changed in place since the backward
        self.counters.steps += 1
        self._install_for_backward(None)   # a backward that raised left them
        self.settle(synchronize=False)
        self.placer.begin_step(signature)
        self.mover.begin_step()

    def pre_forward(self, unit: Unit) -> None:
        self.mover.observe(unit)
        self.mover.hold(unit)

    def post_forward(self, unit: Unit) -> None:
        self.mover.release_after_forward(unit, current_graph_task())

    def forward_waits(self) -> set[int]:
        """[Note: updates before the next forward] in tierd.updates.forward."""
        return set().union(*(opt.in_forward.units() for opt in self.optimizers))

    def waits_for_update(self, unit: Unit) -> bool:
        return any(opt.in_forward.waits(unit.index) for opt in self.optimizers)

    def update_before_forward(self, unit: Unit) -> None:
        for opt in self.optimizers:
            opt.in_forward.before_unit(unit.index)

    def gradient_arrives(self) -> None:
        """Before autograd accumulates a gradient: the views come off
        ([Note: gradients users touch] in tierd.client.grad_view)."""
        self.grad_views.hide()

    def pre_backward(self, unit: Unit) -> None:
        task = self.backward.enter()
        self.mover.observe(unit)
        self.mover.enter_backward(unit, task)
        self._install_for_backward(unit)
        for opt in self.optimizers:
            opt.prefetch()

    def _install_for_backward(self, unit: Unit | None) -> None:
        """[Note: a unit's modules in its backward]: ``unit``'s modules hold
        its compute tensors, the unit so installed before its tensors for
        between uses (``None``: no unit's)."""
        if self._backward_unit is not None and self._backward_unit is not unit:
            self.registry.install(self._backward_unit, running=False)
        self._backward_unit, self._backward_holders = None, {}
        if unit is not None and unit.params:
            self.registry.install(unit, running=True)
            self._backward_unit, self._backward_holders = unit, self.registry.holders(unit)

    def _uninstall_freed(self, tp: TieredParam) -> None:
        """``tp`` was freed in its unit's backward: its modules hold its
        tensor for between uses again (a backward hook reading it reads the
        value, not freed memory)."""
        if tp.state is ParamState.HOST:
            for module, attr in self._backward_holders.pop(tp, ()):
                module._parameters[attr] = tp.outside

    def post_backward(self, unit: Unit) -> None:
        self.backward.enter()
        self.mover.after_backward(unit)
        for tp in unit.params:   # frozen ones freed now
            self._uninstall_freed(tp)

    def on_grad(self, param: torch.Tensor) -> None:
        """Autograd accumulated a gradient into ``param`` (either tensor of a
        parameter: [Note: the two tensors of a parameter]): hand it to a fused
        optimizer (or the reducer, or the pool), then free the parameter."""
        t0 = time.perf_counter()
        tp = param.tiered
        self.backward.enter()
        grad, param.grad = param.grad, None
        if grad is not None:
            if self.share is not None:
                self.share.reducer.add(tp, grad)   # delivered to the owner once summed
            else:
                self._deliver_grad(tp, grad)
        self.mover.done_with(tp)
        self._uninstall_freed(tp)
        self.counters.hook_seconds += time.perf_counter() - t0

    def _deliver_grad(self, tp: TieredParam, grad: torch.Tensor) -> None:
        if not any(opt.on_grad(tp, grad) for opt in self.optimizers):
            self.grads.add(tp, grad)

    def _begin_backward(self) -> None:
        self.grad_views.hide()
        for opt in self.optimizers:
            opt.begin_backward()

    def _end_backward(self, task: int, outermost: bool) -> None:
        """A backward graph task ended (an engine callback)."""
        self.client.check_alive()
        t0 = time.perf_counter()
        if self.share is not None and outermost:
            self.share.reducer.flush()
        self.grads.flush()
        self.mover.free_task(task, outermost=outermost)
        if outermost:
            self._install_for_backward(None)
            self.counters.backwards += 1
            for opt in self.optimizers:
                opt.end_backward()
            self.grad_views.show([tp for tp in self.params.values() if tp.has_gradient],
                                 [tp for opt in self.optimizers for tp in opt.consumed()])
            self.settle(synchronize=False)
        self.counters.hook_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------- movement
    def keep_late_adapters(self) -> None:
        """Adapters the rule picks only now (peft's ``get_peft_model`` on the
        attached model freezes the base after adding them) onto the device
        for good, as attach keeps them: when an optimizer is built, the
        trainable parameters are known ([Note: adapters stay on the device]
        in tierd.client.registry)."""
        late = self.registry.late_adapters()
        if not late:
            return
        self.settle()
        self.make_resident(late)
        for tp in late:
            tp.resident_for_good = True
        self.mover.replan(keep_trace=True)

    def make_resident(self, tps: list[TieredParam]) -> None:
        """``tps`` onto the device from their stored values, leased while copied."""
        keys = [tp.key for tp in tps]
        self.leases.acquire(keys)
        try:
            self.registry.set_resident(tps, True, self.leases.views(keys))
        finally:
            self.leases.release(keys)

    def settle(self, *, synchronize: bool = True, write_resident: bool = True) -> None:
        """Bring every parameter back to rest: freed, no lease pending; with
        ``synchronize`` also every copy landed (before the host reads the pool)
        and no value kept for the next step; resident optimizer state is
        written to the pool unless ``write_resident`` is False."""
        self._take_device_writes()
        if synchronize and write_resident:
            self.updates.check_room_to_write_back()   # nothing written if it cannot all be
        self.grads.flush()
        self.mover.settle(synchronize=synchronize)
        if synchronize:
            t0 = time.perf_counter()
            for opt in self.optimizers:
                opt.settle(write_resident=write_resident)
            if write_resident:
                self.updates.write_kept_weights()
            self.copy.synchronize()
            self.releases.drain(block=True)
            self.counters.wait_seconds += time.perf_counter() - t0
        else:
            self.releases.drain()

    def _take_device_writes(self) -> None:
        """A user's in-place writes to resident parameters, into every copy
        ([Note: writes to a resident parameter] in tierd.client.tiered_param)."""
        changed = {tp: tp.param.detach() for tp in self.params.values()
                   if tp.resident and tp.param._version != tp.seen_version}
        if changed:
            for tp in changed:
                tp.seen_version = tp.param._version
            self.write_values(changed)

    def keep_new_value(self, tp: TieredParam, value: torch.Tensor) -> None:
        """See :meth:`Mover.keep_new_value`."""
        self.mover.keep_new_value(tp, value, self.counters.steps)

    def finish_update(self) -> None:
        """The end of ``opt.step()`` on every rank (nothing without ranks)."""
        if self.share is not None:   # resident units stay: no rank reads them from the pool
            self.share.finish_update(lambda: self.settle(write_resident=False))

    # ------------------------------------------------------------- values
    def zero_grad(self, tps: list[TieredParam] | None = None) -> None:
        """Forget accumulated gradients (the next backward overwrites them).

        The host does not wait here for copies still landing: every later
        read of a key waits for its last write on the device (the copy
        stream's write events), and reads by the host settle first."""
        self.grads.flush()
        tps = list(self.params.values()) if tps is None else tps
        self.grad_views.drop(tps)
        for tp in tps:
            tp.to_no_gradient()
        self._drop_unused_grads(tps)

    def _drop_unused_grads(self, tps: list[TieredParam]) -> None:
        """Delete the gradient keys no later backward writes: those of parameters
        whose gradients a fused optimizer consumes inside every backward (a
        window of one). The first (learning) step sums every gradient in the
        pool; kept, those keys would hold 4 B/param of store for nothing (an
        8B model: 32 GB). A later window that needs them makes them again."""
        unused = unused_grads(self, tps)
        if unused:
            # the last writes of those keys have landed (resident state stays off
            # the store: [Note: resident state leaves the store] in tierd.updates.resident)
            self.settle(write_resident=False)
            free_grads(self, unused)

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """New CPU tensors with the stored bytes of this session's keys (not
        those of resident optimizer state, which :meth:`read_values` reads on
        the device: [Note: resident state leaves the store] in tierd.updates.resident)."""
        self.settle(write_resident=False)
        keys = list(dict.fromkeys(keys))
        # [Note: the measuring step keeps its gradients on the device] in tierd.client.held_grads
        wanted = set(keys)
        self.grads.spill(tp for tp in self.params.values()
                         if tp.grad_on_device and tp.grad_key in wanted)
        self.leases.acquire(keys)
        try:
            return {k: v.clone() for k, v in self.leases.views(keys).items()}
        finally:
            self.leases.release(keys)

    def read_values(self, tps: list[TieredParam], *, onto=None
                    ) -> dict[TieredParam, torch.Tensor]:
        """Current values (fp32 master if any), as new tensors in the original
        dtype: on the CPU, or on ``onto(tp)`` (a device). Resident optimizer
        state is read on the device, with no write-back (under
        torch.distributed a rank's own copy: the pool has its owner's)."""
        where = onto if onto is not None else (lambda tp: "cpu")
        out = self._device_values(tps, where, take=False)
        out.update(self._stored_values([tp for tp in tps if tp not in out], where))
        return {tp: out[tp] for tp in tps}

    def _device_values(self, tps: list[TieredParam], where, *, take: bool
                       ) -> dict[TieredParam, torch.Tensor]:
        """The values only the device has the newest of (resident masters, and
        frozen weights kept only there), on ``where(tp)`` in the original
        dtype; ``take``: as they are where already so (detach: nothing else
        uses them after, and :meth:`close` keeps their storage), but for a
        master that is a stored parameter's compute copy (fp32, or
        ``master="bf16"``), whose storage placement frees when it streams
        the parameter again."""
        out = {tp: v.to(where(tp), tp.orig_dtype, copy=not take or same_storage(v, tp.compute))
               for tp, v in self.updates.device_masters(tps).items()}
        out.update({tp: tp.compute.to(where(tp), tp.orig_dtype, copy=not take)
                    for tp in tps if not tp.in_store})   # its only copy
        return out

    def _stored_values(self, tps: list[TieredParam], where) -> dict[TieredParam, torch.Tensor]:
        """The stored values of ``tps`` on ``where(tp)`` in the original dtype.

        [Note: values read back in parts]
        The store is read ``READ_CHUNK_BYTES`` at a time (a quarter of the
        pool at most, as every lease the session asks), each part put where
        it goes before the next is read: reading every value of a model built
        on the GPU into host memory before moving any back held the whole
        model there (detach of a 13B Llama: 53 GB of fp32 on a host the pool
        had left 15 GB, and the kernel killed the process), and leasing every
        key at once needs the pool to hold them all together. Detach takes
        what only the device has first and lets the optimizer's resident
        state go before it reads, so the device holds the values it gets
        back in place of that state."""
        out = {}
        for part in _parts(list(dict.fromkeys(tps)), min(READ_CHUNK_BYTES, self.lease_cap)):
            got = self.read([tp.value_key for tp in part])
            out.update({tp: got[tp.value_key].to(where(tp), tp.orig_dtype) for tp in part})
        return out

    def current_values(self, tps: list[TieredParam], *,
                       to_write: bool = False) -> dict[TieredParam, torch.Tensor]:
        """The values of ``tps`` as the modules would hold them (compute dtype,
        on the compute device): the device copy of a resident one, else read
        from the tiers (``tierd.client.values``). With ``to_write`` each is a
        copy nothing else holds."""
        self.settle(write_resident=False)
        out = {tp: tp.param.detach().clone() if to_write else tp.param.detach()
               for tp in tps if tp.state is ParamState.DEVICE}
        rest = [tp for tp in tps if tp not in out]
        if rest:
            got = self.read_values(rest, onto=lambda tp: tp.param.device)
            out.update({tp: got[tp].to(dtype=tp.param.dtype) for tp in rest})
        return out

    def write_values(self, values: dict[TieredParam, torch.Tensor]) -> None:
        """Make ``values`` the parameters' values (as ``param.copy_(value)``
        would in torch): the stored compute copies and fp32 masters, the
        device copy of a resident one, and a resident optimizer's master."""
        if self.share is not None:
            raise StateError(
                "writing an attached parameter's values under torch.distributed: every "
                "rank reads the node's one copy, so no rank may change it alone; set "
                "values before tierd.attach (or with attach(model, weights=PATH))")
        for tp, value in values.items():
            if tuple(value.shape) != tuple(tp.param.shape):
                raise ValueError(f"a value of shape {tuple(value.shape)} for {tp.name!r}, "
                                 f"whose shape is {tuple(tp.param.shape)}")
        self.settle()   # the store holds every value; nothing in flight
        stored = {}
        for tp, value in values.items():
            value = value.detach()
            if not tp.in_store:
                continue   # its device copy, set below, is its only copy
            stored[tp.key] = value.to("cpu", tp.param.dtype)
            if tp.has_master and tp.master_made:
                stored[tp.master_key] = value.to("cpu", torch.float32)
        pending = list(stored)
        while pending:   # a lease's worth at a time
            keys, nbytes = [], 0
            while pending and (not keys or nbytes + stored[pending[0]].nbytes <= self.lease_cap):
                nbytes += stored[pending[0]].nbytes
                keys.append(pending.pop(0))
            self.leases.acquire(keys)
            try:
                views = self.leases.views(keys)
                for key in keys:
                    views[key].copy_(stored[key])
            finally:
                self.leases.release(keys, written=True)
        masters = self.updates.device_masters(list(values))
        with torch.no_grad():
            for tp, value in values.items():
                if tp.state is ParamState.DEVICE:
                    tp.compute.copy_(value)
                if tp in masters:
                    masters[tp].copy_(value)
                tp.stale_in_store = False

    def gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradients by parameter name (for inspection; fp32, or bf16
        under a bf16 master: [Note: the stored gradient's dtype] in tierd.client.tiered_param)."""
        self.grads.flush()
        with_grad = [tp for tp in self.params.values() if tp.has_gradient]
        got = self.read([tp.grad_key for tp in with_grad])
        return {tp.name: got[tp.grad_key] for tp in with_grad}

    def fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Replace ``module``'s empty parameter entries with their stored values."""
        wanted = {prefix + attr: tiered_of(p) for attr, p in module._parameters.items()
                  if tiered_of(p) is not None and prefix + attr in state_dict}
        if not wanted:
            return
        values = self.read_values(list(dict.fromkeys(wanted.values())),
                                  onto=lambda tp: tp.orig_device)
        for entry, tp in wanted.items():
            state_dict[entry] = values[tp]

    def refresh_resident(self, tp: TieredParam, value: torch.Tensor) -> None:
        """The optimizer changed a resident parameter: update its device copy."""
        with torch.no_grad():
            tp.compute.copy_(value)

    # ------------------------------------------------------------- detach
    def close(self) -> None:
        """Detach: hooks off, ordinary parameters back, the model's keys deleted."""
        if self.activations is not None:
            self.activations.close()
        tps = list(self.params.values())
        home = lambda tp: tp.orig_device   # noqa: E731
        values = self._device_values(tps, home, take=True)
        for opt in self.optimizers:   # read: its keys are deleted below anyway
            opt.discard_resident()
        values.update(self._stored_values([tp for tp in tps if tp not in values], home))
        self.placer.close()
        self.hooks.remove()
        if self.mover.plans is not None:
            self.mover.plans.close()
        self.settle()
        self.registry.restore(values)
        self.leases.unhold_all()
        ranks = None if self.share is None else self.share.ranks
        if ranks is not None:   # the node's keys go once every rank has read them
            self.client.stats()       # our releases are processed before the barrier
            ranks.barrier("detach")
        if ranks is None or ranks.leader:
            self.client.delete(self.client.keys(self.keys.all))
        object.__delattr__(self.model, _SESSION_ATTR)
        self.closed = True
        if self.owns_client:
            self.client.close()


def _parts(tps: list[TieredParam], most: int) -> list[list[TieredParam]]:
    """``tps`` in order, in runs of at most ``most`` bytes of stored values
    (fp32 or wider; one larger parameter is a run of its own)."""
    out: list[list[TieredParam]] = []
    run, nbytes = [], 0
    for tp in tps:
        size = tp.param.numel() * max(4, tp.orig_dtype.itemsize)
        if run and nbytes + size > most:
            out.append(run)
            run, nbytes = [], 0
        run.append(tp)
        nbytes += size
    return out + ([run] if run else [])


def session_of(model: nn.Module) -> AttachSession:
    """The AttachSession of an attached model (raises StateError if it is not attached)."""
    session = getattr(model, _SESSION_ATTR, None)
    if session is None:
        raise StateError(f"{type(model).__name__} is not attached; call tierd.attach(model)")
    return session


def is_attached(model: nn.Module) -> bool:
    return getattr(model, _SESSION_ATTR, None) is not None
