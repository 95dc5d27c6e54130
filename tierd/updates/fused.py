"""The optimizer update fused into backward.

[Note: fused update]
On the backward that ends an accumulation window, each parameter is updated
as soon as its gradient is final, on the compute device, and the gradient
never crosses PCIe. Parameters are grouped in *buckets*, one per unit
(module) and param group, so leases, copies and events are per bucket:

1. Ahead of the gradients, in the learned order in which buckets completed in
   the last backward (initially: reverse forward order), the bucket's fp32
   master weights and moments (and the gradient summed in the pool by the
   window's earlier backwards, if any) are leased and copied in on the copy-in
   stream, keeping at most ``prefetch_bytes`` of them on the device.
2. A gradient is final when autograd has delivered it as many times as in the
   last backward (several times only under reentrant checkpointing); when all
   of a bucket's gradients are, the update stream ([Note: the update stream]
   in tierd.client.copy_stream) waits for the bucket's copy and runs the
   optimizer's own per-parameter math (bitwise the deferred path's), then
   casts the new compute-dtype value; backward goes on meanwhile.
3. Master, moments and the new value (not a device-kept one's: [Note: kept
   weights are written when the store is read]) go back to the pool on the
   copy-out stream; leases go after that copy's event (tierd.client.releases).

[Note: compute copy from the fetched master]
A parameter's backward needs its compute-dtype value, and its bucket's
update needs its fp32 master: two copies in of the same weights. When the
bucket is already fetched as the parameter is swapped in, the session casts
the fetched master on the copy-in stream (behind the bucket's copy) instead
of copying the stored compute copy in: bitwise the same value (the stored
one was cast from this master), and 2 B/param (bf16) less over PCIe in every
updating backward. The cast is recorded in ``Bucket.readers``; the update,
which changes the master in place, waits for it. So that the bucket comes
first, a prefetched parameter whose bucket is still to be fetched is not
copied in early (:meth:`FusedUpdates.will_fetch`); when it is needed, its
bucket is fetched then.

[Note: new values kept for the next step]
The last buckets updated in backward hold the first weights the next forward
uses (the embedding, the first blocks). Copying their new compute values out
and straight back in would make the next step wait for every copy out queued
before them. On CUDA the session keeps those in its first prefetch window
(within ``gpu_budget_bytes``) on the device instead
(:meth:`tierd.client.mover.Mover.keep_new_value`): between steps only they hold storage.
At the end of backward, buckets with a missing gradient are updated with what
they have (a parameter with no gradient at all is skipped, as torch does).

[Note: leases asked ahead]
Unless the pool holds them ([Note: held leases] in tierd.client.leases), a
bucket's keys are leased as it is fetched, and the host waits there for the
daemon's grant (``lease_wait_seconds``), in backward, where the host must
keep issuing the copies that keep the link busy. So beyond the fetch window
the keys of the next buckets in the learned order (within a quarter of
``prefetch_bytes``, and of the lease cap) are asked for early, and the grant
is in by the fetch; the fetch takes its own reference on them and drops the
early one, and what no fetch took is released as the backward ends.

[Note: small state stays on the device]
A bucket's update costs the host about the same per tensor whatever its
size: a buffer, a copy in and out of each master and moment, a cast. The
biases and norm weights of a block are most of its tensors (GPT-2: 8 of
12) and a fraction of a percent of its bytes, yet with the state of a unit
that keeps only its weights on the device they streamed like the rest: GPT-2
1.3B capped at 48 GB spent 0.28 s a step of host time launching 147 bucket
updates of 292 tensors (H100, 51fd7de), and the host, not PCIe, bounded the
step. So on a device, a unit's parameters with at most 1/``SMALL_SHARE`` of
its largest parameter's elements form one bucket of their own (``small``),
and while their weights stay on the device, their state does too, as a
resident unit's does ([Note: resident optimizer state] in
tierd.updates.resident): only the large tensors' state crosses PCIe.
Placement counts those bytes with the unit's weights
(``UnitBytes.weights_state_bytes``). Not on the CPU, where no copy or launch
is saved, nor under torch.distributed, where an owner's state is read by
the other ranks from the store.

[Note: parameters resident for good keep their state on the device]
``attach(resident_below_bytes=N)`` keeps the parameters smaller than N on
the device for good (norms; LoRA's adapters under a streamed frozen base),
as attach does with adapters by default ([Note: adapters stay on the device]
in tierd.client.registry). Their state streamed every step all the same: placement pins the buckets of
the units it places, and these belong to no unit. On the 70B LoRA step
capped at 24 GB (H100, 5829cd6) the adapters' fp32 masters and moments,
0.79 GB, crossed PCIe out (and in) every step and took pool room from the
frozen base. So on a device their buckets (``TieredParam.resident_for_good``;
the parameters a plan made resident before the optimizer was built get
buckets of their own, the plan's to pin) are small ones pinned from the
start: their state stays there from its first update on and leaves the
store ([Note: resident state leaves the store] in tierd.updates.resident).
The placer counts those bytes as the model's own, with activations (they
are not the plan's: ``resident_bytes`` leaves them out, so the step's
reading keeps them), as their weights, allocated before its first reading,
are. Not on the CPU nor under torch.distributed, as for small state.

The first backward only learns (delivery counts and order); ``step()``
updates its window. On the CPU the same code runs on the pool views in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from tierd.client.copy_stream import InflightCopy
from tierd.client.optimizers import SMALL_SHARE
from tierd.client.tiered_param import TieredParam
from tierd.updates.buckets import Bucket, BucketState
from tierd.updates.cpu_update import HostUpdates
from tierd.updates.forward import ForwardUpdates
from tierd.updates.resident import fetch_pooled_grads, leave_store, write_back, writes_compute_copy
from tierd.errors import CapacityError, StateError


def keeps_small_state(session) -> bool:
    """Small buckets of their own ([Note: small state stays on the device])."""
    return session.copy.on_device and session.share is None


class FusedUpdates:
    """Runs one optimizer's updates inside the backwards of one session.

    Example:
        >>> fused = FusedUpdates(opt, session, tps_by_group)   # doctest: +SKIP
        >>> session.optimizers.append(fused)                    # doctest: +SKIP
    """

    def __init__(self, opt, session, groups: list[tuple[dict, list[TieredParam]]],
                 prefetch_bytes: int, *, fusing: bool = True) -> None:
        self.opt, self.session = opt, session
        self.keep_small = keeps_small_state(session)
        # False: updates run in step() (clipping); the buckets still hold the
        # state placement keeps on the device ([Note: resident optimizer state])
        self.fusing = fusing
        self.prefetch_bytes = prefetch_bytes
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[TieredParam, Bucket] = {}
        self._build(groups)
        self.order = list(range(len(self.buckets)))[::-1]  # reverse forward order
        self.expected: dict[TieredParam, int] = {}
        self.learned = False
        # backwards per window: the optimizer's accumulation_steps, or those of
        # the first window (counted until its step())
        self.window: int | None = opt.accumulation_steps
        self.backwards = 0           # outermost backwards ended since step()
        self.active = False          # this backward updates (ends the window)
        self.updated = False         # a fused update ran since the last step()
        self.fused_backwards = 0     # backwards that ran fused updates, all told
        self._got: dict[TieredParam, int] = {}
        self._grads: dict[TieredParam, torch.Tensor] = {}
        self._updated: set[TieredParam] = set()   # updated in this backward
        self._seen: list[int] = []   # bucket first-delivery order this backward
        self._cursor = 0
        self._fetched_bytes = 0      # fetched, or updated with the copy out not landed
        # (event-only copy out, bytes): the sources were recorded on the copy
        # stream, so dropping them here cannot let their memory be reused early
        self._outstanding: list[tuple[InflightCopy, int]] = []
        # [Note: leases asked ahead]: bucket index -> its keys leased before its fetch
        self._ahead: dict[int, list[str]] = {}
        self._ahead_bytes = min(prefetch_bytes, session.lease_cap) // 4
        # buckets updated on the host ([Note: CPU updates overlapped with backward])
        self.host = HostUpdates(self)
        # updates that wait for the next forward ([Note: updates before the
        # next forward] in tierd.updates.forward)
        self.in_forward = ForwardUpdates(self)

    def _build(self, groups: list[tuple[dict, list[TieredParam]]]) -> None:
        group_of = {tp: gi for gi, (_, tps) in enumerate(groups) for tp in tps}
        size = self.opt.state_nbytes   # master and moments, in their stored forms
        # a bucket per module of a unit (a unit is a whole block: its state at
        # once would be a large bubble), split further to a lease's worth
        registry = self.session.registry
        units: list[tuple[int | None, tuple[TieredParam, ...], bool]] = []
        for u in self.session.units:
            modules = registry.module_groups(u)
            small = self._small([tp for g in modules for tp in g])
            units += [(u.index, tuple(tp for tp in g if tp not in small), False)
                      for g in modules]
            units.append((u.index, tuple(tp for g in modules for tp in g if tp in small), True))
        # resident ones: made so by a plan before this optimizer, or for their
        # size, whose buckets are small ones pinned from the start, see
        # [Note: parameters resident for good keep their state on the device].
        resident = [tp for tp in group_of if tp.resident]
        units += [(None, tuple(tp for tp in resident if tp.resident_for_good), self.keep_small),
                  (None, tuple(tp for tp in resident if not tp.resident_for_good), False)]
        most = self.session.lease_cap
        for unit, params, small in units:
            for gi in dict.fromkeys(group_of[tp] for tp in params if tp in group_of):
                tps = [tp for tp in params
                       if group_of.get(tp) == gi and tp not in self.bucket_of]
                while tps:
                    piece, nbytes = [], 0
                    while tps and (not piece or nbytes + size(tps[0]) <= most):
                        nbytes += size(tps[0])
                        piece.append(tps.pop(0))
                    b = Bucket(len(self.buckets), groups[gi][0], piece, nbytes, unit=unit,
                               small=small, pinned=small and unit is None)
                    self.buckets.append(b)
                    for tp in piece:
                        self.bucket_of[tp] = b

    def _small(self, tps: list[TieredParam]) -> set[TieredParam]:
        """The parameters of a unit (``tps``) whose state stays on the device
        while their weights do ([Note: small state stays on the device])."""
        if not self.keep_small or not tps:
            return set()
        largest = max(tp.param.numel() for tp in tps)
        return {tp for tp in tps if tp.param.numel() * SMALL_SHARE <= largest}

    # ------------------------------------------------------------ window
    def begin_backward(self) -> None:
        """The outermost backward starts: decide whether it updates."""
        self.in_forward.run_all()   # (run in the forward, as a rule)
        if self.updated:
            raise StateError(
                f"backward ran again after a fused optimizer update but before opt.step(): "
                f"this window is longer than {self.window} backwards (learned from the "
                "first window, or given), and the update of its first backwards has "
                "already run: resume from the last commit (or restart) with "
                "accumulation_steps=N (the longest window) or fused=False for the tierd "
                "optimizer")
        if self.opt.needs_zero_grad:
            if self.session.grad_views.has_gradient(self.bucket_of):
                raise StateError(
                    "backward ran after opt.step() without opt.zero_grad(): tierd's fused "
                    "optimizer consumes gradients inside backward; call opt.zero_grad() "
                    "after step(), or pass fused=False to keep accumulating across steps")
            self.opt.needs_zero_grad = False   # zeroed through p.grad (model.zero_grad())
        self.active = self.fusing and self.learned and self.backwards + 1 == self.window
        self._got.clear()
        self._seen.clear()
        self._updated.clear()
        self._cursor = 0
        if self.active:
            self.in_forward.choose()
            self.prefetch()

    def streams(self, b: Bucket) -> bool:
        """``b``'s state crosses PCIe for its update in an updating backward."""
        return not (b.pinned or b.cpu or not any(self.expected.get(tp, 0) for tp in b.tps))

    def on_grad(self, tp: TieredParam, grad: torch.Tensor) -> bool:
        """A gradient of ``tp`` arrived; True if consumed here (not sent to the pool)."""
        bucket = self.bucket_of.get(tp)
        if bucket is None:
            return False
        if bucket.state is BucketState.UPDATING:   # its grad key is still read
            self.host.wait_for_bucket(bucket)
        self._got[tp] = self._got.get(tp, 0) + 1
        if bucket.index not in self._seen:
            self._seen.append(bucket.index)
        if not self.active:
            return False
        if tp in self._updated:
            raise StateError(
                f"parameter {tp.name!r} got a gradient after its fused update (more "
                "deliveries than in the learned backward); pass fused=False")
        g = grad.detach()
        prev = self._grads.get(tp)
        if prev is not None:
            self._grads[tp] = prev.to(torch.float32).add_(g)
        elif self.in_forward.takes(bucket) and self.expected.get(tp, 0) == 1:
            self._grads[tp] = g   # made fp32 at its update (tierd.updates.forward)
        else:
            self._grads[tp] = g.to(torch.float32)
        # final when every parameter still waited for has all its deliveries
        # (a parameter unused in the learned backward is not waited for)
        if all(self._got.get(p, 0) >= self.expected.get(p, 1) for p in bucket.tps
               if p not in self._updated and (self.expected.get(p, 0) > 0 or p in self._grads)):
            if self.in_forward.takes(bucket):
                self.in_forward.hold(bucket)
            else:
                self._update(bucket)
        return True

    def end_backward(self) -> None:
        """The outermost backward ended: update what is left, learn the order."""
        self.backwards += 1
        if self.active:
            for b in self.buckets:
                if any(tp not in self._updated and (tp in self._grads or tp.grad_in_pool)
                       for tp in b.tps):
                    if self.in_forward.takes(b) and b.state is BucketState.HOST:
                        self.in_forward.hold(b)
                    else:
                        self._update(b)
            self.session.copy.join_updates()   # [Note: the update stream]
            self._release_fetched()   # copies out go on landing into the next step
            self.updated, self.active = True, False
            self.fused_backwards += 1
        for tp, n in self._got.items():
            self.expected[tp] = max(self.expected.get(tp, 0), n)
        if self._seen:
            self.order = self._seen + [i for i in self.order if i not in self._seen]
        self.in_forward.queue()
        self.learned = True

    def consumed(self) -> set[TieredParam]:
        """The parameters whose gradient the last backward's update used up
        (or holds for an update before the next forward)."""
        return self._updated if self.updated else set()

    def after_step(self) -> None:
        if self.window is None and self.backwards:
            self.window = self.backwards   # the first window sets the length
        for b in self.buckets:   # PENDING (and AHEAD) ones are updated at the
            # next forward, WRITING ones written there
            if b.state not in (BucketState.RESIDENT, BucketState.UPDATING, BucketState.PENDING,
                               BucketState.AHEAD, BucketState.WRITING):
                b.to_host()
        self.updated, self.backwards = False, 0
        self.host.reap()   # the window is closed first: a failed CPU update raises here

    def settle(self, *, write_resident: bool = True) -> None:
        """Nothing fetched, every copy out landed, resident state written to
        the pool (before the host reads the pool; not with ``write_resident=False``)."""
        self.in_forward.run_all()
        self.session.copy.join_updates()
        self.host.wait_all()
        if not self.active:
            self._release_fetched()
            for done, nbytes in self._outstanding:
                done.synchronize()
                self._fetched_bytes -= nbytes
            self._outstanding.clear()
            for b in self.buckets:
                if b.dirty and write_resident:
                    write_back(self.session, self.opt, b)

    # ---------------------------------------- for the updates in the next forward
    def consumed_now(self, tps: list[TieredParam]) -> None:
        """``tps``' gradients are taken for an update (held: tierd.updates.forward)."""
        self._updated.update(tps)

    def window_room(self, most: int) -> int:
        """Bytes a fetch may add now beside what is fetched and not landed,
        within ``most``."""
        self._reclaim()
        return most - self._fetched_bytes

    def fetch_ahead(self, b: Bucket) -> bool:
        """PENDING -> AHEAD: fetch ``b``'s state now, its update still waiting
        (see [Note: the next forward's first fetches start as the step begins]
        in tierd.updates.forward). False, ``b`` still PENDING and nothing
        leased for it, where the pool has no room now ([Note: a fetch that
        finds no room]): its update fetches it, as one not fetched ahead."""
        try:
            self._fetch(b, ahead=True)
        except CapacityError:
            return False
        return True

    def update_held(self, b: Bucket) -> None:
        """PENDING or AHEAD -> HOST: fetch ``b`` (if not yet) and queue its
        update on its held gradients ([Note: updates before the next forward]
        in tierd.updates.forward)."""
        self._updated.difference_update(b.tps)
        self._update(b)
        if b.state is BucketState.DONE:
            b.to_host()

    # ------------------------------------------------------------ residency
    def pin(self, tps: list[TieredParam]) -> int:
        """Keep the state of the buckets made only of ``tps`` (resident
        parameters), and of the small buckets whose weights stay on the device
        ([Note: small state stays on the device]), there from their next
        update on; returns the bytes."""
        chosen = set(tps)
        pinned = [b for b in self.buckets if not b.pinned
                  and (b.small or all(tp in chosen for tp in b.tps))
                  and all(tp.resident for tp in b.tps)]
        self.host.wait_all()
        for b in pinned:
            b.pinned, b.cpu = True, False
        return sum(b.nbytes for b in pinned)

    def unpin(self, tps: list[TieredParam] | None = None) -> None:
        """Stream the state of the buckets with any of ``tps`` (all: None) again;
        device values are written to the pool first."""
        chosen = None if tps is None else set(tps)
        for b in self.buckets:
            if b.pinned and (chosen is None or any(tp in chosen for tp in b.tps)):
                self.drop_resident(b)
                b.pinned = False

    def drop_resident(self, b: Bucket | None = None) -> None:
        """Write resident state back and free it (every bucket: None); a
        pinned bucket is fetched and kept again at its next update."""
        for bucket in self.buckets if b is None else [b]:
            if bucket.state is BucketState.RESIDENT:
                if bucket.dirty:
                    write_back(self.session, self.opt, bucket)
                bucket.to_host()

    def discard_resident(self) -> None:
        """Forget resident state without writing it back (detach has read it)."""
        self.host.wait_all()
        for b in self.buckets:
            if b.state is BucketState.RESIDENT:
                b.discard()

    def resident_work(self, tp: TieredParam) -> dict[str, torch.Tensor] | None:
        """The device state of ``tp``'s pinned bucket for an update in
        ``step()`` (fetched and kept now if it is not yet); None when its
        state streams. The caller changes it: the pool's copy is older after."""
        b = self.bucket_of.get(tp)
        if b is None or not b.pinned:
            return None
        if b.state is BucketState.HOST:
            self._fetch(b)
            if b.copy is not None:
                self.session.copy.wait(b.copy)
        self._keep(b)   # dirty from now on; the store's copies go
        return b.work

    def resident_bytes(self) -> int:
        """Device bytes the state of the resident buckets holds: not
        a master that is the compute copy itself (``master="bf16"``), whose
        bytes are the weights' (the placer counts those), nor the state of
        parameters resident for good, which is the model's own, see
        [Note: parameters resident for good keep their state on the device]."""
        return sum(b.nbytes - sum(self.opt.master_nbytes(tp) for tp in b.tps
                                  if self.opt.master_in_compute(tp))
                   for b in self.buckets if b.state is BucketState.RESIDENT
                   and not (b.unit is None and b.small))

    def _keep(self, b: Bucket) -> None:
        """FETCHED (just updated) or RESIDENT -> RESIDENT: the leases of a
        fresh fetch go (the pool keeps its older bytes; ``dirty`` says so)."""
        for tp in b.tps:
            b.work.pop(tp.grad_key, None)
        leaves = b.stored and self.session.share is None
        if b.state is BucketState.FETCHED:
            # the copy in may still read the pool: its keys go after its event
            # (at once when the keys are deleted next, which happens once)
            copied = set(b.copy.keys) if b.copy is not None and not leaves else set()
            rest = [k for k in b.keys if k not in copied]
            if leaves and b.copy is not None:
                b.copy.synchronize()
            if rest:
                self.session.leases.release(rest)
            if copied:
                self.session.releases.add(b.copy, written=False)
            self._fetched_bytes -= b.nbytes
        b.to_resident()
        if leaves:   # [Note: resident state leaves the store] in tierd.updates.resident
            leave_store(self.session, self.opt, b)

    def will_fetch(self, tp: TieredParam) -> bool:
        """``tp``'s master is to be fetched for this backward's update, and is not
        yet; or a CPU update still writes its compute copy: either way, not
        to be copied in yet."""
        b = self.bucket_of.get(tp)
        if b is not None and b.cpu:
            return self.host.running(b)
        if not self.active or b is None or tp in self._updated:
            return False
        if b.state is BucketState.HOST:
            self.prefetch()
        return b.state is BucketState.HOST

    def fetched_master(self, tp: TieredParam) -> torch.Tensor | None:
        """``tp``'s master fetched for this backward's update, not yet
        updated ([Note: compute copy from the fetched master]); its bucket is
        fetched now if it was still to be and fits twice ``prefetch_bytes``
        (the most the fetches may hold). None otherwise."""
        b = self.bucket_of.get(tp)
        if not self.active or b is None or b.cpu or tp in self._updated:
            return None
        if b.state is BucketState.HOST:
            self.prefetch()
        if b.state is BucketState.HOST:
            self._reclaim()
            if self._fetched_bytes + b.nbytes > 2 * self.prefetch_bytes:
                return None
            self._fetch(b)
        return b.work.get(self.opt.master_key(tp))

    def read_master(self, tp: TieredParam, copy) -> None:
        """A compute copy of ``tp`` is being made from its fetched master by ``copy``."""
        self.bucket_of[tp].readers.append(copy)

    # ------------------------------------------------------------ movement
    def _reclaim(self, need: int = 0) -> None:
        """Count the bytes of buckets whose copy out has landed as free again;
        with ``need``, wait for the oldest ones until ``need`` more fit (this is
        what keeps the host from queueing more state than the budget)."""
        while self._outstanding:
            copy, nbytes = self._outstanding[0]
            if not copy.done():
                # block only far over the budget: a host that waits cannot queue
                # the backward kernels that keep the GPU busy meanwhile
                if not need or self._fetched_bytes + need <= 2 * self.prefetch_bytes:
                    return
                t0 = time.perf_counter()
                copy.synchronize()
                self.session.counters.wait_seconds += time.perf_counter() - t0
            self._outstanding.pop(0)
            self._fetched_bytes -= nbytes

    def prefetch(self) -> None:
        """Fetch upcoming buckets (learned order) while ``prefetch_bytes`` allow.

        Measured and dropped on the H200 (5695075): starting this fetch as the
        forward begins, where every weight is on the device, raised the step's
        peak by 2-3 GB (placement then kept less: 1.3B capped at 48 GB went
        from 0.34 to 0.39 s), and fetching ahead while the previous bucket's
        copy out lands left 8B capped at 100 GB as it was (1.10 s)."""
        if not self.active:
            return
        self._reclaim()
        while self._cursor < len(self.order):
            b = self.buckets[self.order[self._cursor]]
            if b.state is BucketState.HOST and not b.cpu and not self.in_forward.takes(b):
                if self._fetched_bytes and self._fetched_bytes + b.nbytes > self.prefetch_bytes:
                    self.lease_ahead(self._next_streamed(), self._ahead_bytes)
                    return
                self._fetch(b)
            self._cursor += 1

    def _next_streamed(self) -> Iterator[Bucket]:
        """The buckets this backward fetches after the cursor, in order."""
        for i in self.order[self._cursor:]:
            b = self.buckets[i]
            if b.state is BucketState.HOST and not self.in_forward.takes(b):
                yield b

    def lease_ahead(self, buckets: Iterable[Bucket], most: int) -> None:
        """Ask for the keys of ``buckets`` (streamed, in the order they will be
        fetched) while the keys asked ahead stay within ``most`` bytes
        ([Note: leases asked ahead])."""
        leases, opt = self.session.leases, self.opt
        leased = sum(self.buckets[i].nbytes for i in self._ahead)
        for b in buckets:
            if b.cpu or b.pinned or b.index in self._ahead:
                continue
            if leased + b.nbytes > most:
                return
            keys = [k for tp in b.tps for k in opt.state_keys(tp) if k not in opt.unmade]
            if keys and not all(leases.is_held(k) for k in keys):
                leases.acquire(keys)
                self._ahead[b.index] = keys
                leased += b.nbytes

    def _fetch(self, b: Bucket, *, ahead: bool = False) -> None:
        self._reclaim(need=b.nbytes)
        # units placed whole run no hooks, so the mover does not drain in their
        # backward: without this the leases of every resident bucket fetched
        # (released after their copy in) would pin the pool until the step ends
        self.session.releases.drain()
        opt, session = self.opt, self.session
        # moments not made yet: a pinned bucket makes them on the device, the
        # others in the store ([Note: state made when first needed] in tierd.optim.state)
        fresh = opt.unmade.values(b.tps, session.device) if b.pinned else {}
        if not b.pinned:
            opt.unmade.ensure_stored(b.tps)
        # a master that is the resident device copy is updated there, not read
        on_device = {tp.key: tp.compute for tp in b.tps if opt.master_on_device(tp)}
        read = [k for tp in b.tps for k in opt.state_keys(tp)
                if k not in fresh and k not in on_device]
        read += [tp.grad_key for tp in b.tps if tp.grad_in_pool]
        b.keys = read + list(on_device) + [tp.key for tp in b.tps
                                           if writes_compute_copy(session, opt, tp)]
        fresh = {**fresh, **on_device}
        session.leases.acquire(b.keys)
        asked = self._ahead.pop(b.index, None)
        if asked:   # granted early ([Note: leases asked ahead]): the fetch's reference stays
            session.leases.release(asked)
        views = self._leased_views(b)
        copy = session.copy
        if copy.on_device:
            dsts, done = copy.copy_in_new([views[k] for k in read], tuple(read))
            b.to_fetched({**dict(zip(read, dsts)), **fresh}, done, ahead=ahead)
        else:   # in place in the pool, but a shared key gets a new version instead,
            # and a pinned bucket's state leaves the pool (its leases go after the update)
            shared = session.leases.shared
            b.to_fetched({**{k: v.clone() if b.pinned or k in shared else v
                             for k, v in views.items()}, **fresh}, None, ahead=ahead)
        if session.leases.shared and not b.pinned:   # the daemon answers while the copy runs
            b.reserved = session.share.reserve(b.tps)
        self._fetched_bytes += b.nbytes

    def _leased_views(self, b: Bucket) -> dict[str, torch.Tensor]:
        """The pool views of ``b``'s keys (acquired).

        [Note: a fetch that finds no room]
        The pool hands out contiguous slots in segments, so bytes free are not
        room: a 1 MiB tensor found none in a 20 MiB pool of 1.25 MiB segments
        with 6 MB free, every segment holding a leased tensor and a hole
        under 0.8 MiB (tests/optim/test_resident_store.py, a GPT-2 of 1 MiB
        matrices). What the session leased ahead of need is given back then,
        once its copies have landed, and the fetch asks once more
        (:meth:`tierd.client.mover.Mover.give_back_ahead`): parameters
        prefetched whose copy has not started, the updaters' keys asked ahead
        and buckets fetched before their gradients were final. All of them
        are asked again when they are used. A parameter's lease at its unit's
        forward or backward falls back the same way (6 MiB pools, below)."""
        leases = self.session.leases
        try:
            return leases.views(b.keys)
        except CapacityError:
            if not self.session.mover.give_back_ahead():
                leases.release(b.keys)   # the refused request's references
                raise
        leases.release(b.keys)
        leases.acquire(b.keys)
        try:
            return leases.views(b.keys)
        except CapacityError:
            leases.release(b.keys)
            raise

    def holds_ahead(self) -> bool:
        """Whether this updater holds leases asked or fetched ahead of need."""
        return bool(self._ahead) or any(b.state in (BucketState.FETCHED, BucketState.AHEAD)
                                        for b in self.buckets)

    def give_back_ahead(self) -> None:
        """Give back, once their copies have landed, the leases this updater
        holds ahead of need ([Note: a fetch that finds no room]): keys asked
        ahead and buckets fetched before their gradients were final or ahead
        of their update in the next forward (those are fetched again when
        their update comes). The session's mover
        calls this, then drains the releases."""
        for copy, _ in self._outstanding:
            copy.synchronize()
        self._reclaim()
        for b in self.buckets:
            if b.state is BucketState.FETCHED:
                for reader in b.readers:   # compute copies cast from its work
                    reader.synchronize()
        self._release_fetched()

    @torch.no_grad()
    def _update(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        if b.cpu:
            self.host.start(b, self._grads, self._updated)
            self.session.counters.optimizer_seconds += time.perf_counter() - t0
            return
        if b.state in (BucketState.HOST, BucketState.PENDING):
            self._fetch(b)
        elif b.state is BucketState.AHEAD:
            b.to_update_ahead()
        elif b.state is BucketState.RESIDENT:
            fetch_pooled_grads(self.session, b)
        session, copy = self.session, self.session.copy
        inputs = [t for tp in b.tps if (t := self._grads.get(tp)) is not None]
        with copy.updating(inputs + list(b.work.values())):   # [Note: the update stream]
            if b.copy is not None:
                copy.wait(b.copy)
            for reader in b.readers:   # the master changes in place below
                copy.wait(reader)
            written = self._run_math(b)
            all_params = all(tp in self._updated for tp in b.tps)   # else fetched again
            later = not b.pinned and all_params and self.in_forward.writes_later(b)
            if not b.pinned and not later:
                self._write_out(b, written)
        if b.pinned:
            self._keep(b)
        else:
            # the state is next needed here in the next step ([Note: eviction by
            # next use]); asked at once: the next fetch's leases may need the room
            # (sent a few buckets at a time, the pool evicted state needed sooner
            # and a run past the pool read more from NVMe)
            session.leases.demote([k for tp in b.tps for k in self.opt.state_keys(tp)
                                   if k != tp.key])
            b.to_updated(all_params=all_params, writes_later=later)
            if later:   # [Note: the backward's last copies out wait for the first unit]
                self._fetched_bytes -= b.nbytes
                self.in_forward.write_later(b, written)
        session.counters.optimizer_seconds += time.perf_counter() - t0
        self.prefetch()

    def _run_math(self, b: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's math for the bucket's parameters with a gradient;
        returns the (key, device tensor) pairs to write back to the pool."""
        session, opt = self.session, self.opt
        written: list[tuple[str, torch.Tensor]] = []
        by_step: dict[float, list] = {}
        for tp in b.tps:
            if tp in self._updated:
                continue
            grad = self._grads.pop(tp, None)
            if grad is not None:   # one held as delivered (tierd.updates.forward)
                grad = grad.to(torch.float32)
            if tp.grad_in_pool:   # summed in the stored dtype, as torch sums p.grad
                pooled = b.work[tp.grad_key]
                grad = pooled if grad is None else pooled.add_(grad)
            if grad is None:
                continue   # no gradient this window: torch skips the parameter
            step = opt.state[tp.outside].get("step", 0.0)
            by_step.setdefault(step, []).append((tp, grad))
        for items in by_step.values():
            tps = [tp for tp, _ in items]
            keys = [opt.state_keys(tp) for tp in tps]
            params = [b.work[k[0]] for k in keys]
            opt.update_params(b.hyper_parameters, tps, params, [g for _, g in items],
                              {n: [b.work[k[i + 1]] for k in keys]
                               for i, n in enumerate(opt.state_names)})
            for tp, k, param in zip(tps, keys, params):
                tp.to_no_gradient()
                self._updated.add(tp)
                on_device = opt.master_on_device(tp)   # ``param`` is the device copy
                if tp.resident and not on_device:
                    session.refresh_resident(tp, param)
                if b.pinned:
                    continue   # [Note: resident optimizer state] in tierd.updates.resident
                written += [(key, b.work[key]) for key in k[1:]]
                # the next update changes a device copy in place: its copy out reads a clone
                written.append((k[0], param.clone() if on_device else param))
                if not opt.separate_master(tp):
                    if not tp.resident:
                        session.keep_new_value(tp, param)
                    continue
                if not writes_compute_copy(session, opt, tp):
                    # see [Note: kept weights are written when the store is read]
                    # in tierd.updates.resident
                    tp.stale_in_store = True
                    continue
                new = param.to(tp.param.dtype)
                written.append((tp.key, new))
                if not tp.resident:
                    session.keep_new_value(tp, new)
        return written

    def write_out(self, b: Bucket, written: list[tuple[str, torch.Tensor]]) -> None:
        """WRITING -> DONE or HOST: queue the copies out held for the next
        forward (not counted in the fetch window: [Note: the backward's last
        copies out wait for the first unit] in tierd.updates.forward)."""
        self._write_out(b, written, counted=False)
        b.to_written(step_ended=not self.updated)

    def _write_out(self, b: Bucket, written: list[tuple[str, torch.Tensor]], *,
                   counted: bool = True) -> None:
        """Queue the bucket's new state and values back to the pool; its leases
        go once they have landed (``counted``: its bytes leave the fetch
        window then)."""
        session, copy = self.session, self.session.copy
        views = session.leases.views(b.keys)
        shared = session.leases.shared
        if any(k in shared for k, _ in written):
            session.share.publish([(k, t) for k, t in written if k in shared], b.reserved)
            b.reserved = None
            written = [(k, t) for k, t in written if k not in shared]
        elif b.reserved is not None:   # nothing of it updated: give the slots back
            session.client.abort([lease.key for lease in b.reserved.result()])
            b.reserved = None
        if copy.on_device:
            # every key of the bucket goes once the copy out has landed (which
            # is after the copy in, that the compute stream waited for)
            done = copy.copy_out_many([(views[k], t) for k, t in written], tuple(b.keys))
            if all(session.leases.is_held(k) for k in b.keys):
                session.leases.release(b.keys, written=True)   # the hold outlives the copy
            else:
                session.releases.add(done, written=True)
            self._outstanding.append((InflightCopy((), (), (), done.event),
                                      b.nbytes if counted else 0))
        else:
            for k, t in written:
                if views[k].data_ptr() != t.data_ptr():
                    views[k].copy_(t)
            session.leases.release(b.keys, written=True)
            if counted:
                self._fetched_bytes -= b.nbytes

    def _release_fetched(self) -> None:
        """Give back the buckets fetched but not updated in this backward, or
        fetched ahead of their update in the next forward (PENDING again), and
        the leases asked ahead for buckets not fetched."""
        for keys in self._ahead.values():
            self.session.leases.release(keys)
        self._ahead.clear()
        for b in self.buckets:
            if b.state in (BucketState.FETCHED, BucketState.AHEAD):
                if b.copy is not None:
                    b.copy.synchronize()
                self.session.leases.release(b.keys)
                if b.reserved is not None:   # asked for, never written
                    self.session.client.abort([p.key for p in b.reserved.result()])
                    b.reserved = None
                self._fetched_bytes -= b.nbytes
                if b.state is BucketState.AHEAD:
                    b.to_pending_again()
                else:
                    b.to_host()

