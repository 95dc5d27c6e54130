"""Telling the daemon the step's order of use, so it reads ahead.

While an attached model's values exceed the daemon's pool, the mover's
learned order (:class:`~tierd.client.planner.PrefetchPlanner`) goes to the
daemon as the job's access plan, the keys each position of the step leases,
and each use tells it the position reached ([Note: the job's access plan]
in ``tierd.server.readahead``). Plain code over the store's two requests;
both are hints, sent without waiting for a reply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierd.client.planner import PlanState, PrefetchPlanner


class AccessPlanSender:
    """The plan the daemon has for this model, and the step count on it.

    ``name``: the plan's, unique in the job (the model's key prefix);
    ``spills``: whether the model's values exceed the pool now (else no plan
    is kept: the pool holds everything and nothing is read from NVMe).

    Example:
        >>> from tierd.client.store import LocalStore
        >>> store = LocalStore()
        >>> sender = AccessPlanSender(store, "m", spills=lambda: True)
        >>> p = PrefetchPlanner({0: 1, 1: 1}, depth_bytes=1)
        >>> _ = p.begin_step(); _ = [p.on_use(u) for u in (0, 1)]
        >>> class U:
        ...     def __init__(self, keys): self.params = [type("P", (), {"key": k}) for k in keys]
        >>> units = [U(["a"]), U(["b", "c"])]
        >>> _ = p.begin_step(); sender.begin_step(p, units); _ = p.on_use(0); sender.use(p)
        >>> store.plans, store.uses
        ([('m', [('a',), ('b', 'c')])], [0])
    """

    def __init__(self, store, name: str, spills: Callable[[], bool]) -> None:
        self._store = store
        self.name = name
        self._spills = spills
        self._sent: tuple[tuple[str, ...], ...] | None = None   # the daemon's plan
        self._steps = 0   # steps begun on it since it was sent

    def begin_step(self, planner: PrefetchPlanner, units: Sequence) -> None:
        """A step begins: send the plan if the order or its keys changed."""
        if planner.state is not PlanState.FOLLOWING:
            return   # learning or re-learning: the old plan stands until then
        if not self._spills():
            self.close()
            return
        positions = tuple(tuple(tp.key for tp in units[u].params) for u in planner.trace)
        if positions == self._sent:
            self._steps += 1
            return
        self._store.use_plan_async(self.name, positions)
        self._sent, self._steps = positions, 0

    def use(self, planner: PrefetchPlanner) -> None:
        """The planner matched a use: tell the daemon where the step is."""
        if self._sent is None or planner.state is not PlanState.FOLLOWING:
            return
        self._store.use_at_async(self.name, self._steps * len(self._sent) + planner.position)

    def close(self) -> None:
        """Forget the plan (the model detaches, or fits the pool now)."""
        if self._sent is not None:
            self._store.use_plan_async(self.name, [])
            self._sent = None
