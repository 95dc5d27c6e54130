"""Optimizer updates that wait for the next forward.

[Note: updates before the next forward]
Each streamed bucket's state crosses PCIe in the updating backward only (in
for the update, out after it), so where state streams the backward is bound
by the copy engines and the forward leaves them idle. A bucket's update may
run at any time before its parameters are next used: the next forward of its
unit. So a share of the streamed state (``AttachConfig.forward_update_share``
of its bytes; ``FORWARD_SHARE`` on a GPU unless given) is updated there instead. In the updating backward those
buckets' gradients are held on the device once final (as delivered where one
delivery is expected: 2 B/param at bf16 compute; else their fp32 sum),
with the param group's hyper-parameters of that moment, and the bucket is
PENDING. The next forward fetches them in its order from its start, within
twice ``prefetch_bytes`` (the bound the backward's fetches block at), and
queues each update on the update stream ([Note: the update stream] in
tierd.client.copy_stream) as soon as its fetch is queued; a unit's
pre-forward makes the compute stream wait for its own buckets' updates
only. Every streamed unit's pre-forward fetches on as copies out land, and
the keys of the next pending buckets are asked for ahead ([Note: leases
asked ahead] in tierd.updates.fused): measured on the H200 (GPT-2 1.3B
capped at 48 GB), a forward that fetched only at the units that wait, and
asked for each bucket's keys as it fetched it, kept the host waiting for
copies out and grants, and took 0.255 s instead of 0.098.
The same bytes cross PCIe, both ways during the forward too.

[Note: the first updates wait for the first unit]
A model may read a device scalar before its first block: transformers'
mask creation does (``find_packed_sequence_indices``, an ``.item()``),
and so the host waits there for the compute stream, and for the copy
engine its scalar's copy is queued on, behind every copy out queued
before it. Launched as the step began (in the model's pre-forward), the
first pending updates' copies out were such a queue: in a profiled step of
GPT-2 1.3B capped at 48 GB (H100, cb3825f) the host waited 27 ms at that
read with the compute stream idle, after 46 ms of launching. So the step's
begin queues no update and no copy out: the updates start at the first
unit's pre-forward, after the model's own preamble (the begin fetches
their state, copies in only: the Note below).

[Note: the next forward's first fetches start as the step begins]
At the step's two ends the copy-in engine idled: in a profiled step of a
13B Llama (B=4, checkpointing, default attach; H200, dd0fce3) the middle of
the step ran at the both-ways PCIe rate, and the 0.22 s over the floor was
~0.19 s with no copy in: while the backward's last blocks computed (their
state does not stream, or its copies out wait: the Note below) and until
the forward's first unit (the Note above). So as the step begins (the
model's pre-forward, before its preamble), the state of the first pending
buckets in forward order is fetched (AHEAD: leased and copied in, the
update still waiting), within the window (twice ``prefetch_bytes``),
waiting for the last backward's copies out to land as a fetch in the
backward does. They land while the last blocks compute, before the
preamble's device read lets the host go on, so the wait costs nothing
there; the host has queued ``step()`` and ``zero_grad`` before it. Copies
in only: the updates and their copies out still start at the first unit,
so nothing more is queued on the copy-out engine ahead of the preamble's
read. Not at the backward's end: the host would wait there before
``step()`` instead of after it.

[Note: a refill takes the room it finds]
A unit's pre-forward launches the pending updates that fit the room the
window has as it begins, not the room that copies landing meanwhile make:
counted afresh after each launch, the room kept growing as fast as the host
launched (a launch costs the host about what its copies take to land), and
the first block's pre-forward launched the forward's updates for 70 ms, the
compute stream idle, before the block's own kernels were queued (a trace of
three steps back to back, H100, b2a30fb). The next units' pre-forwards,
every few milliseconds, take up the room freed in between.
That room is large: the window is twice the fused updater's
``prefetch_bytes`` (``gpu_budget_bytes`` unless the optimizer is given one,
2 GiB), and the first block's pre-forward still launched 34 tensors' updates
(4.2 GB) for 63 ms before its own kernels were queued (profiled, H100,
92f7073), while a block's forward takes ~4.5 ms of compute and its share of
the updates ~5 ms of copies. So a pre-forward launches only the pending
updates of the next ``UNITS_AHEAD`` units with any (within the room): each
is queued about two blocks' compute before its unit runs, and the host's
launches are spread over the forward as the compute they hide behind is.

[Note: the backward's last copies out wait for the first unit]
The buckets the next forward cannot take (its first streamed unit's, and
the model's own, whose forward encloses the step: GPT-2's tied embedding,
1.26 GB of state at 1.3B) are updated last in the updating backward, and
their copies out were the last queued on the copy-out engine, in flight as
the next forward began (those the learned order updates last, that is: an
untied head's bucket, updated as the backward begins, is not one). A
device scalar the model reads there (the ``.item()`` of the Note above)
has its copy queued behind them: the host waited 39 ms a step for it with
the compute stream idle (a trace of three steps back to back, H100 at
100.7 GB/s, b2a30fb), 22 ms once the first block's refill was bounded
(ce70b42). So, where the forward has updates to run ([Note: updates
before the next forward]), those buckets keep their new state on the
device (WRITING) and their copies out are queued at the next forward's
first unit, after the model's preamble, or when anything settles first (a
read, a commit, the next backward). They are not counted in the fetch
window: held from the backward's end until about 40 ms into the next
forward, they are gone long before its end, the step's peak, and counted
they would hold the forward's first updates back for as long as the wait
they remove.

The gradients held take device memory from their backward to their unit's
forward, freed as that forward goes on: neither at the forward's end nor at
the backward's start, the step's peaks.

Buckets are taken along the forward order where the taken ones stay within
that share of the blocks' streamed bytes up to and at them, so they are
spread through the forward; none of the first block, which the forward
reaches before any copy could land, nor of the rest of the model (its
forward encloses the step). Only buckets whose parameters all keep their
weights on the device (``WEIGHTS``: the update refreshes them in place) are
taken; none under torch.distributed (the other ranks read the new
values at the step's end), under a model compiled whole (its backward hands
every gradient over at its end: [Note: a model compiled whole] in
tierd.client.placer), or with a window of several backwards (the window's
sum in the pool is the user's to zero after ``step()``).

Until its update runs a parameter's modules hold its tensor for between uses
(``TieredParameter``, [Note: the two tensors of a parameter] in
tierd.client.tiered_param): a read between ``step()`` and the next forward
(an EMA, a logged norm, ``state_dict``) goes through the values path, which
settles the session, and settling runs every pending update first (as do the
next backward, a new plan, a commit and detach); the unit's pre-forward puts
the compute tensors back. Training is bitwise the same as updating in the
backward: the same math on the same gradients with the same
hyper-parameters, on other streams at another time; only stochastic
rounding (``master="bf16"``) draws its random bits in the order the updates
run, so there the two agree in distribution.

[Note: updates read before their forward]
A loop that reads parameters after every ``step()`` (an EMA of the weights)
runs the waiting updates right there, after the backward and before the
forward, where nothing overlaps their copies: slower than updating them in
the backward. So once pending updates had to run before their forward, the
next updating backward holds none; if it happens again, the next two hold
none, then four, and so on up to ``MOST_SKIPPED``; a choice whose updates
all ran in their forward starts over at one. A loop that reads every step
then pays that cost on a few steps in a hundred, one that reads now and
then (a logged norm) keeps the overlap on the others. The units chosen from
keep their hooks meanwhile, so a compiled model is not traced again.
"""

from __future__ import annotations

import torch

from tierd.client.copy_stream import InflightCopy
from tierd.updates.buckets import Bucket, BucketState

#: most updating backwards that hold nothing after updates ran before their
#: forward ([Note: updates read before their forward])
MOST_SKIPPED = 64
#: the share of the streamed state updated in the next forward on a GPU by
#: default (``AttachConfig.forward_update_share``): the fastest of 0, 0.25,
#: 0.33 and 0.4 for GPT-2 1.3B capped at 48 GB (H100, 296e784: 0.454, 0.436,
#: 0.428 and 0.421 s a step; benchmarks/results/HISTORY.md, "Placement"),
#: the peak the same
FORWARD_SHARE = 0.4
#: the states of a bucket whose update waits for the next forward
WAITING = (BucketState.PENDING, BucketState.AHEAD)
#: units with pending updates past the one beginning whose updates its
#: pre-forward launches ([Note: a refill takes the room it finds])
UNITS_AHEAD = 2


class ForwardUpdates:
    """The updates of one :class:`~tierd.updates.fused.FusedUpdates` that
    wait for the next forward (see the Note above): which buckets, their
    held gradients' order, and the hand-offs each unit's forward waits for.

    Example:
        >>> fused.in_forward.choose()            # an updating backward begins  # doctest: +SKIP
        >>> fused.in_forward.before_unit(3)      # unit 3's forward begins      # doctest: +SKIP
        >>> fused.in_forward.run_all()           # before the host reads values # doctest: +SKIP
    """

    def __init__(self, fused) -> None:
        self._fused = fused
        self.share = self._share()
        self.chosen: set[int] = set()                 # bucket indices, last updating backward
        self._queue: list[Bucket] = []                # PENDING or AHEAD, forward order
        self._waiting: dict[int, list[Bucket]] = {}   # unit -> the buckets its forward waits for
        self._ready: dict[int, InflightCopy] = {}     # bucket index -> its queued update
        self._units: set[int] = set()   # units the choice takes from (hooked: stable)
        # [Note: the backward's last copies out wait for the first unit]: the
        # buckets whose copies out wait, and those kept, with what they write
        self._writes_later: set[int] = set()
        self._late: list[tuple[Bucket, list]] = []
        # [Note: updates read before their forward]: pending updates ran before
        # their forward since the last choice; updating backwards left to hold
        # nothing; how many the next early run makes hold nothing
        self._ran_early = False
        self._held = False   # the last choice held some
        self._skip = 0
        self._backoff = 1

    def _share(self) -> float:
        session = self._fused.session
        if session.share is not None:   # other ranks read the new values at the step's end
            return 0.0
        given = session.config.forward_update_share
        if given is None:   # no PCIe to use on the CPU
            return FORWARD_SHARE if session.copy.on_device else 0.0
        return given

    # ------------------------------------------------------------ backward
    def choose(self) -> None:
        """An updating backward begins: the buckets whose update will wait."""
        fused = self._fused
        session, registry = fused.session, fused.session.registry
        self.chosen, self._writes_later = set(), set()
        if not self.share or fused.window != 1 or session.hooks.compiled_whole:
            self._units = set()
            return
        chosen, taken, streamed, first, units, enclosing = set(), 0, 0, None, set(), set()
        for i in reversed(fused.order):   # forward order
            b = fused.buckets[i]
            if not fused.streams(b) or b.unit is None:
                continue
            if registry.unit_modules[b.unit] is registry.model:
                enclosing.add(b.unit)
                continue
            streamed += b.nbytes
            units.add(b.unit)
            first = b.unit if first is None else first
            if b.unit == first or not all(tp.resident for tp in b.tps):
                continue
            if taken + b.nbytes <= self.share * streamed:
                chosen.add(i)
                taken += b.nbytes
        # every streamed unit's forward fetches ahead, the first one's too
        self._units = units if chosen else set()
        if self._units:   # the learned order's last buckets of those units
            for i in reversed(fused.order):
                b = fused.buckets[i]
                if not fused.streams(b) or b.unit is None:
                    continue
                if b.unit != first and b.unit not in enclosing:
                    break
                self._writes_later.add(i)
        if self._ran_early:   # [Note: updates read before their forward]
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MOST_SKIPPED)
        elif self._held:      # the last ones all ran in their forward
            self._backoff = 1
        self._ran_early = self._held = False
        if self._skip:
            self._skip -= 1
            return
        self.chosen = chosen
        self._held = bool(chosen)

    def takes(self, b: Bucket) -> bool:
        """``b``'s update waits for the next forward (in the updating backward)."""
        return b.index in self.chosen

    def writes_later(self, b: Bucket) -> bool:
        """``b``, updated in the updating backward now, is one of its last:
        its copies out wait for the next forward's first unit."""
        return self._fused.active and b.index in self._writes_later

    def write_later(self, b: Bucket, written: list) -> None:
        """Keep ``b``'s new state (``written``: key, device tensor) until the
        next forward's first unit."""
        self._late.append((b, written))

    def _write_late(self) -> None:
        """Queue the copies out kept for the forward (WRITING -> DONE or HOST)."""
        late, self._late = self._late, []
        for b, written in late:
            self._fused.write_out(b, written)

    def hold(self, b: Bucket) -> None:
        """HOST -> PENDING: its gradients stay held by the fused updater; its
        modules hold its parameters' tensors for between uses until its
        update is queued and waited for."""
        b.to_pending({k: v.clone() if isinstance(v, torch.Tensor) else v
                      for k, v in b.group.items() if k != "params"})
        self._fused.consumed_now(b.tps)
        self._waiting.setdefault(b.unit, []).append(b)
        for tp in b.tps:
            tp.update_waits = True
        self._fused.session.registry.reinstall(b.tps)

    def queue(self) -> None:
        """The updating backward ended: the pending buckets in forward order."""
        fused = self._fused
        self._queue = [fused.buckets[i] for i in reversed(fused.order)
                       if fused.buckets[i].state is BucketState.PENDING]
        self._lease_ahead()

    # ------------------------------------------------------------ forward
    def units(self) -> set[int]:
        """Units whose forward may fetch ahead or wait for an update: those
        whose state the last updating backward streamed, if it chose any
        (whether or not it held them: the hooks stay, and compiled code is
        not traced again), and any still waiting."""
        return self._units | set(self._waiting)

    def waits(self, unit: int) -> bool:
        """The forward of unit ``unit`` must first wait for an update, or
        fetches the next pending ones."""
        return unit in self._waiting or (bool(self._queue or self._late) and unit in self._units)

    def begin(self) -> None:
        """A forward begins: the state of the first pending buckets is
        fetched, see [Note: the next forward's first fetches start as the step begins];
        their updates start at the first unit's forward, see
        [Note: the first updates wait for the first unit]. The keys of the next are asked for."""
        fused = self._fused
        most, taken = 2 * fused.prefetch_bytes, 0
        for b in self._queue:   # (one larger than the window: alone)
            if b.state is not BucketState.PENDING:
                continue
            if taken and taken + b.nbytes > most or not fused.fetch_ahead(b):
                break
            taken += b.nbytes
        self._lease_ahead()

    def before_unit(self, unit: int) -> None:
        """Unit ``unit``'s forward begins: the compute stream waits for its
        buckets' updates (queued now if not yet); its compute tensors go back
        into its modules; the next pending buckets are fetched; the copies
        out kept for the forward are queued first."""
        self._write_late()
        waiting = self._waiting.pop(unit, None)
        if not waiting:
            self._launch_ahead(unit)
            return
        for b in waiting:
            if b.state in WAITING:
                self._launch(b)
        copy = self._fused.session.copy
        for b in waiting:
            ready = self._ready.pop(b.index, None)
            if ready is not None:
                copy.wait(ready)
        self._show(waiting)
        self._launch_ahead(unit)

    def run_all(self) -> None:
        """Run every pending update now, and queue the copies out kept for the
        forward; the compute stream waits for the updates."""
        self._write_late()
        if not self._waiting:
            return
        self._ran_early = True
        for waiting in self._waiting.values():
            for b in waiting:
                if b.state in WAITING:
                    self._launch(b)
        self._queue.clear()
        self._fused.session.copy.join_updates()
        self._ready.clear()
        for waiting in self._waiting.values():
            self._show(waiting)
        self._waiting.clear()

    def _launch_ahead(self, unit: int) -> None:
        """Fetch and update the pending buckets of the next ``UNITS_AHEAD``
        units past ``unit`` in forward order, within twice the fused updater's
        ``prefetch_bytes``, as much as there is room for now ([Note: a refill
        takes the room it finds]); those fetched ahead take no more room. The
        keys of the next ones beyond are asked for (see the Note above)."""
        fused = self._fused
        most = 2 * fused.prefetch_bytes
        room = fused.window_room(most)
        units = {unit}
        while self._queue:
            b = self._queue[0]
            if b.state not in WAITING:
                self._queue.pop(0)
                continue
            if b.unit not in units and len(units) > UNITS_AHEAD:
                break
            fetched = b.state is BucketState.AHEAD
            if not fetched and b.nbytes > room and room < most:   # (one larger: alone)
                break
            units.add(b.unit)
            self._queue.pop(0)
            self._launch(b)
            room -= 0 if fetched else b.nbytes
        self._lease_ahead()

    def _lease_ahead(self) -> None:
        self._fused.lease_ahead((b for b in self._queue if b.state is BucketState.PENDING),
                                self._fused.prefetch_bytes)

    def _launch(self, b: Bucket) -> None:
        """PENDING or AHEAD -> (fetched, updated) HOST: the update queued on the update
        stream, its hand-off kept for the unit's forward."""
        session = self._fused.session
        self._fused.update_held(b)
        self._ready[b.index] = session.copy.record_update()
        session.counters.forward_update_bytes += b.nbytes

    def _show(self, waiting: list[Bucket]) -> None:
        """The parameters' compute tensors back into their modules."""
        tps = [tp for b in waiting for tp in b.tps]
        for tp in tps:
            tp.update_waits = False
        self._fused.session.registry.reinstall(tps)
