"""Gradients the measuring step keeps on the compute device, and what of them
the first update reads there.

[Note: the measuring step keeps its gradients on the device]
The first step runs the plan estimated from sizes ([Note: the plan before a
step is measured] in tierd.client.placer), which keeps some units' compute
copies on the GPU, and its update comes in ``step()``, after the backward.
Sending every gradient to the store there cost the most of any step: on the
H200 a 13.2B Llama sent 52.9 GB of fp32 gradients to a pool that held the
masters too, 52.7 GB of it on to NVMe, and read them back for the update
(a 90.6 s first step against 1.8 s steady). So while the placer says so
(``hold``: from the estimate until the measured plan), the gradient of a
resident parameter is summed on the compute device instead
(``TieredParam.device_grad``, :attr:`GradState.ON_DEVICE`), in the stored
dtype and order, so the sum is bitwise the pool's; no gradient key is made.
Held gradients are the estimate's too (:func:`held_units`): its budget
less the compute copies it keeps, which the state it counted for the units
it planned whole (``RESIDENT`` before ``weights_of``) leaves free, since no
state exists before the first update. Those units hold theirs first (an
fp32 gradient takes less than the state), then units kept weights only,
in forward order, as far as that room goes; any other unit's go to the
pool, as a streamed unit's do. Holding every kept unit's gradients
whatever the budget, a 13.2B Llama on an H100 (80 GB) kept every compute
copy (26.4 GB) and held every gradient (52.9 GB, from the plan's
arithmetic), and its first update ran out of device memory (75.6 GiB
allocated of 79.2, 2.4 reserved unused; below).
The first update reads them there ([Note: one block landing] in
``tierd.optim.base``) and frees each as it is used. What else reads a
gradient from the pool first has it written there (:meth:`GradBucket.spill`):
a host read (``p.grad`` read, ``session.gradients()``), in-place changes
of ``p.grad`` replayed at a forward, an optimizer that keeps its gradients
after the update (clipping, a longer window), and the end of holding, where
the measured plan does not keep the unit (the placer chooses which stay:
[Note: held gradients at the first update], below). The placer measures the
step's memory without them: they are the plan's, and its peak reading
leaves them out from the moment each is made (:class:`PeakReading`).

[Note: held gradients at the first update]
The measuring step keeps the gradients of the units the estimate counted
whole (above), and the measured plan is applied just before the first
update reads them. The update frees each as it uses it, and no activation
exists then, so the step's measured non-model bytes are free room, less
the update window they count ([Note: the update window] in
tierd.client.placer), which the streamed blocks' update takes: held
gradients stay as far as that room takes them. Counted against the whole
non-model bytes, they could fill the window too, and the update's blocks
then had only the margin (that H100 run failed making the embedding's
moments in the first update). A unit the plan keeps whole
is updated first, its state made as its gradients go, which the plan
counted: it costs only what its gradients exceed its state by (nothing
for fp32 AdamW, whose state is three times the fp32 gradient); any other
unit's cost all its gradients. The rest, and any gradient kept past the update
(clipping, a longer window), are written to the pool first. Placing at a
forward instead (a window of several backwards, new input shapes) writes
them all there.
"""

from __future__ import annotations

from tierd.client.placement import Place, Placement, UnitBytes
from tierd.client.tiered_param import TieredParam


class PeakReading:
    """The allocator's peak since :meth:`reset`, less the bytes held for the
    plan: the gradients the measuring step keeps on the device ([Note: the
    measuring step keeps its gradients on the device]).
    Those come and go during the step, so at each change (:meth:`held`:
    before bytes are allocated, after they are freed) the peak so far, less
    what was held over that stretch, is kept and the allocator's peak starts
    again; a step's peak before any was held is not hidden by them.

    Example:
        >>> peaks = iter([10, 12, 15])
        >>> reading = PeakReading(lambda: next(peaks), lambda: None)
        >>> reading.held(4)       # 10 so far; 4 bytes held from here
        >>> reading.held(-4)      # 12 - 4 over that stretch
        >>> reading.peak()        # 15 since
        15
    """

    def __init__(self, read, reset) -> None:
        self._read, self._reset = read, reset
        self._max = 0        # the peak of the stretches before the last change
        self._held = 0

    def reset(self) -> None:
        self._reset()
        self._max = 0

    def held(self, delta: int) -> None:
        self._max = self.peak()
        self._reset()
        self._held += delta

    def peak(self) -> int:
        return max(self._max, self._read() - self._held)


def held_units(units: list[UnitBytes], estimated: Placement, room: int) -> list[int]:
    """The units whose gradients the measuring step holds on the device
    ([Note: the measuring step keeps its gradients on the device]):
    ``estimated`` is the plan from sizes (``units``) before ``weights_of``,
    ``room`` its budget less the compute copies it keeps. Units it planned
    whole first, then those kept weights only, each in forward order, while
    their fp32 gradients fit.

    Example:
        >>> units = [UnitBytes(i, 2, 12, 4) for i in range(4)]
        >>> plan = Placement({0: Place.WEIGHTS, 1: Place.RESIDENT, 2: Place.WEIGHTS,
        ...                   3: Place.STREAM}, 20, 0)
        >>> held_units(units, plan, 14)     # 12 of unit 1's state unused, 2 spare
        [1, 0, 2]
        >>> held_units(units, plan, 7)
        [1]
    """
    order = estimated.units_at(Place.RESIDENT) + estimated.units_at(Place.WEIGHTS)
    held = []
    for i in order:
        if units[i].grad_bytes and units[i].grad_bytes <= room:
            held.append(i)
            room -= units[i].grad_bytes
    return held


def kept_for_update(session, plan: Placement, units: list[UnitBytes], room: int,
                    freed) -> list[TieredParam]:
    """Of ``freed`` (freed as the first update uses them), the parameters
    whose gradients held on the device stay there for it under ``plan``
    (``units``: its units' bytes; ``room``: the step's measured non-model
    bytes less the update window): [Note: held gradients at the first update]."""
    freed, seen = set(freed), set()
    state = {u.index: u.state_bytes for u in units}
    keep = []
    for i, place in sorted(plan.places.items()):
        if place not in (Place.RESIDENT, Place.WEIGHTS, Place.STREAM):
            continue
        tps = [tp for tp in session.registry.members(session.units[i])
               if tp.grad_on_device and tp in freed and tp not in seen]
        seen.update(tps)
        held = sum(tp.grad_nbytes for tp in tps)
        # a whole unit's state, made as its gradients go, takes their room
        cost = max(0, held - state[i]) if place is Place.RESIDENT else held
        if tps and cost <= room:
            keep += tps
            room -= cost
    return keep
