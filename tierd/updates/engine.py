"""The update engine of one attached model: its optimizers' updates together,
as the session and the placer ask for them
(:class:`tierd.client.optimizers.UpdateEngine`).

Each ``tierd.optim`` optimizer registers its :class:`~tierd.updates.fused.FusedUpdates`
in the session's ``optimizers`` list; this object answers over all of them,
so the client never reads a bucket, a fused update or an optimizer's state.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierd.client.optimizers import UnitState
from tierd.client.placement import Costs
from tierd.updates.buckets import update_window
from tierd.updates.cpu_update import host_choice
from tierd.updates.replica import ReplicaUpdates, can_replicate, drop_replicas, replicate
from tierd.updates.resident import check_room_to_write_back, device_values, write_kept_weights


class SessionUpdates:
    """Every optimizer update of one attached model (``session.optimizers``),
    behind the interface its session and placer use.

    Example:
        >>> updates = SessionUpdates(session)         # doctest: +SKIP
        >>> updates.place(resident, on_host=[])       # doctest: +SKIP
        >>> updates.resident_bytes()                  # doctest: +SKIP
    """

    def __init__(self, session) -> None:
        self._session = session
        self._replicas: list[ReplicaUpdates] = []   # under ranks: others' units kept here

    @property
    def _updates(self) -> list:
        return self._session.optimizers

    # ------------------------------------------------------------- steps
    def trains(self) -> bool:
        return bool(self._updates)

    def between_windows(self) -> bool:
        return all(f.backwards == 0 for f in self._updates)

    def fused_backwards(self) -> int:
        return sum(f.fused_backwards for f in self._updates)

    def update_window(self) -> int:
        return sum(update_window(f.buckets, f.prefetch_bytes)
                   for f in self._updates if f.fusing)

    # ------------------------------------------------------------- sizes
    def unit_state(self, members: Iterable) -> UnitState:
        members = set(members)

        def buckets(f) -> list:   # the buckets of f with a parameter among members
            return list({id(b): b for tp in members
                         if (b := f.bucket_of.get(tp)) is not None}.values())

        mine = [(f, b) for f in self._updates for b in buckets(f)
                if all(tp in members for tp in b.tps)]

        def state(f, b) -> int:   # (a master that is the compute copy adds nothing)
            return sum(f.opt.state_nbytes(tp) - f.opt.master_in_compute(tp)
                       * f.opt.master_nbytes(tp) for tp in b.tps)

        return UnitState(
            state_bytes=sum(state(f, b) for f, b in mine),
            moment_bytes=sum(f.opt.moment_nbytes(tp) for f, b in mine for tp in b.tps),
            grad_bytes=sum(b.grad_bytes for _, b in mine),
            weights_state_bytes=sum(state(f, b) for f, b in mine if b.small))

    def stored_state_bytes(self) -> int:
        # each optimizer's moments of its parameters, less its state not made yet
        # ([Note: state made when first needed] in tierd.optim.state)
        total = 0
        for f in self._updates:
            tps = list(f.bucket_of)
            total += sum(f.opt.moment_nbytes(tp) for tp in tps)
            total -= f.opt.unmade.nbytes(tps)
        return total

    def master_bytes(self, tps: Iterable) -> int:
        # an fp32 master of its own, unless an optimizer keeps the compute
        # copy as the master ([Note: compact optimizer state] in tierd.optim.compact)
        def own_master(tp) -> bool:
            return tp.has_master and not any(tp in f.bucket_of and f.opt.master_in_compute(tp)
                                             for f in self._updates)

        return sum(4 * tp.param.numel() for tp in tps if own_master(tp))

    def resident_bytes(self) -> int:
        sharded = self._sharded()
        return sum(f.resident_bytes() for f in self._updates) + (
            0 if sharded is None else sharded.kept_bytes())

    def _sharded(self):
        """The sharded GPU tier's part on this rank (``tierd.client.sharded``), if any."""
        share = self._session.share
        return None if share is None else share.sharded

    # ------------------------------------------------------------- placement
    def host_choice(self) -> tuple[str, Costs | None]:
        return host_choice(self._updates)

    def host_measured(self) -> bool:
        return any(f.host.seconds for f in self._updates)

    def place(self, resident: list, on_host: list) -> None:
        for f in self._updates:
            f.pin(resident)   # a bucket pinned already stays as it is
            f.host.place(on_host)

    def unplace(self, tps: list) -> None:
        for f in self._updates:
            f.unpin(tps)
            f.host.place(None)   # back to the optimizer's own placement

    def can_replicate(self, tps: list) -> bool:
        if self._sharded() is not None:   # the owner updates, in backward or in step()
            return True
        return can_replicate(self._session, tps)

    def replicate(self, tps: list) -> None:
        if self._sharded() is not None:   # owners alone keep the state
            return
        self._replicas = replicate(self._session, tps)

    def drop_replicas(self) -> None:
        drop_replicas(self._session, self._replicas)
        self._replicas = []

    # ------------------------------------------------------------- the store
    def check_room_to_write_back(self) -> None:
        check_room_to_write_back(self._session)

    def write_kept_weights(self, tps: list | None = None) -> None:
        write_kept_weights(self._session, tps)

    def device_masters(self, tps: list) -> dict:
        out = device_values(self._session, tps)
        sharded = self._sharded()
        if sharded is not None:   # others' units: the values their owners sent
            out.update(sharded.masters(tps))
        return out
