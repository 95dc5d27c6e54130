"""Where each unit's tensors live between steps: the placement planner.

Plain code (no torch, no I/O): it gets each unit's byte counts, the device
bytes it may use and the machine's copy bandwidth, and returns a place per
unit. ``tierd.client.placer`` measures and applies it.

[Note: the GPU is the first tier]
A unit's bytes can live in three places between steps:

- ``STREAM``: compute copy, fp32 master and optimizer moments in the pool.
  Every step copies the compute copy in for forward and for backward (unless
  cast from the fetched master), the master and moments in for the update,
  and master, moments and the new compute copy out: the PCIe bytes of
  :meth:`UnitBytes.streamed`. No device bytes between steps.
- ``WEIGHTS``: the compute copy stays on the device; master and moments still
  stream for the update (the update refreshes the device copy in place).
  Costs the compute copy's bytes, saves its three crossings.
- ``RESIDENT``: compute copy, master and moments stay on the device; the
  update runs there with no PCIe traffic. Costs all the unit's bytes.

What a step costs is the larger of its compute and its PCIe time, so every
byte kept off PCIe helps until PCIe hides under compute, and never hurts.
The planner therefore spends the device bytes where they save the most
PCIe bytes per device byte: each unit's move to ``WEIGHTS`` (3 copies of the
compute copy saved per byte) and its move on to ``RESIDENT`` (2 copies of
master and moments saved per byte) are candidates, taken greedily by that
ratio while they fit; a unit moves to ``RESIDENT`` only through ``WEIGHTS``.
With bf16 compute (2 B/param) and AdamW (12 B/param of fp32 state) that
keeps as many units' weights as fit first, then their state. Where the whole
model fits, everything is ``RESIDENT`` and a step moves nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Place(enum.Enum):
    """Where a unit's tensors live between steps (see the Note above)."""

    STREAM = "stream"
    WEIGHTS = "weights"
    RESIDENT = "resident"


@dataclass(frozen=True)
class UnitBytes:
    """One unit's bytes: its compute copy and its optimizer state (fp32 master,
    when separate, and moments; 0 when nothing updates it on the device)."""

    index: int
    param_bytes: int
    state_bytes: int

    def device_bytes(self, place: Place) -> int:
        """Device bytes held between steps at ``place``."""
        if place is Place.STREAM:
            return 0
        if place is Place.WEIGHTS:
            return self.param_bytes
        return self.param_bytes + self.state_bytes

    def streamed(self, place: Place) -> int:
        """PCIe bytes a training step moves for this unit at ``place``, both ways."""
        if place is Place.STREAM:
            return 3 * self.param_bytes + 2 * self.state_bytes
        if place is Place.WEIGHTS:
            return 2 * self.state_bytes
        return 0


@dataclass(frozen=True)
class Placement:
    """A place per unit index, and what the plan predicts."""

    places: dict[int, Place]
    device_bytes: int       # held on the device between steps
    streamed_bytes: int     # PCIe bytes per step, both ways together

    def units_at(self, place: Place) -> list[int]:
        return [i for i, p in self.places.items() if p is place]

    def seconds(self, bandwidth: float, compute_s: float = 0.0) -> float:
        """Predicted step time: the larger of compute and the copies
        (``bandwidth`` in bytes/s, both ways together)."""
        return max(compute_s, self.streamed_bytes / bandwidth)


def plan_placement(units: list[UnitBytes], budget_bytes: int) -> Placement:
    """Places within ``budget_bytes`` of device memory that save the most PCIe
    bytes (see [Note: the GPU is the first tier]).

    Example:
        >>> units = [UnitBytes(0, 2, 12), UnitBytes(1, 2, 12)]
        >>> plan_placement(units, 28).units_at(Place.RESIDENT)
        [0, 1]
        >>> p = plan_placement(units, 16)     # both weights, then one unit's state
        >>> [p.places[0].name, p.places[1].name], p.device_bytes
        (['RESIDENT', 'WEIGHTS'], 16)
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
    places = {u.index: Place.STREAM for u in units}
    # (saved bytes per device byte, order, unit, the move)
    moves = []
    for order, u in enumerate(units):
        if u.param_bytes:
            moves.append((3.0, order, u, Place.WEIGHTS))
        if u.state_bytes:
            moves.append((2.0, order, u, Place.RESIDENT))
    moves.sort(key=lambda m: (-m[0], m[1]))
    left = budget_bytes
    for _, _, u, place in moves:
        current = places[u.index]
        if place is Place.RESIDENT and current is not Place.WEIGHTS and u.param_bytes:
            continue   # its weights did not fit: its state will not either
        cost = u.device_bytes(place) - u.device_bytes(current)
        if cost <= left:
            places[u.index] = place
            left -= cost
    return Placement(places, sum(u.device_bytes(places[u.index]) for u in units),
                     sum(u.streamed(places[u.index]) for u in units))


def smallest_budget(units: list[UnitBytes]) -> int:
    """The fewest device bytes a step needs beyond activations: the largest
    unit's compute copy and state in flight at once (everything streamed)."""
    return max((u.param_bytes + u.state_bytes for u in units), default=0)
