"""The placer: measures a step, plans placement, applies it, re-plans.

The decision is :func:`tierd.client.placement.plan_placement` (plain code);
this module measures what it needs, makes units resident or streamed again
(through the registry and the fused optimizers), and watches later steps.

[Note: measuring the step for placement]
The first step runs the plan estimated from sizes ([Note: the plan before a
step is measured]): compute copies only, the rest streamed (the GPU holds
the prefetch window and the optimizer state in flight besides), and is
measured: on CUDA the allocator's peak over the step, less what was
allocated before attach and what the plan holds, is its *non-model* memory
(activations, workspace, gradients in flight, the streaming window, which
only shrinks as units become resident). Placement
gets ``cap`` less that, less a margin for fragmentation. Each later step's
peak is read again (less what the plan holds): past the margin, the plan is
made again within less. Input shapes larger than every shape measured (a
larger batch or sequence) may need far more, so everything streams again
(frozen weights kept only on the device excepted: [Note: frozen weights kept
only on the device] in tierd.client.kept_frozen) and that step is measured: one slow step, never an
out-of-memory error.
Each shape's peak is kept (``MeasuredShapes``) and the plan is for the
largest, so shapes no larger than one measured (lengths that vary by batch)
run on it. A forward without autograd may be up to an eighth larger than a
shape measured: decoding with a KV cache passes an attention mask one token
longer every call (transformers 4.x's ``generate``), and streaming
everything again for each token would never place the model. Such a forward's activations are freed layer by layer and its
cache grows by a token's keys and values, which the next reading
catches ([Note: a plan changes for memory, not for a different reading]). On the CPU nothing is measured: placement runs only with an
explicit ``gpu_memory_bytes`` (for tests), against that budget.

[Note: the plan before a step is measured]
Measuring a first step with everything streamed makes that step the slowest
of the run: every unit's compute copy waits on its pool lease and crosses
PCIe twice. So the first step runs a plan estimated from sizes alone
(:meth:`Placer.sized_units`: a unit's compute copies; for a trainable
parameter also AdamW's fp32 master and moments and its fp32 gradient; a
frozen one only its compute copy), within :func:`estimate_budget`: three
quarters of the cap (``device_room``, the GPU room the capacity check at
attach already counted: [Note: the GPU counted] in
``tierd.client.capacity``), within the device's free memory (``_memory``,
plus the allocator's cache unallocated, ``_cached``, and what the plan
already holds), less the margin. Of that plan only the
compute copies are applied (``weights_of``): optimizer state does not exist
before the first update, which runs on the plan made from the measured step
([Note: placing before the first update]). So the first step holds at most
three quarters of the cap in compute copies besides what an all-streamed
step holds, less the streaming window those units no longer need; the
quarter left takes its activations (a Llama-3-8B layer stack at T=2048,
B=4 with checkpointing needs well under a quarter of an H200, [Note: the
GPU counted]); a step that needs more than that runs out of device memory
where an all-streamed step might not: a smaller ``gpu_memory_bytes`` then
scales the estimate down. The estimate is made once, at the first step
(none under torch.distributed, none before activation tiering's plan is
final); the step is measured as before, and the measured plan replaces it
at the first update, moving only the units whose place changes
(``_apply``). From then on the rules below hold unchanged.

[Note: one plan for every rank]
Under torch.distributed the units placed whole are replicas on every rank
([Note: resident units are replicas] in ``tierd.client.distributed``) whose
gradients are all-reduced (the others' are reduced to an owner), so every
rank holds the same plan and changes it at the same step. Each rank measures
its own step; one small gloo all-reduce (MAX; a MIN as the MAX of negatives)
agrees on the cap at attach (the smallest; none if any rank streams
everything), then at each training step on whether the inputs changed or a
step outgrew the plan on any rank, whether every rank is ready, and the
smallest budget; for a plan, on each unit's optimizer bytes (only its owner
has them) and whether every rank can keep it as a replica (else at most its
weights). The CPU place is never chosen under ranks (``HostUpdates`` updates
on the device there): host costs differ per rank. Forwards without autograd
(evaluation, perhaps on one rank only) leave the plan alone, as they leave
DDP's buffers alone. A plan is applied only between accumulation windows, so
a replica never misses a gradient its owner summed.

[Note: a plan changes for memory, not for a different reading]
A placed step's reading may differ from the step the plan was made from
without anything having changed: steps run back to back (the host a step
ahead of the device) hold the allocator's blocks longer, since a block
freed while another stream may still use it returns to the pool only once
that stream's event has passed, so the peak read is higher than a
synchronized step's. Shrinking the plan then costs every later step time
for no memory it needed. So a placed plan is made again only when a step's
peak (what it needed besides the plan, plus what the plan holds) came within
half the margin of the cap: the one reading that says the next step may not
fit. New input shapes larger than any measured stream and measure, as before.

[Note: a plan made again moves what changes]
A plan made again within less starts from the plan applied: the state of
units no longer whole is written to the pool, units no longer kept stream
again, and the rest keep weights and state on the device (units held come
first among moves that save alike, [Note: spread], so the smaller plan is
the larger one less some units). Made from everything streamed, each such
change wrote all resident state to the store and read it back at the next
update: 23-28 s a step for the 8B Llama at an H100's free memory, where a
steady step took 1.2 s. Under ranks it is made that way still (replicas).

[Note: the allocator's retries]
The plan counts allocated bytes; the caching allocator reserves more (a
block cached for one stream serves no other, and blocks of many sizes
fragment its segments), and where reserved memory meets the device's, an
allocation frees the whole cache and retries, each retry synchronizing every
stream. A Llama 8.4B at the free memory of an H100 (plan 70.1 GB, steps
peaking at 79.2 GB allocated under an 84.2 GB cap, margin 3.4) reserved
83.9 GB and retried 7 times a step: 1.27 s against its 0.925 s PCIe floor.
So the first step on a plan that made the allocator retry is read at its
reserved peak (``_read_step`` adds what the allocator reserved past the
allocated peak to the step's non-model bytes): that peak met the device, so
the plan is made again within less ([Note: a plan changes for memory, not
for a different reading]), and the allocator's cache is emptied once there.
Once per measured shape: the steps after a change reserve what the change
freed besides (that 8B case read 9.7 GB past its allocations on the smaller
plan, 5.7 on the first), so reading each retry again shrank the plan at
steps 3, 5 and 10, from 70.1 to 55.6 GB, and the changes took up to 23 s a
step. Retries left after that one change cost time, not memory; attach
makes the allocator's segments expandable, which leaves fewer of them
([Note: expandable segments] in tierd.client.device_allocator).

[Note: a model compiled whole]
``torch.compile(model)`` runs backward as one compiled node per frame, and
that node hands autograd every gradient at its end (a checkpointed 8-layer
Llama on the CPU: every gradient arrived in the last 1 % of backward, spread
over 98 % of it eager and under per-block compile). The fused update, which
streams a unit's state in and out as soon as its gradients are final, then
starts only once backward is over, and every gradient is held at once. On
the H200 the 8B Llama capped at 100 GB took 1.38 s a step compiled whole,
about compute plus every copy in series (0.525 + 41.4 GB each way at ~50
GB/s), and its measured peak was ~13 GB higher than compiled per block,
so placement kept less; per block it took 0.866 s. Tierd cannot split the
user's compiled backward, so when a measured plan streams anything under a
model compiled whole (:attr:`ModuleHooks.compiled_whole`: its root's hook
was traced), it says so once, naming per-block compile.

[Note: placement and activation tiering share one budget]
Activation tiering decides first, placement second. ``activations="auto"``
plans against its own budget (``ActivationConfig.budget_bytes``) with every
parameter streamed, over its profile and check steps; only once its plan is
final (``AutoStage.DONE``) does the placer measure a step, which then runs
that plan, so the non-model memory it measures includes what the activation
plan keeps, and placement takes what is left. The other order would let the
activation planner's later steps grow past what placement left free.

[Note: placing before the first update]
The first (measuring) step updates in ``opt.step()``, after its backward.
Placing there rather than at the next forward means the resident units'
optimizer state is made on the device by that first update and never stored
([Note: resident state leaves the store] in ``tierd.updates.resident``,
[Note: state made when first needed] in ``tierd.optim.state``): the store
needs room only for the first step's gradients and what streams, which lets
a model larger than pool + NVMe train. The update adds little device memory
(one block at a time) beyond the margin. Under torch.distributed the plan
waits for the next forward, where every rank agrees on it. The allocator's
peak starts afresh once the plan is applied: the next reading (at the next
forward) is then of this update and nothing before it. Read from the step's
start, it held the measuring step's peak, under the estimated plan, against
the smaller placed one; on the H200 the 70B LoRA capped at 24 GB read
25.8 GB twice, counted 16.1 GB besides the plan instead of 11.1, placed
again smaller and left the store 0.6 GiB short.

[Note: the update window]
The measured first step updates in ``opt.step()``, after its activations are
freed, but every later backward runs the fused update ([Note: fused update]
in ``tierd.updates.fused``) beside them: streamed buckets' state fetched ahead
(up to twice ``prefetch_bytes``, plus the running bucket), the running
bucket's gradients (as delivered, in fp32) and new compute values, and the
next bucket's gradients as backward delivers them. Uncounted, that ran 13B
(H200) out of memory in its second step (a 318M-parameter layer: 3.8 GB of
state and 1.9 GB of gradients besides 4 GiB of window, past the margin). So
a measured step that ran no fused update adds the optimizers' window
(``tierd.updates.buckets.update_window``). Counting the running bucket's
gradients alone, a 13.2B Llama at the default cap on an H100 still ran out
in its second step; counting both (7.2 GB of window), its fused steps read
12.4-12.5 GB besides the plan against 11.1 assumed: the margin (3.4 GB)
took the rest, as it takes the blocks back-to-back steps hold longer
([Note: a plan changes for memory, not for a different reading]).

[Note: growing the plan]
That window is an upper bound: backward frees activations while the state
fetched ahead fills (GPT-2 1.3B, B=8, cap 48 GB, H200: 6.6 GB assumed,
under 1 GB seen; nothing kept on the GPU, 7 GB of the cap unused). So the
first placed step that runs the fused update is measured too; where the
plan assumed a window and that step left more room than the margin, the
plan grows into it (``grow_placement``: units only move up, none off the
CPU; no state written back), within the device's free memory outside the
allocator's cache (cached blocks may be too fragmented: at 18.5B a step
reserved 12 GB more than it allocated). At most once per measuring (a new
largest shape): a plan made again (a step outgrew it) does not grow. With
``optimizer_placement="auto"`` such a step first sends back to streaming
the CPU-updated units the host's measured rate no longer pays for
(``rebalance_host``); growth then waits for the next fused step, which
holds their state too.
"""

from __future__ import annotations

import enum
import logging

import torch

from tierd.client.capacity import DaemonRoom, estimate_budget, margin_for, size_text
from tierd.client.kept_frozen import store_kept
from tierd.client.placement import (MeasuredShapes, Place, Placement, UnitBytes,
                                    grow_placement, plan_placement, rebalance_host, stored,
                                    weights_of)
from tierd.client.held_grads import PeakReading, held_units, kept_for_update
from tierd.client.optimizers import UpdateEngine
from tierd.errors import CapacityError

log = logging.getLogger("tierd.placement")

#: a forward without autograd this much larger than a shape measured runs on
#: the plan ([Note: measuring the step for placement])
_DECODING_SLACK = 1 / 8


class PlacerState(enum.Enum):
    """What the placer does with the running step.

    OFF: no placement (``gpu_memory_bytes=0``, or the CPU without it; under
        torch.distributed: on any rank).
    MEASURING: the step runs the plan estimated from sizes (the first step,
        [Note: the plan before a step is measured]) or streams what no plan
        holds (after a reset), and its device peak is measured.
    PLACED: a plan is applied; each step's peak is checked against it.
    """

    OFF = "off"
    MEASURING = "measuring"
    PLACED = "placed"


class Placer:
    """Placement of one attached model's units (see the Notes above); under
    torch.distributed every rank holds the same plan ([Note: one plan for
    every rank]), its resident units kept as replicas.

    Example:
        >>> placer = Placer(session, cap=40 << 30)   # doctest: +SKIP
        >>> placer.begin_step(signature)             # at each root forward  # doctest: +SKIP
    """

    def __init__(self, session, cap: int | None, *, explicit: bool) -> None:
        self._session = session
        self._updates: UpdateEngine = session.updates   # the optimizers' state, asked
        self._ranks = None if session.share is None else session.share.ranks
        self._cuda = session.device.type == "cuda"
        self.plan: Placement | None = None
        # TieredParams made resident by the plan; RESIDENT_ONLY ones from the
        # start ([Note: frozen weights kept only on the device] in tierd.client.kept_frozen)
        self._placed: list = [tp for tp in session.params.values() if not tp.in_store]
        self._base = (torch.cuda.memory_allocated(session.device)
                      - sum(tp.nbytes for tp in self._placed)) if self._cuda else 0
        self._estimated = False          # the first step's plan was estimated
        self._signature = None           # root inputs' shapes of the measured step
        self._shapes = MeasuredShapes()  # ... of every step measured, with its peak
        self._non_model = 0              # measured non-model peak the plan assumed
        self._measured_steps = 0
        self._fused_before = 0           # fused-update backwards when measuring began
        self._on_final_activations = False   # ... and activation tiering's plan was final
        self._window = 0                 # update window assumed by the last step read
        self._plan_window = 0            # ... by the step the plan was made from
        self._cpu_mode = "none"          # the plan's CPU updates ("all": whole units only)
        self._grown = False              # the plan grew since the inputs changed
        self._rebalanced = False         # ... or chose its CPU updates again
        self._ran_fused = False          # the last step read ran the fused update
        self._warned_whole = False       # [Note: a model compiled whole] told once
        self._retries_at = 0             # the allocator's retries when the step began
        self._gap = 0                    # [Note: the allocator's retries] of the last reading
        self._gap_placed = False         # ... placed again since the inputs changed
        self.replans = 0
        self.cap, self._explicit = cap, explicit
        device = session.device
        self._peak = PeakReading(
            (lambda: torch.cuda.max_memory_allocated(device)) if self._cuda else (lambda: 0),
            (lambda: torch.cuda.reset_peak_memory_stats(device)) if self._cuda else (lambda: None))
        session.grads.on_held = self._peak.held
        self.state = PlacerState.OFF     # under ranks until :meth:`join_ranks`
        if self._ranks is None:
            self._configure(cap, explicit)

    def _configure(self, cap: int | None, explicit: bool) -> None:
        self.cap, self._explicit = cap, explicit
        # an explicit cap is the user's; free memory at attach also has to leave
        # room for the allocator's slack
        self._margin = margin_for(cap, explicit=explicit, cuda=self._cuda)
        self.state = PlacerState.OFF if cap is None else PlacerState.MEASURING

    def join_ranks(self) -> None:
        """Under torch.distributed, once every rank has its session: place
        within the smallest cap of any rank ([Note: one plan for every rank])."""
        low, explicit = self._ranks.agree_max([-(self.cap or 0), int(self._explicit)],
                                              "agreeing on gpu_memory_bytes")
        self._configure(-low or None, bool(explicit))

    # ------------------------------------------------------------- steps
    def begin_step(self, signature) -> None:
        """A root forward begins a step (``signature``: its inputs' shapes)."""
        if self.state is PlacerState.OFF:
            return
        if not torch.is_grad_enabled() and (self._ranks is not None
                                            or self._updates.trains()):
            # not a training step ([Note: one plan for every rank]): an
            # evaluation batch of another shape must not stream the resident
            # state again, which would put it all back into the store
            return
        non_model = self._read_step()
        changed = self._signature is not None and signature != self._signature \
            and not self._shapes.covers(signature, 0.0 if torch.is_grad_enabled()
                                        else _DECODING_SLACK)
        # [Note: a plan changes for memory, not for a different reading]; the
        # update window a step without the fused update assumes is no reading
        peak = non_model - self._window + self.resident_bytes()
        grew = (self.state is PlacerState.PLACED and self.resident_bytes() > 0
                and peak > self.cap - self._margin // 2)   # else nothing left to give back
        non_model = max(non_model, self._shapes.peak())   # a plan fits every shape measured
        ready, budget = self._ready(), max(0, self.cap - non_model - self._margin)
        if self._ranks is not None:
            got = self._ranks.agree_max([int(changed), int(grew), int(not ready), -budget],
                                        "agreeing on the placement")
            changed, grew, ready, budget = bool(got[0]), bool(got[1]), not got[2], -got[3]
        if changed:
            log.info("tierd placement: the inputs changed (%s -> %s); streaming everything "
                     "and measuring this step", self._signature, signature)
            self._reset()
            self._grown = self._rebalanced = self._gap_placed = False
        elif self.state is PlacerState.MEASURING:
            if ready:
                self._place(non_model, budget)
            elif not self._estimated and self._ranks is None:
                self._estimate()
        elif grew:
            self.replans += 1
            log.info("tierd placement: the step's peak, %d bytes (%d besides the plan, %d "
                     "planned; %d of it cached by the allocator past its allocations), came "
                     "within half the margin (%d) of the cap %d; placing again within less",
                     peak, non_model, self._non_model, self._gap, self._margin, self.cap)
            if ready and self._ranks is None:   # [Note: a plan made again moves what changes]
                self._place(non_model, budget, in_place=True)
            else:
                self._reset()
                if ready:
                    self._place(non_model, budget)
            if self._gap:   # [Note: the allocator's retries]
                self._gap_placed = True
                if self._cuda:
                    torch.cuda.empty_cache()
        else:
            self._grow(non_model, budget)
        self._signature = signature
        self._start_measuring()

    def before_update(self, freed: list | tuple = ()) -> None:
        """``opt.step()`` is about to update in step() (deferred) at the end of
        the measured window: place now rather than at the next forward, so the
        first update already runs on the plan ([Note: placing before the first
        update]). ``freed``: the parameters whose stored gradients that update
        deletes as it uses them, room for the state it makes ([Note: gradients
        freed as they are used] in ``tierd.optim.base``)."""
        if self.state is not PlacerState.MEASURING or self._ranks is not None \
                or not self._ready():
            return
        non_model = max(self._read_step(), self._shapes.peak())
        self._place(non_model, max(0, self.cap - non_model - self._margin), freed=freed,
                    first_update=True)
        self._reset_peak()   # [Note: placing before the first update]

    def _ready(self) -> bool:
        """A whole step was measured, which began on activation tiering's final
        plan; under ranks also no window is half-way ([Note: one plan for every rank])."""
        if self._measured_steps < 1 or not self._on_final_activations:
            return False
        return self._ranks is None or (
            self._updates.between_windows()
            and not any(tp.grad_in_pool for tp in self._session.params.values()))

    def _start_measuring(self) -> None:
        self._reset_peak()
        self._measured_steps += 1
        self._fused_before = self._updates.fused_backwards()
        act = self._session.activations   # its stage changes as a backward ends
        self._on_final_activations = act is None or act.stage.name == "DONE"

    def _reset_peak(self) -> None:
        """The allocator's peak starts afresh: the next :meth:`_memory` reads
        from here."""
        self._peak.reset()
        self._retries_at = self._retries()

    def _memory(self) -> tuple[int, int] | None:
        """The allocator's peak since the step began, and the bytes the device
        has free outside the allocator's cache (None on the CPU: not measured)."""
        device = self._session.device
        return (self._peak.peak(), torch.cuda.mem_get_info(device)[0]) if self._cuda else None

    def _retries(self) -> int:
        """The caching allocator's retries so far (0 on the CPU): each freed
        its cache and synchronized every stream to satisfy an allocation."""
        if not self._cuda:
            return 0
        return torch.cuda.memory_stats(self._session.device).get("num_alloc_retries", 0)

    def _reserved_peak(self) -> int:
        """The allocator's reserved peak since the step began (0 on the CPU)."""
        return torch.cuda.max_memory_reserved(self._session.device) if self._cuda else 0

    def _cache_gap(self, peak: int) -> int:
        """[Note: the allocator's retries]: where a step on the plan made the
        allocator retry (and no such step placed again since the inputs
        changed), the bytes it reserved past the step's allocated ``peak``;
        else 0."""
        retries = self._retries() - self._retries_at
        if not retries or self.state is not PlacerState.PLACED or self._gap_placed:
            return 0
        gap = max(0, self._reserved_peak() - peak)
        log.info("tierd placement: the step made the CUDA caching allocator free its cache and "
                 "retry %d times (each synchronizes every stream): it reserved %d bytes past "
                 "its allocated peak %d; reading the step at its reserved peak",
                 retries, gap, peak)
        return gap

    def _cached(self) -> int:
        """Bytes the allocator's cache holds unallocated (0 on the CPU): free
        to this process, as the cap counts them (a model built on the device
        leaves its parameters' blocks there once attach has stored them: a
        13.2B Llama built in fp32 left 53 GB of an H100's 85 cached, and an
        estimate within the driver's free memory alone kept no unit whole)."""
        if not self._cuda:
            return 0
        device = self._session.device
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def _read_step(self) -> int:
        """Non-model bytes of the step that just ended (0 on the CPU), with
        the fused update's window if that step did not run it ([Note: the
        update window]); the window assumed is kept in ``_window``."""
        memory = self._memory()
        self._window = 0
        self._ran_fused = self._measured_steps > 0 \
            and self._updates.fused_backwards() != self._fused_before
        if self._measured_steps == 0:
            return 0
        if memory is not None and not self._ran_fused:
            self._window = self._updates.update_window()
        self._gap = 0 if memory is None else self._cache_gap(memory[0])
        non_model = 0 if memory is None else \
            max(0, memory[0] - self._base - self.resident_bytes()) + self._window + self._gap
        if memory is not None:
            log.debug("tierd placement read a step: peak %d, before attach %d, the plan %d, "
                      "update window %d, free %d -> %d besides the plan", memory[0],
                      self._base, self.resident_bytes(), self._window, memory[1], non_model)
        if self._on_final_activations:   # a step on a plan activation tiering left is no guide
            self._shapes.record(self._signature, non_model, estimated=self._window > 0)
        return non_model

    # ------------------------------------------------------------- plan
    def unit_bytes(self) -> list[UnitBytes]:
        """Each unit's compute copy and the fused optimizers' state for it."""
        registry, out = self._session.registry, []
        for unit in self._session.units:
            members = set(registry.members(unit))
            state = self._updates.unit_state(members)
            # in the store: compute copies and fp32 masters (the compute copy
            # itself in fp32), moments ([Note: placement within the store])
            stored = sum(tp.nbytes for tp in members) + self._updates.master_bytes(members)
            out.append(UnitBytes(unit.index, sum(tp.nbytes for tp in members),
                                 state.state_bytes, state.grad_bytes,
                                 stored + state.moment_bytes,
                                 sum(tp.nbytes for tp in members if not tp.in_store),
                                 weights_state_bytes=state.weights_state_bytes))
        return out

    def sized_units(self) -> list[UnitBytes]:
        """Each unit's bytes from its parameters' sizes alone ([Note: the plan
        before a step is measured])."""
        registry = self._session.registry
        return [UnitBytes.sized(unit.index,
                                [(tp.nbytes, tp.param.numel(), tp.param.requires_grad,
                                  tp.param.requires_grad and tp.param.dtype != torch.float32)
                                 for tp in registry.members(unit)],
                                kept_bytes=sum(tp.nbytes for tp in registry.members(unit)
                                               if not tp.in_store))
                for unit in self._session.units]

    def _estimate(self) -> None:
        """The first step's plan, from sizes ([Note: the plan before a step is
        measured]): its compute copies on the device, the step measured."""
        self._estimated = True
        act = self._session.activations
        if act is not None and act.stage.name != "DONE":
            return   # [Note: placement and activation tiering share one budget]
        memory = self._memory()
        free = None if memory is None else memory[1] + self._cached() + self.resident_bytes()
        budget = estimate_budget(self.cap, self._margin, free)
        units = self.sized_units()
        whole = plan_placement(units, budget, held=self._held())
        plan = weights_of(units, whole)
        self._apply(plan, weights_only=True)
        self._adopt(plan, 0, budget, "placement estimated from sizes until a step is measured")
        # [Note: the measuring step keeps its gradients on the device] in
        # tierd.client.held_grads, within what the estimate counted
        session = self._session
        session.grads.hold = frozenset(
            tp for i in held_units(units, whole, budget - plan.device_bytes)
            for tp in session.registry.members(session.units[i]) if tp.param.requires_grad)

    def _held(self) -> frozenset[int]:
        """Units whose weights the device holds now, placed ones kept first
        ([Note: spread] in tierd.client.placement)."""
        placed = set(self._placed)
        return frozenset(u.index for u in self._session.units
                         if placed.intersection(self._session.registry.members(u)))

    def _agreed(self, units: list[UnitBytes]) -> list[UnitBytes]:
        """Under ranks: each unit's optimizer bytes as its owner counts them,
        0 where some rank cannot keep the unit as a replica; with a sharded
        GPU tier also what each local rank would hold of it resident ([Note:
        one budget on every rank] in tierd.client.placement)."""
        session, n = self._session, len(units)
        sharded = session.share.sharded
        size = 1 if sharded is None else len(self._ranks.node_ranks)
        mine = [0] * (n * size)   # this rank's own state bytes in its slot
        for i, u in enumerate(units):
            mine[i * size + (0 if sharded is None else self._ranks.local_rank)] = u.state_bytes
        odd = [int(not self._updates.can_replicate(session.registry.members(u)))
               for u in session.units]
        got = self._ranks.agree_max(mine + odd, "agreeing on the units' optimizer bytes")
        out = []
        for i, u in enumerate(units):
            own = got[i * size:(i + 1) * size]
            if got[n * size + i]:   # some rank cannot keep it as a replica: weights at most
                out.append(UnitBytes(u.index, u.param_bytes, 0, u.grad_bytes))
            elif sharded is None:
                out.append(UnitBytes(u.index, u.param_bytes, max(own), u.grad_bytes))
            else:   # each rank reported the state of the buckets it owns
                kept = sharded.kept_by_rank(session.registry.members(session.units[i]))
                out.append(UnitBytes(u.index, u.param_bytes, sum(own), u.grad_bytes,
                                     rank_state=tuple(o + k for o, k in zip(own, kept))))
        return out

    def _place(self, non_model: int, budget: int, *, freed=(), first_update: bool = False,
               in_place: bool = False) -> None:
        """Make and apply the plan for ``budget``; ``first_update``: ``step()``
        is about to update, with ``freed`` freed as they are used; ``in_place``:
        from the plan applied now ([Note: a plan made again moves what changes])."""
        units = self.unit_bytes()
        if self._ranks is not None:
            units = self._agreed(units)
        cpu, costs = self._updates.host_choice()
        room = self._store_room(units)
        plan = plan_placement(units, budget, cpu=cpu, costs=costs,
                              store_bytes=None if room is None else room + _room(freed),
                              held=self._held())
        if room is not None:
            # a CPU-updated unit's gradients stay: it writes them every step
            on_cpu = {tp for i in plan.units_at(Place.CPU)
                      for tp in self._session.units[i].params}
            room += _room([tp for tp in freed if tp not in on_cpu])
            if stored(units, plan.places) > room:
                self._refuse(units, plan, room)
        # the update's streamed blocks take the window ([Note: held gradients at
        # the first update] in tierd.client.held_grads)
        room = max(0, non_model - self._window)
        self._end_holding(kept_for_update(self._session, plan, units, room, freed)
                          if first_update else ())
        self._apply(plan, in_place=in_place)
        self._plan_window, self._cpu_mode = self._window, cpu
        self.state = PlacerState.PLACED
        self._non_model = non_model
        self._adopt(plan, non_model, budget, "placement")

    def _adopt(self, plan: Placement, non_model: int, budget: int, what: str) -> None:
        self.plan = plan
        self._session.client.report_device(plan.device_bytes)
        log.info("tierd %s: %d units resident, %d weights only, %d streamed, %d updated "
                 "on the CPU; %d device bytes held, %d PCIe bytes a step (budget %d; cap %d, "
                 "step %d, margin %d)",
                 what, len(plan.units_at(Place.RESIDENT)), len(plan.units_at(Place.WEIGHTS)),
                 len(plan.units_at(Place.STREAM)), len(plan.units_at(Place.CPU)),
                 plan.device_bytes, plan.streamed_bytes,
                 budget, self.cap, non_model, self._margin)
        log.debug("tierd placement, unit by unit in forward order (Resident, Weights only, "
                  "Streamed, Cpu): %s", "".join(p.name[0] for _, p in sorted(plan.places.items())))
        if (self.state is PlacerState.PLACED and plan.streamed_bytes
                and self._session.hooks.compiled_whole and not self._warned_whole):
            self._warned_whole = True   # [Note: a model compiled whole]
            log.warning(
                "tierd: the model is compiled whole (torch.compile(model)) and placement "
                "streams %s a step: a model compiled whole gives autograd every gradient "
                "at the end of backward, so the optimizer's update cannot overlap backward "
                "and every gradient is held at once; compile each block instead "
                "(for block in blocks: block.compile())", size_text(plan.streamed_bytes))

    def _grow(self, non_model: int, budget: int) -> None:
        """After a step on the plan that ran the fused update: first (with
        "auto", once) stream the CPU units the host's measured rate does not
        pay for ([Note: choosing CPU updates]), and grow a step later; else
        keep more on the device, from the plan's places up, where the plan
        assumed an update window and the step left more room than the
        margin ([Note: growing the plan])."""
        if self._ranks is not None or self._grown or not self._ran_fused:
            return
        plan = self.plan   # (the units' bytes are read only where a plan is made:
        # a read each step cost ~0.2 s on the CPU at 64 layers)
        cpu, costs = self._updates.host_choice()
        if cpu == "auto" and not self._rebalanced and plan.units_at(Place.CPU):
            if not self._updates.host_measured():
                return   # no host update ended yet: choose (and grow) once one has
            self._rebalanced = True
            again = rebalance_host(self.unit_bytes(), plan, costs)
            if again.places != plan.places:
                self._apply(again, grow=True)
                self._adopt(again, non_model, budget, "placement chose CPU updates again")
                return
        room, memory = budget - plan.device_bytes, self._memory()
        if memory is not None:   # the allocator's cache may not take it: the device's free
            room = min(room, memory[1] - self._margin)
        if not self._plan_window or room <= self._margin:
            return
        self._grown = True
        budget = plan.device_bytes + room
        grown = grow_placement(self.unit_bytes(), plan, budget, whole=self._cpu_mode == "all")
        if grown.device_bytes > plan.device_bytes:
            self._apply(grown, grow=True)
            self._adopt(grown, non_model, budget, "placement grew")

    def _store_room(self, units: list[UnitBytes]) -> int | None:
        """Store bytes the units' values may take: what is free plus what they
        take now (moments not made yet excepted); None where the store keeps
        resident values anyway (ranks) or does not say (an in-process store)."""
        session = self._session
        if self._ranks is not None:
            return None
        room = DaemonRoom.from_stats(session.client.stats())
        if room is None:
            return None
        # what the model's values take now: each parameter once (a tied one is
        # in two units), with the state of each optimizer that has it
        values = (sum(tp.nbytes for tp in session.params.values() if tp.in_store)
                  + self._updates.master_bytes(session.params.values()))
        return room.free() + values + self._updates.stored_state_bytes()

    def _refuse(self, units: list[UnitBytes], plan: Placement, room: int) -> None:
        """CapacityError, before anything changes: the store cannot hold what
        the best plan leaves in it ([Note: placement within the store])."""
        raise CapacityError(
            f"placement keeps {size_text(plan.device_bytes)} on the GPU "
            f"({len(plan.units_at(Place.RESIDENT))} of {len(units)} units whole), and the "
            f"units it streams need {size_text(stored(units, plan.places))} in the store, "
            f"which can give them {size_text(room)}. Give the daemon a larger pool or NVMe "
            "file (TIERD_POOL / TIERD_NVME_SIZE, or `tierd serve --pool/--nvme-size`), or "
            "the GPU more room (a larger gpu_memory_bytes, a smaller batch, activation "
            "checkpointing)")

    def _apply(self, plan: Placement, *, grow: bool = False, weights_only: bool = False,
               in_place: bool = False) -> None:
        """Make ``plan`` so: from what is placed now, units it no longer keeps
        streamed again first (no state of theirs pinned: a plan holding
        state is left by :meth:`_reset` or grows, or ``in_place``, where the
        state of units no longer resident streams again first: [Note: a plan
        made again moves what changes]), or (``grow``) from the current plan,
        whose units only move up ([Note: growing the plan]) or from the CPU
        to streaming (:func:`~tierd.client.placement.rebalance_host`);
        ``weights_only``: its compute copies only ([Note: the plan before a
        step is measured])."""
        session = self._session
        # no copy in flight, no value kept: every streamed parameter HOST
        session.settle(write_resident=not (grow or in_place))
        units = session.units   # a unit's params are its streamed ones
        kept = [i for i, p in plan.places.items() if p in (Place.WEIGHTS, Place.RESIDENT)]
        if not grow:
            if in_place:
                whole = {tp for i in plan.units_at(Place.RESIDENT)
                         for tp in session.registry.members(units[i])}
                self._updates.unplace([tp for tp in self._placed if tp not in whole])
            keep = {tp for i in kept for tp in session.registry.members(units[i])}
            self._demote([tp for tp in self._placed if tp not in keep])
            units = session.units
        self._make_resident([units[i].params for i in kept])
        if weights_only:
            session.mover.replan(keep_trace=True)   # [Note: units new to the trace]
            return
        resident = [tp for i in plan.units_at(Place.RESIDENT)
                    for tp in session.registry.members(units[i])]
        if self._ranks is not None:   # [Note: resident units are replicas]
            resident = session.share.replicable(resident)
            self._updates.replicate(resident)
            session.share.replicate(resident)
        on_host = [tp for i in plan.units_at(Place.CPU)
                   for tp in session.registry.members(units[i])]
        self._updates.place(resident, on_host)
        session.mover.replan(keep_trace=True)   # [Note: units new to the trace]

    def _make_resident(self, by_unit: list) -> None:
        """Copy the kept units' parameters (``by_unit``: a list per unit)
        onto the device, one unit's leases at a time: a unit's values need
        pool room only while they are copied, so a plan keeping most of the
        model needs no more room than the largest unit (leasing them all at
        once needed the whole plan's bytes in the pool)."""
        session = self._session
        made: list = []
        try:
            for params in by_unit:
                todo = [tp for tp in params if not tp.resident]   # (a tied one: once)
                if not todo:
                    continue
                session.make_resident(todo)
                made += todo
        except BaseException:
            if made:   # all or nothing: their stored values are unchanged, they stream again
                session.registry.set_resident(made, False)
            raise
        self._placed += made

    def _demote(self, tps: list) -> None:
        """Stream ``tps`` (placed) again, RESIDENT_ONLY ones stored first
        ([Note: frozen weights kept only on the device] in tierd.client.kept_frozen),
        and the compute copies the store has older values of ([Note: kept
        weights are written when the store is read] in tierd.updates.resident;
        a plan made again in place settles without writing them)."""
        if not tps:
            return
        self.store_kept(tps)   # raises before anything moved
        self._updates.write_kept_weights(tps)
        self._updates.unplace(tps)
        self._session.registry.set_resident(tps, False)
        gone = set(tps)
        self._placed = [tp for tp in self._placed if tp not in gone]

    def store_kept(self, tps: list | None = None) -> None:
        """Write the RESIDENT_ONLY parameters of ``tps`` (every one placed:
        None) into the store; they stay resident (:func:`tierd.client.kept_frozen.store_kept`)."""
        store_kept([tp for tp in (self._placed if tps is None else tps) if not tp.in_store],
                   self._session)

    def _end_holding(self, keep) -> None:
        """The measuring step is over: no gradient is held on the device from
        here, and those held are written to the pool but for ``keep``."""
        session = self._session
        session.grads.hold = frozenset()
        keep = set(keep)
        session.grads.spill(tp for tp in session.params.values()
                            if tp.grad_on_device and tp not in keep)

    def _reset(self) -> None:
        """Stream everything the plan holds again (values written to the pool
        first), RESIDENT_ONLY parameters excepted."""
        self._end_holding(())
        if self.plan is None:
            return
        session = self._session
        session.settle()
        self._updates.drop_replicas()
        self._updates.unplace(self._placed)
        # RESIDENT_ONLY ones stay ([Note: frozen weights kept only on the device] in
        # tierd.client.kept_frozen)
        stored = [tp for tp in self._placed if tp.in_store]
        if stored:
            session.registry.set_resident(stored, False)
        if self._ranks is not None:   # every rank reads what the owners wrote back
            session.share.replicate(())
            session.share.sync(session.settle, "streaming the resident units again")
        self._placed = [tp for tp in self._placed if not tp.in_store]
        self.plan = None
        session.mover.replan()   # the units placed whole left the trace: learn it again
        session.client.report_device(0)
        self.state = PlacerState.MEASURING
        self._measured_steps = 0

    def resident_bytes(self) -> int:
        """Device bytes the plan holds now (resident compute copies and state)."""
        weights = sum(tp.nbytes for tp in self._placed)
        return weights + self._updates.resident_bytes()

    def stats(self) -> dict:
        plan = self.plan
        return {"placement": self.state.value, "resident_bytes": self.resident_bytes(),
                "planned_pcie_bytes": None if plan is None else plan.streamed_bytes,
                "placement_replans": self.replans}

    def close(self) -> None:
        """Before detach: nothing resident but RESIDENT_ONLY parameters
        (values back in the pool; those are read from the device)."""
        self._reset()
        self.state = PlacerState.OFF


def _room(freed) -> int:
    """Store room the first update's freed gradients make (parameters ``freed``):
    they go block by block after each block's state is made, so an eighth of
    them, and at least twice the largest, is kept back as the update's
    working room (its leases, the pool's swapping, the last block)."""
    nbytes = 4 * sum(tp.param.numel() for tp in freed)
    keep = max(nbytes // 8, 8 * max((tp.param.numel() for tp in freed), default=0))
    return max(0, nbytes - keep)
