"""Where each unit's tensors live between steps: the placement planner.

Plain code (no torch, no I/O): it gets each unit's byte counts, the device
bytes it may use and the machine's measured costs, and returns a place per
unit. ``tierd.client.placer`` measures and applies it.

[Note: the GPU is the first tier]
A unit's bytes can live in four places between steps:

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
- ``CPU``: as ``STREAM``, but master and moments never leave the pool: the
  update runs there on the host's threads, overlapped with backward
  ([Note: CPU updates overlapped with backward] in ``tierd.updates.cpu_update``).
  A step moves the compute copy in for forward and backward and the fp32
  gradient out (:meth:`UnitBytes.streamed`), and costs host time instead.

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

[Note: spread]
Among moves that save alike (a model's blocks), units are taken from the
middle of the model outwards, halving the gaps (:func:`_spread`), so the units
kept and the units left streaming alternate through the model and each stretch
of copies has compute queued beside it. Taken in forward order, the units left
streaming are the last blocks, the first updated in backward: their copies run
in one stretch at the start of backward with the host blocked on copies out (a
fused update keeps at most twice ``prefetch_bytes`` of state on the device),
queueing none of the resident units' kernels, which run only after it (the 8B
figures: ``benchmarks/results/HISTORY.md``, "Figures behind the Notes").
Units whose weights are on the device already (``held``) come first among
moves that save alike, so a plan made again, within a different budget,
moves only the units it must: the greedy is not monotone in the budget (a
small unit taken last in a tight budget loses its place to a block in a
roomier one), and a frozen unit kept only on the device would have to be
written to the store to leave ([Note: frozen weights kept only on the
device] in ``tierd.client.kept_frozen``).

[Note: choosing CPU updates]
Device bytes are spent first, as above: they save PCIe bytes at no other
cost. Of the units left streaming, a CPU update trades PCIe bytes (with
bf16 and AdamW, 3 x 2 + 2 x 12 = 30 B/param a step, both ways together,
becomes 2 x 2 + 4 = 8: the compute copy in twice, the fp32 gradient out) for
host time (12 B/param of state read and written by the update thread). With the
step's compute, the copies and the host updates running at once, the step
takes the longest of the three (:meth:`Placement.seconds`). ``cpu="auto"``
moves streamed units to ``CPU``, the most PCIe bytes saved per byte of host
work first (among equals the larger first, then the last in forward
order: updated first in backward, needed last by the next forward, so their
host updates have the most time to finish; ties broke in forward order
before, identical blocks save alike, so the first blocks went to the host,
and 1.3B capped at 48 GB on the H200 waited 0.4-0.66 s a step at the next
forward for their updates), while each move shortens that predicted time: with a slow host
nothing moves; with slow PCIe units move until the host's time reaches the
copies'. Units holding device bytes stay where they are. The host's rate is
probed before any update ran (past the cache, but not on pool memory with
backward running beside it): after the first step that updates on the
host, the placer keeps on the CPU only the units the rate those updates
reached still pays for, the others stream (:func:`rebalance_host`, once
per input shape). The placer does not
measure the step's compute yet (``compute_s=0``), so it balances host and
PCIe time even where both would hide under compute: the host then does
work that did not shorten the step, on cores that were idle. ``cpu="all"``
(``optimizer_placement="cpu"``: every unit not resident is CPU-updated)
spends the device budget on whole units only (``WEIGHTS`` would stream the
state to the device for its update) and updates the rest on the host;
``cpu="none"`` never updates on the host.

[Note: placement within the store]
A ``RESIDENT`` unit's values leave the store ([Note: resident state leaves
the store] in ``tierd.updates.resident``); every other place keeps them there
(:attr:`UnitBytes.stored_bytes`). When the store cannot hold what the
PCIe-saving plan leaves in it (``store_bytes``), units become ``RESIDENT``
until it can, in unit order, ``WEIGHTS`` ones first (they need only their
state's bytes more), skipping those too large, taking the device bytes from
``WEIGHTS`` units, which go back to ``STREAM``, last first: a ``WEIGHTS`` unit's device bytes save
PCIe time but no store room, a ``RESIDENT`` unit's save both. If even that
cannot make the store hold the rest, the plan is returned as it is and the
placer refuses it (``Placer._check_store``).

A ``CPU`` unit's compute copy streams like a ``STREAM`` unit's rather than
staying on the device: the device bytes are already spent on the units that
save the most, and a compute copy kept on the device would have to be
refreshed from the host's result over PCIe anyway.

[Note: one budget on every rank]
Under torch.distributed every rank of a node runs the same plan within the
same budget, but with a sharded GPU tier ([Note: resident state sharded by
unit] in ``tierd.client.sharded``) a ``RESIDENT`` unit costs its ranks
different bytes: its owner holds its master and moments, the others the
fp32 values they keep of it (:attr:`UnitBytes.rank_state`). A move is taken
only where it fits on every rank, each rank's bytes counted as it holds
them, so the device bytes sharding frees are spent on more units; where
every rank holds the same (replicas, one process) this is the one budget.
:attr:`Placement.device_bytes` is the most any rank holds.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class Place(enum.Enum):
    """Where a unit's tensors live between steps (see the Notes above)."""

    STREAM = "stream"
    WEIGHTS = "weights"
    RESIDENT = "resident"
    CPU = "cpu"


_CPU_MODES = ("none", "auto", "all")
#: AdamW's two fp32 moments per trainable parameter: what a plan from sizes
#: counts (the most a ``tierd.optim`` optimizer keeps)
_MOMENT_BYTES = 8


@dataclass(frozen=True)
class UnitBytes:
    """One unit's bytes: its compute copy, its optimizer state (fp32 master,
    when separate, and moments; 0 when nothing updates it on the device) and
    its fp32 gradient (what a CPU update copies out)."""

    index: int
    param_bytes: int
    state_bytes: int
    grad_bytes: int = 0
    #: bytes its values take in the store unless RESIDENT (0: param + state bytes)
    stored_bytes: int = 0
    #: of ``param_bytes``: frozen compute copies only the device holds while
    #: the unit's weights stay there ([Note: frozen weights kept only on the
    #: device] in ``tierd.client.kept_frozen``): in the store only once it streams
    kept_bytes: int = 0
    #: under a sharded GPU tier, the state bytes each local rank holds while
    #: the unit is ``RESIDENT`` ([Note: one budget on every rank]); empty:
    #: every rank holds ``state_bytes``
    rank_state: tuple[int, ...] = ()
    #: of ``state_bytes``: what stays on the device at ``WEIGHTS`` too (its
    #: small parameters': [Note: small state stays on the device] in
    #: ``tierd.updates.fused``)
    weights_state_bytes: int = 0

    @property
    def store_bytes(self) -> int:
        """Store bytes its values take at every place but ``RESIDENT``."""
        return self.stored_bytes or self.param_bytes + self.state_bytes

    def stored_at(self, place: Place) -> int:
        """Store bytes its values take at ``place``."""
        if place is Place.RESIDENT:
            return 0
        return self.store_bytes - (self.kept_bytes if place is Place.WEIGHTS else 0)

    @classmethod
    def sized(cls, index: int, params: list[tuple[int, int, bool, bool]],
              kept_bytes: int = 0) -> "UnitBytes":
        """A unit's bytes from its parameters' sizes alone, before any
        optimizer exists ([Note: the plan before a step is measured] in
        ``tierd.client.placer``): ``params`` are (compute copy bytes, numel,
        trainable, with an fp32 master of its own). A trainable one counts
        AdamW's state (its fp32 master, two fp32 moments) and an fp32
        gradient; a frozen one its compute copy only.

        Example:
            >>> UnitBytes.sized(0, [(200, 100, True, True), (200, 100, False, False)])
            UnitBytes(index=0, param_bytes=400, state_bytes=1200, grad_bytes=400, stored_bytes=0, kept_bytes=0, rank_state=(), weights_state_bytes=0)
        """
        trained = [(numel, master) for _, numel, trainable, master in params if trainable]
        return cls(index, sum(p[0] for p in params),
                   sum(numel * (_MOMENT_BYTES + 4 * master) for numel, master in trained),
                   sum(4 * numel for numel, _ in trained), kept_bytes=kept_bytes)

    def device_bytes(self, place: Place, rank: int | None = None) -> int:
        """Device bytes held between steps at ``place`` by local rank
        ``rank`` (None: by the rank that holds the most)."""
        if place in (Place.STREAM, Place.CPU):
            return 0
        if place is Place.WEIGHTS:
            return self.param_bytes + self.weights_state_bytes
        if not self.rank_state:
            return self.param_bytes + self.state_bytes
        return self.param_bytes + (max(self.rank_state) if rank is None
                                   else self.rank_state[rank])

    def streamed(self, place: Place) -> int:
        """PCIe bytes a training step moves for this unit at ``place``, both ways."""
        if place is Place.STREAM:
            return 3 * self.param_bytes + 2 * self.state_bytes
        if place is Place.WEIGHTS:
            return 2 * (self.state_bytes - self.weights_state_bytes)
        if place is Place.CPU:
            return 2 * self.param_bytes + self.grad_bytes
        return 0

    def host_bytes(self, place: Place) -> int:
        """Optimizer state bytes the host's threads update per step at ``place``."""
        return self.state_bytes if place is Place.CPU else 0


@dataclass(frozen=True)
class Costs:
    """What the machine measured, for [Note: choosing CPU updates].

    ``copy_bytes_per_s``: PCIe bytes per second, both ways together;
    ``host_bytes_per_s``: optimizer state bytes per second the host's update
    threads get through; ``compute_s``: the step's compute (0: unknown)."""

    copy_bytes_per_s: float
    host_bytes_per_s: float
    compute_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("copy_bytes_per_s", "host_bytes_per_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f}={getattr(self, f)} must be > 0 (bytes per second)")
        if self.compute_s < 0:
            raise ValueError(f"compute_s={self.compute_s} must be >= 0 (0: unknown)")


@dataclass(frozen=True)
class Placement:
    """A place per unit index, and what the plan predicts."""

    places: dict[int, Place]
    device_bytes: int       # held on the device between steps
    streamed_bytes: int     # PCIe bytes per step, both ways together
    host_bytes: int = 0     # optimizer state updated on the host per step

    def units_at(self, place: Place) -> list[int]:
        return [i for i, p in self.places.items() if p is place]

    def seconds(self, bandwidth: float, compute_s: float = 0.0,
                host_bytes_per_s: float = float("inf")) -> float:
        """Predicted step time: the longest of compute, the copies
        (``bandwidth`` in bytes/s, both ways together) and the host's updates."""
        return max(compute_s, self.streamed_bytes / bandwidth,
                   self.host_bytes / host_bytes_per_s)


def plan_placement(units: list[UnitBytes], budget_bytes: int, *, cpu: str = "none",
                   costs: Costs | None = None, store_bytes: int | None = None,
                   held: frozenset[int] = frozenset()) -> Placement:
    """Places within ``budget_bytes`` of device memory that save the most PCIe
    bytes (see [Note: the GPU is the first tier]); ``cpu`` ("none", "auto"
    with ``costs``, "all") says which streamed units update on the host
    ([Note: choosing CPU updates]); ``store_bytes``: what the units not
    resident may take in the store ([Note: placement within the store]);
    ``held``: units whose weights are on the device now, first among moves
    that save alike ([Note: spread]).

    Example:
        >>> units = [UnitBytes(0, 2, 12), UnitBytes(1, 2, 12)]
        >>> plan_placement(units, 28).units_at(Place.RESIDENT)
        [0, 1]
        >>> p = plan_placement(units, 16)     # both weights, then one unit's state
        >>> [p.places[0].name, p.places[1].name], p.device_bytes
        (['WEIGHTS', 'RESIDENT'], 16)
        >>> plan_placement(units, 14, cpu="all").units_at(Place.CPU)
        [0]
    """
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be >= 0")
    if cpu not in _CPU_MODES:
        raise ValueError(f"cpu={cpu!r}; use one of {_CPU_MODES}")
    if cpu == "auto" and costs is None:
        raise ValueError("cpu='auto' needs the measured costs (costs=Costs(...))")
    places = _place_on_device(units, budget_bytes, whole=cpu == "all", held=held)
    if store_bytes is not None:
        _fit_store(units, places, budget_bytes, store_bytes)
    if cpu == "all":
        places.update({u.index: Place.CPU for u in units
                       if places[u.index] is Place.STREAM and u.state_bytes})
    elif cpu == "auto":
        _move_to_host(units, places, costs)
    return _placement(units, places)


def _placement(units: list[UnitBytes], places: dict[int, Place]) -> Placement:
    return Placement(places, max(_held_by_rank(units, places)),
                     sum(u.streamed(places[u.index]) for u in units),
                     sum(u.host_bytes(places[u.index]) for u in units))


def _ranks(units: list[UnitBytes]) -> int:
    """Local ranks the units' bytes are counted for ([Note: one budget on every rank])."""
    return max((len(u.rank_state) for u in units), default=0) or 1


def _held_by_rank(units: list[UnitBytes], places: dict[int, Place]) -> list[int]:
    """Device bytes each local rank holds at ``places``."""
    return [sum(u.device_bytes(places[u.index], r if u.rank_state else None) for u in units)
            for r in range(_ranks(units))]


def _costs(u: UnitBytes, place: Place, current: Place, ranks: int) -> list[int]:
    """Device bytes each local rank adds moving ``u`` from ``current`` to ``place``."""
    return [u.device_bytes(place, r if u.rank_state else None)
            - u.device_bytes(current, r if u.rank_state else None) for r in range(ranks)]


def grow_placement(units: list[UnitBytes], plan: Placement, budget_bytes: int, *,
                   whole: bool = False) -> Placement:
    """``plan`` with the device bytes ``budget_bytes`` has beyond it spent by
    the same greedy: no unit moves down, and units updated on the CPU stay
    there (``whole``: the plan was made with ``cpu="all"``).

    Example:
        >>> units = [UnitBytes(0, 2, 12), UnitBytes(1, 2, 12)]
        >>> small = plan_placement(units, 4)            # both units' weights
        >>> sorted(p.name for p in grow_placement(units, small, 18).places.values())
        ['RESIDENT', 'WEIGHTS']
    """
    places = _place_on_device(units, budget_bytes, whole=whole, start=plan.places)
    return _placement(units, places)


def weights_of(units: list[UnitBytes], plan: Placement) -> Placement:
    """``plan`` with its ``RESIDENT`` units at ``WEIGHTS``: what holds before
    any optimizer state exists ([Note: the plan before a step is measured]
    in ``tierd.client.placer``).

    Example:
        >>> units = [UnitBytes(0, 2, 12), UnitBytes(1, 2, 12)]
        >>> [p.name for p in weights_of(units, plan_placement(units, 16)).places.values()]
        ['WEIGHTS', 'WEIGHTS']
    """
    return _placement(units, {i: Place.WEIGHTS if p is Place.RESIDENT else p
                              for i, p in plan.places.items()})


def rebalance_host(units: list[UnitBytes], plan: Placement, costs: Costs) -> Placement:
    """``plan`` with the units it updates on the CPU chosen again at ``costs``
    (the host's measured rate, [Note: choosing CPU updates]): those the host
    no longer pays for stream instead. No unit joins them (a CPU unit's
    gradient keys would need store room the plan was not checked for), and
    device places stay.

    Example:
        >>> units = [UnitBytes(0, 2, 12, 4), UnitBytes(1, 2, 12, 4)]
        >>> fast = plan_placement(units, 0, cpu="auto", costs=Costs(1.0, 1e9))
        >>> [p.name for p in rebalance_host(units, fast, Costs(1.0, 1e-9)).places.values()]
        ['STREAM', 'STREAM']
    """
    places = {i: Place.STREAM if p is Place.CPU else p for i, p in plan.places.items()}
    _move_to_host(units, places, costs, among=set(plan.units_at(Place.CPU)))
    return _placement(units, places)


_RANK = {Place.STREAM: 0, Place.WEIGHTS: 1, Place.RESIDENT: 2}


def _place_on_device(units: list[UnitBytes], budget_bytes: int, *, whole: bool,
                     start: dict[int, Place] | None = None,
                     held: frozenset[int] = frozenset()) -> dict[int, Place]:
    """The greedy of [Note: the GPU is the first tier]; ``whole``: a unit goes
    to ``RESIDENT`` in one move or stays streamed (no ``WEIGHTS``); ``start``:
    the places to grow from (only moves up, ``CPU`` units kept); ``held``:
    first among equals ([Note: spread])."""
    places = dict(start) if start else {u.index: Place.STREAM for u in units}
    # (saved bytes per device byte, order among equals: [Note: spread], unit, the move)
    moves = []
    for order, u in zip(_spread(len(units)), units):
        if whole:
            saved = u.streamed(Place.CPU) / max(1, u.device_bytes(Place.RESIDENT))
            moves.append((saved, order, u, Place.RESIDENT))
            continue
        if u.param_bytes:
            moves.append((3.0, order, u, Place.WEIGHTS))
        if u.state_bytes:
            moves.append((2.0, order, u, Place.RESIDENT))
    moves.sort(key=lambda m: (-m[0], m[2].index not in held, m[1]))
    ranks = _ranks(units)
    left = [budget_bytes - b for b in _held_by_rank(units, places)]
    for _, _, u, place in moves:
        current = places[u.index]
        if current is Place.CPU or _RANK[place] <= _RANK[current]:
            continue
        if not whole and place is Place.RESIDENT and current is not Place.WEIGHTS \
                and u.param_bytes:
            continue   # its weights did not fit: its state will not either
        cost = _costs(u, place, current, ranks)
        if all(c <= room for c, room in zip(cost, left)):
            places[u.index] = place
            left = [room - c for c, room in zip(cost, left)]
    return places


def _spread(n: int) -> list[int]:
    """Each of ``n`` positions' rank in an order that halves the gaps: the
    middle, then the middles of both halves, and so on, so every prefix, and
    what is left after it, lies evenly over the positions ([Note: spread])."""
    rank, gaps, k = [0] * n, deque([(0, n)]), 0
    while gaps:
        lo, hi = gaps.popleft()
        if lo < hi:
            mid = (lo + hi) // 2
            rank[mid], k = k, k + 1
            gaps += [(lo, mid), (mid + 1, hi)]
    return rank


def stored(units: list[UnitBytes], places: dict[int, Place]) -> int:
    """Store bytes the units take at ``places``."""
    return sum(u.stored_at(places[u.index]) for u in units)


def _fit_store(units: list[UnitBytes], places: dict[int, Place], budget_bytes: int,
               store_bytes: int) -> None:
    """Units to ``RESIDENT`` until the store holds the rest ([Note: placement
    within the store])."""
    candidates = [u for u in units if places[u.index] is not Place.RESIDENT and u.state_bytes]
    candidates.sort(key=lambda u: places[u.index] is not Place.WEIGHTS)
    ranks = _ranks(units)
    used = _held_by_rank(units, places)   # on each rank: [Note: one budget on every rank]
    for u in candidates:
        if stored(units, places) <= store_bytes:
            return
        need = _costs(u, Place.RESIDENT, places[u.index], ranks)
        # (a unit with kept frozen weights would need store room to give them back)
        givers = [w for w in reversed(units) if w is not u and places[w.index] is Place.WEIGHTS
                  and not w.kept_bytes]
        # (a unit's weights cost every rank alike)
        given = sum(w.device_bytes(Place.WEIGHTS) for w in givers)
        if any(b + n > budget_bytes + given for b, n in zip(used, need)):
            continue   # too large even with every kept weight given back
        while any(b + n > budget_bytes for b, n in zip(used, need)):
            w = givers.pop(0)
            places[w.index] = Place.STREAM
            used = [b - w.device_bytes(Place.WEIGHTS) for b in used]
        places[u.index] = Place.RESIDENT
        used = [b + n for b, n in zip(used, need)]


def _move_to_host(units: list[UnitBytes], places: dict[int, Place], costs: Costs, *,
                  among: set[int] | None = None) -> None:
    """Streamed units (of ``among``: all) to ``CPU`` while the predicted step
    time falls ([Note: choosing CPU updates])."""
    def seconds() -> float:
        return _placement(units, places).seconds(costs.copy_bytes_per_s, costs.compute_s,
                                                 costs.host_bytes_per_s)

    candidates = [u for u in units if places[u.index] is Place.STREAM and u.state_bytes
                  and (among is None or u.index in among)]
    # among equal savings the larger units first (fewer, coarser moves), then
    # the last in forward order: updated first in backward, needed last
    candidates.sort(key=lambda u: (-(u.streamed(Place.STREAM) - u.streamed(Place.CPU))
                                   / u.host_bytes(Place.CPU), -u.host_bytes(Place.CPU),
                                   -u.index))
    now = seconds()
    for u in candidates:
        places[u.index] = Place.CPU
        after = seconds()
        if after < now:
            now = after
        else:
            places[u.index] = Place.STREAM


class MeasuredShapes:
    """The root inputs' shapes of the steps measured, each with the largest
    non-model peak seen at it ([Note: measuring the step for placement] in
    ``tierd.client.placer``): a plan is made for the largest, and a step at
    shapes no larger than one measured (the same tensors, every dimension
    at most its) needs no new measurement.

    Example:
        >>> shapes = MeasuredShapes()
        >>> shapes.record(((8, 1024),), 30); shapes.record(((16, 512),), 20)
        >>> shapes.covers(((8, 512),)), shapes.covers(((16, 1024),)), shapes.peak()
        (True, False, 30)
        >>> shapes.covers(((8, 1100),)), shapes.covers(((8, 1100),), slack=1 / 8)
        (False, True)
        >>> shapes.record(((8, 1024),), 25); shapes.peak()   # 30 was no estimate: kept
        30
        >>> shapes.record(((4, 64),), 90, estimated=True); shapes.record(((4, 64),), 10)
        >>> shapes.peak()
        30
    """

    def __init__(self) -> None:
        self._peaks: dict[tuple, int] = {}
        self._estimated: set[tuple] = set()   # peaks with an update window assumed

    def record(self, signature: tuple, peak: int, *, estimated: bool = False) -> None:
        """The largest peak measured at ``signature``; ``estimated``: with the
        update window assumed ([Note: the update window]), replaced by the
        first peak measured with the update."""
        if estimated and signature in self._peaks and signature not in self._estimated:
            return
        if not estimated and signature in self._estimated:
            self._estimated.discard(signature)
            self._peaks[signature] = peak
            return
        if estimated:
            self._estimated.add(signature)
        self._peaks[signature] = max(peak, self._peaks.get(signature, 0))

    def covers(self, signature: tuple, slack: float = 0.0) -> bool:
        """Whether a shape measured is at least ``signature`` in every
        dimension (within a fraction ``slack`` of it)."""
        return any(len(s) == len(signature) and all(
            len(a) == len(b) and all(x <= y * (1 + slack) for x, y in zip(b, a))
            for a, b in zip(s, signature)) for s in self._peaks)

    def peak(self) -> int:
        return max(self._peaks.values(), default=0)
