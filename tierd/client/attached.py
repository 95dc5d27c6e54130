"""The state of one attached model: its parameters, units, planner and streams.

Everything an attached model needs lives in one :class:`Session` owned by that
model, so two attached models in one process share nothing but (optionally)
the client. Hooks (``tierd.client.hooks``) only call the methods here.

[Note: units and when parameters are resident]
A *unit* is a module that directly owns parameters. Before a unit's forward
its parameters are made resident; after it they are freed, unless the forward
is a re-run inside backward (activation checkpointing), where they stay until
backward is done with them. In backward a unit's parameters are made resident
when the first gradient of the unit's outputs arrives (a multi-grad hook on
the outputs, like FSDP2's pre-backward). A parameter that requires grad is
freed right after autograd has accumulated its gradient, which is after every
backward node that takes it as input has run; the rest are freed when the
backward graph task that brought them in ends (an engine callback). Freeing
resizes the storage to 0, see the Note in ``tiered_param``.

"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields

import torch
from torch import nn

from tierd.client.copy_stream import CopyStream, InflightCopy, register_pool
from tierd.client.distributed import GradReducer, Ranks, assign_owners
from tierd.client.grads import GradBucket
from tierd.client.leases import LeaseTable
from tierd.client.planner import PrefetchPlanner
from tierd.client.releases import PendingReleases
from tierd.client.tiered_param import ParamState, TieredParam, TieredParameter


@dataclass(frozen=True, eq=False)
class Unit:
    """A module that directly owns parameters; fetched and freed as one batch."""

    index: int
    name: str
    params: tuple[TieredParam, ...]   # the non-resident ones
    nbytes: int


@dataclass
class SessionStats:
    """Counters of one attached model since attach (see :meth:`Session.stats`)."""

    hook_seconds: float = 0.0      # host time inside tierd's hooks (optimizer included)
    optimizer_seconds: float = 0.0  # of which: launching fused optimizer updates
    wait_seconds: float = 0.0      # host time blocked on replies, copies, collectives (hooks and step())
    requests: int = 0              # requests sent to the daemon
    master_copy_bytes: int = 0     # compute copies cast from fetched fp32 masters, not copied in
    steps: int = 0                 # root forwards that began a step
    backwards: int = 0             # outermost backward passes that ended


def _current_graph_task() -> int:
    # -1 outside backward. The only way to tell a forward re-run by activation
    # checkpointing inside backward from an ordinary forward.
    return torch._C._current_graph_task_id()


class Session:
    """Per-attach state: the registry of TieredParams and their movement."""

    def __init__(self, model: nn.Module, client, config, *, owns_client: bool) -> None:
        self.model = model
        self.client = client
        self.config = config
        self.owns_client = owns_client
        self.device = config.resolved_device()
        self.prefix = f"tierd-attach/{config.name or uuid.uuid4().hex[:12]}"
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
        self.params: dict[str, TieredParam] = {}     # canonical name -> param
        self.aliases: dict[str, TieredParam] = {}    # every name (tied too)
        self.units: list[Unit] = []
        self.unit_of: dict[int, Unit] = {}           # id(module) -> unit
        self._holds: dict[TieredParam, int] = {}     # forward calls using it now
        self._leases: set[TieredParam] = set()       # leases asked for, not copied
        self.optimizers: list = []   # tierd.optim updaters fused into backward
        self._announced: list[TieredParam] = []      # prefetched, copy not started
        self._device_bytes = 0
        # new values kept on the device for the next step's first units
        # ([Note: new values kept for the next step] in tierd.optim.fused)
        self._kept: set[TieredParam] = set()
        self._kept_bytes = 0
        self._head: tuple[int, set[TieredParam]] = (-1, set())   # (step, first params)
        self._tasks_with_callback: set[int] = set()
        self.planner: PrefetchPlanner | None = None
        self.hooks = None   # tierd.client.hooks.ModuleHooks, set by attach()
        self.activations = None   # ActivationTiering, set by attach() when configured
        self.buffer_devices: dict[tuple[int, str], torch.device] = {}
        # Set by a resuming attach: the job's keys under the prefix, and the
        # step of the commit (see [Note: resume] in tierd.client.checkpoint).
        self.resumed_keys: frozenset[str] = frozenset()
        self.resumed_step: int | None = None
        # Under torch.distributed (set by attach): this rank, the owner
        # (local rank) of each trainable parameter, the gradient reducer.
        self.ranks: Ranks | None = None
        self.owner_of: dict[TieredParam, int] = {}
        self.reducer: GradReducer | None = None
        register_pool(client, self.device)

    # ------------------------------------------------------------- building
    def start(self) -> None:
        """Called once the registry and units are built (``registry.take_parameters``)."""
        self.planner = PrefetchPlanner({u.index: u.nbytes for u in self.units},
                                       min(self.config.prefetch_bytes, self.lease_cap))
        if self.ranks is not None:
            self._split_across_ranks()
        tps = [tp for tp in self.params.values() if not tp.resident]
        self.try_hold([tp.key for tp in tps], sum(tp.nbytes for tp in tps))

    def _split_across_ranks(self) -> None:
        """Owners and the reducer ([Note: one copy per node] in tierd.client.distributed)."""
        seen: set[TieredParam] = set()   # a tied parameter is in its first unit only
        buckets = []
        for tps in [u.params for u in self.units] + [
                tuple(tp for tp in self.params.values() if tp.resident)]:
            bucket = tuple(tp for tp in tps if tp.param.requires_grad and tp not in seen)
            seen.update(bucket)
            if bucket:
                buckets.append(bucket)
        owners = assign_owners([sum(tp.param.numel() for tp in b) for b in buckets],
                               len(self.ranks.node_ranks))
        self.owner_of = {tp: o for b, o in zip(buckets, owners) for tp in b}
        self.reducer = GradReducer(self.ranks, buckets, owners, self.device, self._deliver_grad,
                                   dtype=self.config.compute_dtype, stats=self.counters)
        for tp in self.params.values():
            self.leases.shared.update((tp.key, tp.master_key))

    def owns(self, tp: TieredParam) -> bool:
        """This rank keeps ``tp``'s optimizer state (always, without torch.distributed)."""
        return self.ranks is None or self.owner_of.get(tp) == self.ranks.local_rank

    def try_hold(self, keys: list[str], nbytes: int) -> bool:
        """Hold leases on ``keys`` for good if all held bytes stay under
        ``hold_fraction`` of the pool (see [Note: held leases] in leases.py)."""
        if self.held_bytes + nbytes > self.config.hold_fraction * self.pool_bytes:
            return False
        if not self.leases.hold(keys):
            return False
        self.held_bytes += nbytes
        return True

    def stats(self) -> dict:
        """Counters since attach: hook seconds, daemon requests, bytes copied in
        and out, steps and backwards. Diff two calls to get one step's figures.

        Example:
            >>> before = session.stats(); train_step(); after = session.stats()  # doctest: +SKIP
            >>> after["h2d_bytes"] - before["h2d_bytes"]                           # doctest: +SKIP
        """
        out = {f.name: getattr(self.counters, f.name) for f in fields(self.counters)}
        out.update(h2d_bytes=self.copy.h2d_bytes, d2h_bytes=self.copy.d2h_bytes,
                   held_bytes=self.held_bytes)
        return out

    def all_params(self) -> list[TieredParam]:
        return list(self.params.values())

    # ------------------------------------------------------------- forward
    def begin_step(self) -> None:
        """Root forward starts a step (unless it is a re-run inside backward)."""
        if _current_graph_task() != -1:
            return
        # Held leases mean a step may send no request at all: ask the kernel
        # (one poll of the control socket) so a dead daemon is seen every step.
        self.client.check_alive()
        self.counters.steps += 1
        self.settle(synchronize=False)
        self._kept.clear()   # in use from now on: freed after use like the rest
        self._kept_bytes = 0
        self._prefetch(self.planner.begin_step())

    def pre_forward(self, unit: Unit) -> None:
        self._observe(unit)
        for tp in unit.params:
            self._holds[tp] = self._holds.get(tp, 0) + 1
        self.require(unit)

    def post_forward(self, unit: Unit) -> None:
        in_backward = _current_graph_task() != -1
        for tp in unit.params:
            left = self._holds.get(tp, 1) - 1
            if left > 0:
                self._holds[tp] = left
                continue
            self._holds.pop(tp, None)
            if in_backward:
                tp.backward_task = tp.backward_task if tp.backward_task != -1 \
                    else _current_graph_task()
            elif tp.state is ParamState.DEVICE:
                self._free(tp)
        self._start_announced()

    # ------------------------------------------------------------- backward
    def _enter_backward(self) -> int:
        task = _current_graph_task()
        if task not in self._tasks_with_callback:
            outermost = not self._tasks_with_callback
            self._tasks_with_callback.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self.end_backward(task))
            if outermost:
                for opt in self.optimizers:
                    opt.begin_backward()
        return task

    def pre_backward(self, unit: Unit) -> None:
        task = self._enter_backward()
        self._observe(unit)
        self.require(unit)
        for tp in unit.params:
            if tp.backward_task == -1:
                tp.backward_task = task
        for opt in self.optimizers:
            opt.prefetch()

    def on_grad_of(self, param: TieredParameter) -> None:
        t0 = time.perf_counter()
        self.on_grad(param.tiered)
        self.counters.hook_seconds += time.perf_counter() - t0

    def on_grad(self, tp: TieredParam) -> None:
        """Autograd accumulated ``tp``'s gradient: hand it to a fused optimizer
        or move it out, then free ``tp``."""
        self._enter_backward()
        grad = tp.param.grad
        tp.param.grad = None
        if grad is not None:
            if self.reducer is not None:
                self.reducer.add(tp, grad)   # delivered to the owner once summed
            else:
                self._deliver_grad(tp, grad)
        if (tp.state is ParamState.DEVICE and not tp.resident
                and self._holds.get(tp, 0) == 0):
            self._free(tp)

    def _deliver_grad(self, tp: TieredParam, grad: torch.Tensor) -> None:
        if not any(opt.on_grad(tp, grad) for opt in self.optimizers):
            self.grads.add(tp, grad)

    def end_backward(self, task: int) -> None:
        """Engine callback at the end of a backward graph task."""
        self.client.check_alive()
        t0 = time.perf_counter()
        self._end_backward(task)
        self.counters.hook_seconds += time.perf_counter() - t0

    def _end_backward(self, task: int) -> None:
        self._tasks_with_callback.discard(task)
        if self.reducer is not None and not self._tasks_with_callback:
            self.reducer.flush()
        self.grads.flush()
        for tp in self.params.values():
            if (tp.state is ParamState.DEVICE and tp.backward_task == task
                    and not tp.resident and self._holds.get(tp, 0) == 0):
                self._free(tp)
        if not self._tasks_with_callback:
            self.counters.backwards += 1
            for opt in self.optimizers:
                opt.end_backward()
            self.settle(synchronize=False)

    # ------------------------------------------------------------- movement
    def require(self, unit: Unit) -> None:
        """Make every parameter of ``unit`` usable on the compute device."""
        for tp in unit.params:   # a failed prefetch falls back to on-demand
            if tp in self._leases and self.leases.view(tp.key) is None:
                self._drop_lease(tp)
        on_demand = [tp for tp in unit.params
                     if tp.state is ParamState.HOST and tp not in self._leases]
        if on_demand:
            self._lease_batch(on_demand)
            self.leases.views([tp.key for tp in on_demand])   # raises if no room
        for tp in unit.params:
            if tp.state is ParamState.HOST:
                self._start_swap_in(tp)
        for tp in unit.params:
            if tp.state is ParamState.H2D_INFLIGHT:
                tp.finish_swap_in(self.copy)
            elif tp.state is ParamState.D2H_INFLIGHT:
                tp.finish_write_back()
        self.releases.drain()

    def settle(self, *, synchronize: bool = True) -> None:
        """Bring every parameter back to rest: freed, no lease pending; with
        ``synchronize`` also every copy landed (before the host reads the pool)
        and no value kept for the next step."""
        if synchronize:
            self._kept.clear()
            self._kept_bytes = 0
        self.grads.flush()
        self._announced.clear()
        for tp in self.params.values():
            if tp.state is ParamState.H2D_INFLIGHT:
                tp.finish_swap_in(self.copy)
            elif tp.state is ParamState.D2H_INFLIGHT:
                tp.finish_write_back()
            if (tp.state is ParamState.DEVICE and not tp.resident
                    and self._holds.get(tp, 0) == 0):
                self._free(tp)
        for tp in list(self._leases):   # prefetched but never used: give them back
            self._drop_lease(tp)
        if synchronize:
            t0 = time.perf_counter()
            for opt in self.optimizers:
                opt.settle()
            self.copy.synchronize()
            self.releases.drain(block=True)
            self.counters.wait_seconds += time.perf_counter() - t0
        else:
            self.releases.drain()

    def _observe(self, unit: Unit) -> None:
        self._prefetch(self.planner.on_use(unit.index))

    def _prefetch(self, unit_ids: list[int]) -> None:
        wanted = list(dict.fromkeys(
            tp for i in unit_ids for tp in self.units[i].params
            if tp.state is ParamState.HOST and tp not in self._leases))
        if not wanted:
            return
        self._lease_batch(wanted)
        self._announced.extend(wanted)
        self._start_announced()

    def _start_announced(self) -> None:
        """Start copies of prefetched parameters while the GPU budget allows."""
        budget = self.config.gpu_budget_bytes
        while self._announced:
            tp = self._announced[0]
            if tp.state is not ParamState.HOST or tp not in self._leases:
                self._announced.pop(0)
                continue
            if self.leases.view(tp.key) is None:
                self._announced.pop(0)
                self._drop_lease(tp)
                continue
            if self._device_bytes + tp.nbytes > budget:
                return
            if any(opt.will_fetch(tp) for opt in self.optimizers):
                return   # made from its master once fetched (tierd.optim.fused)
            self._announced.pop(0)
            self._start_swap_in(tp)

    def _lease_batch(self, tps: list[TieredParam]) -> None:
        self.leases.acquire([tp.key for tp in tps])
        self._leases.update(tps)

    def _drop_lease(self, tp: TieredParam) -> None:
        self._leases.discard(tp)
        self.leases.release([tp.key])

    def _start_swap_in(self, tp: TieredParam) -> None:
        self._leases.discard(tp)
        for opt in self.optimizers:
            master = opt.fetched_master(tp)
            if master is not None:
                # [Note: compute copy from the fetched master] in tierd.optim.fused
                opt.read_master(tp, tp.start_swap_in(master, (), self.copy))
                self._device_bytes += tp.nbytes
                self.counters.master_copy_bytes += tp.nbytes
                self.leases.release([tp.key])
                return
        copy = tp.start_swap_in(self.leases.view(tp.key), (tp.key,), self.copy)
        self._device_bytes += tp.nbytes
        if self.leases.is_held(tp.key):
            self.leases.release([tp.key])   # the hold outlives the copy
        else:
            self.releases.add(copy, written=False)

    def _free(self, tp: TieredParam) -> None:
        if tp in self._kept:
            return
        tp.free()
        self._device_bytes -= tp.nbytes

    def keep_new_value(self, tp: TieredParam, value: torch.Tensor) -> None:
        """The optimizer made ``tp``'s new compute value on the device: keep it
        there if the next step uses ``tp`` first and the budget allows
        ([Note: new values kept for the next step] in tierd.optim.fused).
        Only on CUDA: on the CPU there is no copy to save, and parameters
        hold no storage between steps."""
        if not self.copy.on_device or tp.state not in (ParamState.HOST, ParamState.DEVICE):
            return
        if self._head[0] != self.counters.steps:   # which params come first, once a step
            self._head = (self.counters.steps,
                          {p for i in self.planner.head() for p in self.units[i].params})
        budget = self.config.gpu_budget_bytes
        if tp not in self._head[1] or tp in self._kept or self._kept_bytes + tp.nbytes > budget:
            return
        with torch.no_grad():
            if tp.state is ParamState.DEVICE:   # still here from its backward
                tp.param.data.copy_(value)
            elif self._device_bytes + tp.nbytes <= budget:
                tp.adopt(value)
                self._device_bytes += tp.nbytes
            else:
                return
        self._kept.add(tp)
        self._kept_bytes += tp.nbytes

    # ------------------------------------------------------------- ranks
    def reserve_shared(self, tps: list[TieredParam]):
        """Ask early for new slots of ``tps``' shared keys (fp32 master, and
        the compute-dtype copy when separate); hand the result to :meth:`publish`."""
        like = {}
        for tp in tps:
            like[tp.master_key] = torch.empty(tp.param.shape, dtype=torch.float32, device="meta")
            if tp.has_master:
                like[tp.key] = torch.empty(tp.param.shape, dtype=tp.param.dtype, device="meta")
        self.counters.requests += 1
        return self.client.reserve_async(like)

    def publish(self, pairs: list[tuple[str, torch.Tensor]], reserved=None) -> None:
        """Write new versions of shared keys: reserve (unless ``reserved``, from
        :meth:`reserve_shared`), copy (after the compute stream on a device),
        publish once the copy has landed. Reserved keys not written are given back."""
        keys = tuple(k for k, _ in pairs)
        if reserved is None:
            self.counters.requests += 1
            reserved = self.client.reserve_async(dict(pairs))
        t0 = time.perf_counter()
        placed = {lease.key: lease.tensor for lease in reserved.result()}
        self.counters.wait_seconds += time.perf_counter() - t0
        unused = [k for k in placed if k not in dict(pairs)]
        if unused:
            self.client.abort(unused)
        on_device = [(placed[k], t) for k, t in pairs if t.device.type != "cpu"]
        for k, t in pairs:
            if t.device.type == "cpu":
                placed[k].copy_(t)
        copy = (self.copy.copy_out_many(on_device, keys) if on_device
                else InflightCopy((), (), keys, None))
        self.releases.add_publish(copy)

    def finish_update(self) -> None:
        """The end of ``opt.step()`` on every rank ([Note: when an update is
        visible] in tierd.client.distributed)."""
        if self.ranks is None:
            return
        self.settle()
        self.leases.confirm_publishes()
        self.ranks.barrier("the end of opt.step()")
        self.leases.renew_shared()
        stale = [tp for tp in self.params.values()
                 if tp.resident and tp.param.requires_grad and not self.owns(tp)]
        if stale:
            values = self.client.get_many([tp.key for tp in stale])
            for tp in stale:
                self.refresh_resident(tp, values[tp.key])

    # ------------------------------------------------------------- values
    def zero_grad(self, tps: list[TieredParam] | None = None) -> None:
        """Forget accumulated gradients (the next backward overwrites them).

        The host does not wait here for copies still landing: every later
        read of a key waits for its last write on the device (the copy
        stream's write events), and reads by the host settle first."""
        self.grads.flush()
        for tp in self.params.values() if tps is None else tps:
            tp.grad_in_pool = False
            tp.grad_norm = None

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """New CPU tensors with the stored bytes of this session's keys."""
        self.settle()
        keys = list(dict.fromkeys(keys))
        self.leases.acquire(keys)
        try:
            return {k: v.clone() for k, v in self.leases.views(keys).items()}
        finally:
            self.leases.release(keys)

    def read_values(self, tps: list[TieredParam]) -> dict[TieredParam, torch.Tensor]:
        """Current values (fp32 master if any), as new CPU tensors in the original dtype."""
        got = self.read([tp.master_key for tp in tps])
        return {tp: got[tp.master_key].to(tp.orig_dtype) for tp in tps}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated fp32 gradients by parameter name (for inspection)."""
        self.grads.flush()
        with_grad = [tp for tp in self.params.values() if tp.grad_in_pool]
        got = self.read([tp.grad_key for tp in with_grad])
        return {tp.name: got[tp.grad_key] for tp in with_grad}

    def fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """Replace ``module``'s empty parameter entries with their stored values."""
        wanted = {prefix + attr: p.tiered for attr, p in module._parameters.items()
                  if isinstance(p, TieredParameter) and prefix + attr in state_dict}
        if not wanted:
            return
        values = self.read_values(list(dict.fromkeys(wanted.values())))
        for entry, tp in wanted.items():
            state_dict[entry] = values[tp].to(tp.orig_device)

    def refresh_resident(self, tp: TieredParam, value: torch.Tensor) -> None:
        """The optimizer changed a resident parameter: update its device copy."""
        with torch.no_grad():
            tp.param.data.copy_(value)

    def is_attached_param(self, p: nn.Parameter) -> bool:
        return isinstance(p, TieredParameter) and p.tiered.name in self.params \
            and self.params[p.tiered.name] is p.tiered
