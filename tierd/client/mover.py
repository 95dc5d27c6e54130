"""The mover: brings units' parameters onto the compute device and frees them.

It owns every decision about *when* a parameter's bytes move (the reasoning
is [Note: units and when parameters are resident] in
``tierd.client.attached``): on-demand swap-in (:meth:`Mover.require`),
prefetch in the order the planner learned, within ``gpu_budget_bytes`` of
parameters on the device, frees after use, and the new values the optimizer
keeps on the device for the next step. Transitions of a single parameter are
:class:`TieredParam`'s own methods; the mover decides which to call.

[Note: the device budget]
``_device_bytes`` counts the bytes of parameter storage the mover has
allocated and not freed. Prefetched copies start only while it stays within
``gpu_budget_bytes``; the unit running now is always fetched, even above it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierd.client.copy_stream import CopyStream
from tierd.client.leases import LeaseTable
from tierd.client.planner import PrefetchPlanner
from tierd.client.registry import ParamRegistry, Unit
from tierd.client.releases import PendingReleases
from tierd.client.tiered_param import ParamState, TieredParam
from tierd.errors import CapacityError


@dataclass(frozen=True, kw_only=True)
class MoverConfig:
    """How much the mover may keep on the device and lease ahead."""

    #: Most bytes of parameters on the compute device for prefetch.
    gpu_budget_bytes: int
    #: Bytes of upcoming units whose leases are asked for ahead of use.
    prefetch_bytes: int


class Mover:
    """Parameter movement of one attached model (see the module docstring).

    ``optimizers`` is the session's list of fused updaters: the mover asks
    them whether a parameter's fp32 master is (or is about to be) on the
    device, to cast it instead of copying the stored compute copy in.

    Example:
        >>> mover.observe(unit); mover.require(unit)    # doctest: +SKIP
        >>> mover.release_after_forward(unit, task=-1)  # doctest: +SKIP
    """

    def __init__(self, registry: ParamRegistry, config: MoverConfig, *, copy: CopyStream,
                 leases: LeaseTable, releases: PendingReleases, counters,
                 optimizers: list, plans=None) -> None:
        self.registry = registry
        self.config = config
        self.copy = copy
        self.leases = leases
        self.releases = releases
        self.counters = counters
        self.optimizers = optimizers
        self.planner = self._new_planner()
        self._holds: dict[TieredParam, int] = {}     # forward calls using it now
        self._in_backward: dict[int, int] = {}   # unit index -> its backwards begun, not ended
        self._leased: set[TieredParam] = set()       # leases asked for, not copied
        self._announced: list[TieredParam] = []      # prefetched, copy not started
        self._device_bytes = 0                       # [Note: the device budget]
        self._requiring: Unit | None = None          # the unit :meth:`require` is making usable
        # new values kept on the device for the next step's first units
        # ([Note: new values kept for the next step] in tierd.updates.fused)
        self._kept: set[TieredParam] = set()
        self._kept_bytes = 0
        self._head: tuple[int, set[TieredParam]] = (-1, set())   # (step, first params)
        # the daemon's read-ahead ([Note: the job's access plan] in tierd.server.readahead)
        self.plans = plans

    def _new_planner(self, trace: tuple[int, ...] = ()) -> PrefetchPlanner:
        return PrefetchPlanner({u.index: u.nbytes for u in self.registry.units},
                               self.config.prefetch_bytes, trace)

    def replan(self, *, keep_trace: bool = False) -> None:
        """A fresh planner over the current units' bytes: it learns the order
        again (units were folded) or, with ``keep_trace``, follows the one it
        learned (the units' bytes changed, not their order: placement). Units
        left with nothing to move (placed whole on the device) leave the
        trace: their hooks no longer call in; units streamed again join it
        where they are used ([Note: units new to the trace] in
        ``tierd.client.planner``)."""
        units = self.registry.units
        trace = tuple(i for i in self.planner.learned if units[i].params) if keep_trace else ()
        self.planner = self._new_planner(trace)

    # ------------------------------------------------------------- steps
    def begin_step(self) -> None:
        """A new step: kept values are in use from now on (freed after use like
        the rest); fetch the first units of the learned order, and the state
        of the optimizers' first updates waiting for this forward (the
        updates start at the first unit's forward)."""
        self._kept.clear()
        self._kept_bytes = 0
        first = self.planner.begin_step()
        if self.plans is not None:
            self.plans.begin_step(self.planner, self.registry.units)
        self._prefetch(first)
        for opt in self.optimizers:   # [Note: updates before the next forward] in
            opt.in_forward.begin()    # tierd.updates.forward

    def observe(self, unit: Unit) -> None:
        """``unit`` is used now: tell the planner, start what it announces."""
        announced = self.planner.on_use(unit.index)
        if self.plans is not None:
            self.plans.use(self.planner)
        self._prefetch(announced)

    def hold(self, unit: Unit) -> None:
        """A forward of ``unit`` begins: its parameters stay until it ends."""
        for tp in unit.params:
            self._holds[tp] = self._holds.get(tp, 0) + 1
        self.require(unit)

    def release_after_forward(self, unit: Unit, task: int) -> None:
        """A forward of ``unit`` ended. Outside backward (``task == -1``) its
        parameters are freed; in a forward re-run inside backward they stay
        until backward task ``task`` is done with them."""
        for tp in unit.params:
            left = self._holds.get(tp, 1) - 1
            if left > 0:
                self._holds[tp] = left
                continue
            self._holds.pop(tp, None)
            if task != -1:
                tp.backward_task = tp.backward_task if tp.backward_task != -1 else task
            elif tp.state is ParamState.DEVICE:
                self._free(tp)
        self._start_announced()

    def enter_backward(self, unit: Unit, task: int) -> None:
        """The first gradient of ``unit``'s outputs arrived in backward ``task``."""
        self.require(unit)
        self._in_backward[unit.index] = self._in_backward.get(unit.index, 0) + 1
        for tp in unit.params:
            if tp.backward_task == -1:
                tp.backward_task = task

    def after_backward(self, unit: Unit) -> None:
        """The gradients of ``unit``'s inputs are computed: once every backward
        of it that began has ended, its frozen parameters go ([Note: frozen
        parameters freed after their unit's backward] in tierd.client.attached)."""
        left = self._in_backward.get(unit.index, 0)
        if left == 0:
            return   # no pre-backward of it counted: the backward's end frees it
        if left > 1:
            self._in_backward[unit.index] = left - 1
            return
        del self._in_backward[unit.index]
        for tp in unit.params:
            if not tp.param.requires_grad and tp.backward_task != -1:
                self.done_with(tp)

    def done_with(self, tp: TieredParam) -> None:
        """Autograd accumulated ``tp``'s gradient: free it unless a forward holds it."""
        if tp.state is ParamState.DEVICE and not tp.resident and self._holds.get(tp, 0) == 0:
            self._free(tp)

    def free_task(self, task: int, *, outermost: bool = True) -> None:
        """Backward task ``task`` ended: free what it brought in."""
        for tp in self.registry.params.values():
            if tp.backward_task == task:
                self.done_with(tp)
        if outermost:
            self._in_backward.clear()

    # ------------------------------------------------------------- movement
    def require(self, unit: Unit) -> None:
        """Make every parameter of ``unit`` usable on the compute device."""
        self._requiring = unit
        try:
            self._require(unit)
        finally:
            self._requiring = None

    def _require(self, unit: Unit) -> None:
        for tp in unit.params:   # a failed prefetch falls back to on-demand
            if tp in self._leased and self.leases.view(tp.key) is None:
                self._drop_lease(tp)
        on_demand = [tp for tp in unit.params
                     if tp.state is ParamState.HOST and tp not in self._leased]
        if on_demand:
            self._lease(on_demand)
            self._leased_views([tp.key for tp in on_demand])
        for tp in unit.params:
            if tp.state is ParamState.HOST:
                self._start_swap_in(tp)
        for tp in unit.params:
            if tp.state is ParamState.H2D_INFLIGHT:
                tp.finish_swap_in(self.copy)
        self.releases.drain()

    def _leased_views(self, keys: list[str]) -> None:
        """Wait for the leases of ``keys`` (acquired); if the pool had no room,
        ask once more after :meth:`give_back_ahead` (a 6 MiB pool refused a
        1 MiB weight at its backward with 1.8 MB free)."""
        try:
            self.leases.views(keys)
            return
        except CapacityError:
            if not self.give_back_ahead():
                raise
        self.leases.release(keys)   # the failed request's references
        self.leases.acquire(keys)
        self.leases.views(keys)

    def give_back_ahead(self) -> bool:
        """Give back every lease of this session held ahead of need, once its
        copies have landed: prefetched parameters whose copy has not started
        (but the unit being required now's) and the optimizers' ([Note: a
        fetch that finds no room] in tierd.updates.fused). False if there was
        none: a request that found no room then fails."""
        keep = set(self._requiring.params) if self._requiring is not None else set()
        ahead = [tp for tp in self._leased if tp not in keep]
        givers = [opt for opt in self.optimizers if opt.holds_ahead()]
        if not ahead and not givers:
            return False
        for tp in ahead:   # asked again when their unit is used
            self._drop_lease(tp)
        for opt in givers:
            opt.give_back_ahead()
        self.releases.drain(block=True)
        return True

    def settle(self, *, synchronize: bool) -> None:
        """Bring every parameter back to rest: freed, no lease pending; with
        ``synchronize`` no value is kept for the next step either."""
        if synchronize:
            self._kept.clear()
            self._kept_bytes = 0
        self._announced.clear()
        for tp in self.registry.params.values():
            if tp.state is ParamState.H2D_INFLIGHT:
                tp.finish_swap_in(self.copy)
            self.done_with(tp)
        for tp in list(self._leased):   # prefetched but never used: give them back
            self._drop_lease(tp)

    def _prefetch(self, unit_ids: list[int]) -> None:
        units = self.registry.units
        wanted = list(dict.fromkeys(
            tp for i in unit_ids for tp in units[i].params
            if tp.state is ParamState.HOST and tp not in self._leased))
        if not wanted:
            return
        self._lease(wanted)
        self._announced.extend(wanted)
        self._start_announced()

    def _start_announced(self) -> None:
        """Start copies of prefetched parameters while the GPU budget allows."""
        budget = self.config.gpu_budget_bytes
        while self._announced:
            tp = self._announced[0]
            if tp.state is not ParamState.HOST or tp not in self._leased:
                self._announced.pop(0)
                continue
            if self.leases.view(tp.key) is None:
                self._announced.pop(0)
                self._drop_lease(tp)
                continue
            if self._device_bytes + tp.nbytes > budget:
                return
            if any(opt.will_fetch(tp) for opt in self.optimizers):
                return   # made from its master once fetched (tierd.updates.fused)
            self._announced.pop(0)
            self._start_swap_in(tp)

    def _lease(self, tps: list[TieredParam]) -> None:
        self.leases.acquire([tp.key for tp in tps])
        self._leased.update(tps)

    def _drop_lease(self, tp: TieredParam) -> None:
        self._leased.discard(tp)
        self.leases.release([tp.key])

    def _start_swap_in(self, tp: TieredParam) -> None:
        for opt in self.optimizers:   # a CPU update may still write its compute copy
            opt.host.wait_for(tp)
        self._leased.discard(tp)
        for opt in self.optimizers:
            master = opt.fetched_master(tp)
            if master is not None:
                # [Note: compute copy from the fetched master] in tierd.updates.fused
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

    # ------------------------------------------------------------- kept values
    def keep_new_value(self, tp: TieredParam, value: torch.Tensor, step: int) -> None:
        """The optimizer made ``tp``'s new compute value on the device: keep it
        there if the next step uses ``tp`` first and the budget allows
        ([Note: new values kept for the next step] in tierd.updates.fused).
        Only on CUDA: on the CPU there is no copy to save, and parameters
        hold no storage between steps."""
        if not self.copy.on_device or tp.state not in (ParamState.HOST, ParamState.DEVICE):
            return
        if self._head[0] != step:   # which params come first, once a step
            units = self.registry.units
            self._head = (step, {p for i in self.planner.head() for p in units[i].params})
        budget = self.config.gpu_budget_bytes
        if tp not in self._head[1] or tp in self._kept or self._kept_bytes + tp.nbytes > budget:
            return
        with torch.no_grad():
            if tp.state is ParamState.DEVICE:   # still here from its backward
                tp.compute.copy_(value)
            elif self._device_bytes + tp.nbytes <= budget:
                tp.adopt(value)
                self._device_bytes += tp.nbytes
            else:
                return
        self._kept.add(tp)
        self._kept_bytes += tp.nbytes
