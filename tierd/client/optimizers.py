"""What an attached model knows of the optimizers whose state lives in tierd:
the marker of such an optimizer, and the interface of the update engine
(``tierd.updates``) that the session and the placer ask what they need.

A leaf module (it imports no part): ``tierd.optim`` builds on the engine and
on ``tierd.client``, the engine on ``tierd.client``'s leaves, and the client
reaches both only through what is declared here, so neither package imports
the other's upper modules (tests/test_imports.py).

Example:
    >>> from tierd.client.optimizers import TierdOptimizer, UnitState
    >>> UnitState(state_bytes=12, moment_bytes=8, grad_bytes=4).moment_bytes
    8
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from tierd.client.placement import Costs

#: a unit's parameters with at most this fraction of its largest one's
#: elements are small: their state stays on the device while their weights
#: are ([Note: small state stays on the device] in tierd.updates.fused); a
#: trainable one this small beside a frozen one is an adapter
#: ([Note: adapters stay on the device] in tierd.client.registry)
SMALL_SHARE = 64


class TierdOptimizer:
    """Marker base of the optimizers whose master weights and moments live in
    tierd (``tierd.optim.StreamedOptimizer``): a torch optimizer's ``step()``
    over an attached model is refused unless it is one, or wraps one
    (``tierd.client.hooks``)."""


@dataclass(frozen=True)
class UnitState:
    """The optimizer state of a unit's buckets, in bytes."""

    #: masters and moments, as stored (what placement keeps on the device; a
    #: master that is the compute copy itself counts with the weights)
    state_bytes: int
    #: of which the moments (the store holds the masters with the weights)
    moment_bytes: int
    #: stored gradients (what a CPU update copies out)
    grad_bytes: int
    #: of ``state_bytes``: what stays on the device while the unit's weights
    #: do ([Note: small state stays on the device] in tierd.updates.fused)
    weights_state_bytes: int = 0


class StateSizes(Protocol):
    """The sizes of an optimizer's state in a compact setting
    (``tierd.optim.CompactState``), for what attach counts before the
    optimizer exists (``AttachConfig.optimizer_state``)."""

    def master_in_compute(self, param: Any) -> bool:
        """A trainable ``param`` (shape and compute dtype) keeps no fp32 master."""

    def moment_nbytes(self, param: Any) -> int:
        """Bytes of one stored moment of ``param``."""


class UpdateEngine(Protocol):
    """The update engine of one attached model, as its session and placer see
    it: every optimizer's updates together (``tierd.updates.engine``).

    Example:
        >>> engine.place(resident, on_host=[])   # doctest: +SKIP
        >>> engine.resident_bytes()              # doctest: +SKIP
    """

    def trains(self) -> bool:
        """An optimizer updates this model's parameters."""

    def between_windows(self) -> bool:
        """No accumulation window is half-way (no backward since its ``step()``)."""

    def fused_backwards(self) -> int:
        """Backwards that ran fused updates, all told."""

    def update_window(self) -> int:
        """Most device bytes the fused updates hold at once in a backward,
        resident state aside ([Note: the update window] in tierd.client.placer)."""

    def unit_state(self, members: Iterable[Any]) -> UnitState:
        """The state of the buckets made only of ``members`` (TieredParams)."""

    def stored_state_bytes(self) -> int:
        """Bytes of optimizer state that exists now (made: in the store, or on
        the device until written back) besides the masters the weights count."""

    def master_bytes(self, tps: Iterable[Any]) -> int:
        """Store bytes of the fp32 masters of ``tps`` (TieredParams): none where
        the compute copy is the master (fp32, or an optimizer's
        ``master="bf16"``: [Note: compact optimizer state] in tierd.optim.compact)."""

    def host_choice(self) -> tuple[str, Costs | None]:
        """What the planner may do with CPU updates ([Note: choosing CPU
        updates] in tierd.client.placement)."""

    def host_measured(self) -> bool:
        """A CPU update has ended, so the host's rate is measured."""

    def place(self, resident: list, on_host: list) -> None:
        """Keep the state of ``resident``'s buckets on the device, update
        ``on_host``'s on the CPU."""

    def unplace(self, tps: list) -> None:
        """Stream the state of ``tps`` again (written to the pool first), and
        update where each optimizer's own placement says."""

    def resident_bytes(self) -> int:
        """Device bytes of the state kept resident now."""

    def can_replicate(self, tps: list) -> bool:
        """Under torch.distributed: every rank can keep ``tps`` (a unit) as replicas."""

    def replicate(self, tps: list) -> None:
        """Under torch.distributed: start replicas of ``tps`` (every rank calls this)."""

    def drop_replicas(self) -> None:
        """Stop the replicas :meth:`replicate` started."""

    def check_room_to_write_back(self) -> None:
        """CapacityError, before anything is written, when the store cannot
        take back the resident values that left it."""

    def write_kept_weights(self) -> None:
        """Write to the store the compute copies only the device has the newest of."""

    def device_masters(self, tps: list) -> dict:
        """The fp32 masters of ``tps`` that resident state holds on the device."""
