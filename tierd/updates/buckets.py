"""An optimizer bucket's lifecycle: the parameters of one unit and param
group whose optimizer state moves and is updated together (see [Note: fused
update] in ``tierd.updates.fused``, [Note: resident optimizer state] in
``tierd.updates.resident``, and
[Note: CPU updates overlapped with backward] in ``tierd.updates.cpu_update``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tierd.client.tiered_param import TieredParam
from tierd.errors import StateError


class BucketState(enum.Enum):
    """Where a bucket's optimizer state is during a fused backward.

    HOST: master weights and moments only in tierd (pool or NVMe).
    FETCHED: leased; on CUDA being copied in on the copy-in stream (event kept).
    DONE: all its parameters updated this backward; copies out queued, leases
        released after them. A bucket updated while some parameter had no
        gradient yet goes back to HOST (it is fetched again if one comes).
    RESIDENT: a pinned bucket ([Note: resident optimizer state]): master and
        moments stay on the device across steps and are updated there; no
        lease is held and the pool's copy is older while ``dirty``, or
        deleted (not ``stored``: [Note: resident state leaves the store] in
        ``tierd.updates.resident``).
    UPDATING: a CPU bucket (``cpu``) whose update runs on a host thread, in
        place in the pool: its keys are leased until the thread is done, and
        nothing may read its master, moments or compute copy before that.
    PENDING: every gradient the updating backward gave its parameters is
        final and held on the device by the fused updater; the update waits
        for the next forward of the bucket's unit, or for anything that reads
        its values first ([Note: updates before the next forward] in
        ``tierd.updates.forward``). Master and moments only in tierd, no lease
        held; its parameters' modules hold their tensors for between uses.
        Its fetch makes it FETCHED, and the update then runs as any other.
    AHEAD: PENDING, with its state fetched as the next step began (see
        [Note: the next forward's first fetches start as the step begins] in
        ``tierd.updates.forward``): leased, on CUDA being copied in (event
        kept), its update still waiting. Its update makes it FETCHED first;
        given back unused ([Note: a fetch that finds no room] in
        ``tierd.updates.fused``) it is PENDING again.
    WRITING: updated in the backward, every parameter; its new state is on
        the device and its copies out wait for the next forward's first unit
        ([Note: the backward's last copies out wait for the first unit] in
        ``tierd.updates.forward``), its keys leased meanwhile. Nothing may
        fetch it before they are queued (settling queues them).
    """

    HOST = "host"
    FETCHED = "fetched"
    DONE = "done"
    RESIDENT = "resident"
    UPDATING = "updating"
    PENDING = "pending"
    AHEAD = "ahead"
    WRITING = "writing"


@dataclass(eq=False)
class Bucket:
    """The parameters of one unit and param group, updated together."""

    index: int
    group: dict
    tps: list[TieredParam]
    nbytes: int                    # fp32 bytes copied in (master + moments)
    state: BucketState = BucketState.HOST
    keys: list[str] = field(default_factory=list)
    work: dict[str, torch.Tensor] = field(default_factory=dict)   # key -> device tensor
    copy: object = None            # InflightCopy of the copy in (CUDA only)
    readers: list = field(default_factory=list)   # compute copies made from work
    reserved: object = None        # new slots of its shared keys, asked at fetch
    pinned: bool = False           # its state stays on the device once fetched
    # the unit's small parameters: pinned while their weights stay on the
    # device ([Note: small state stays on the device] in tierd.updates.fused)
    small: bool = False
    dirty: bool = False            # RESIDENT with values the pool does not have yet
    stored: bool = True            # the store has (maybe older) copies of its values
    cpu: bool = False              # updated in the pool by host threads (placement)
    update: object = None          # UPDATING: the Future of its CPU update
    unit: int | None = None        # the unit whose modules hold its parameters
    # PENDING until its update: the param group's hyper-parameters when its
    # gradients became final (what an update in that backward would have used)
    hyper: dict | None = None

    @property
    def grad_bytes(self) -> int:
        """Bytes of its stored gradients (what a CPU update copies out)."""
        return sum(tp.grad_nbytes for tp in self.tps)

    def _expect(self, *accepted: BucketState, action: str) -> None:
        if self.state not in accepted:
            raise StateError(
                f"optimizer bucket {self.index} ({self.tps[0].name!r}...) cannot {action}: "
                f"it is {self.state.name}, {action} needs "
                f"{'/'.join(s.name for s in accepted)}")

    def to_fetched(self, work: dict[str, torch.Tensor], copy, *, ahead: bool = False) -> None:
        """HOST or PENDING -> FETCHED: leased, ``work`` being filled by ``copy``
        (CUDA) or in place. ``ahead``: PENDING -> AHEAD, its update still waiting."""
        if ahead:
            self._expect(BucketState.PENDING, action="be fetched ahead of its update")
        else:
            self._expect(BucketState.HOST, BucketState.PENDING, action="be fetched")
        self.work, self.copy = work, copy
        self.state = BucketState.AHEAD if ahead else BucketState.FETCHED

    def to_update_ahead(self) -> None:
        """AHEAD -> FETCHED: its update begins on the state fetched ahead."""
        self._expect(BucketState.AHEAD, action="update its state fetched ahead")
        self.state = BucketState.FETCHED

    def to_pending_again(self) -> None:
        """AHEAD -> PENDING: its fetch given back (its leases released), the
        update still waiting with the hyper-parameters kept."""
        self._expect(BucketState.AHEAD, action="give back its fetch")
        self.work, self.copy, self.readers, self.state = {}, None, [], BucketState.PENDING

    def to_updated(self, *, all_params: bool, writes_later: bool = False) -> None:
        """FETCHED -> DONE (every parameter updated) or HOST (one may still get a
        gradient: fetched again then); the copies out hold what it needs.
        ``writes_later`` (every parameter updated): WRITING, its copies out
        not queued yet."""
        self._expect(BucketState.FETCHED, action="finish its update")
        if writes_later and not all_params:
            raise StateError(f"optimizer bucket {self.index} ({self.tps[0].name!r}...) may "
                             "get another gradient: its copies out cannot wait")
        self.work, self.copy, self.readers, self.hyper = {}, None, [], None
        self.state = (BucketState.WRITING if writes_later
                      else BucketState.DONE if all_params else BucketState.HOST)

    def to_written(self, *, step_ended: bool) -> None:
        """WRITING -> DONE (its copies out queued), or HOST once the step
        that updated it has ended."""
        self._expect(BucketState.WRITING, action="queue its copies out")
        self.state = BucketState.HOST if step_ended else BucketState.DONE

    def to_pending(self, hyper: dict) -> None:
        """HOST -> PENDING: its gradients are final and held; ``hyper`` (the
        group's hyper-parameters now) is what its update will use."""
        self._expect(BucketState.HOST, action="wait for the next forward")
        self.hyper, self.state = hyper, BucketState.PENDING

    @property
    def hyper_parameters(self) -> dict:
        """What its update uses: ``hyper`` while one is kept, else its group's."""
        return self.group if self.hyper is None else self.hyper

    def to_updating(self, keys: list[str], update) -> None:
        """HOST -> UPDATING: ``keys`` leased, ``update`` (a Future) runs the CPU update."""
        self._expect(BucketState.HOST, action="start a CPU update")
        if not self.cpu:
            raise StateError(f"optimizer bucket {self.index} ({self.tps[0].name!r}...) is "
                             "not placed on the CPU; its update runs on the device")
        self.keys, self.update, self.state = keys, update, BucketState.UPDATING

    def to_updated_on_host(self) -> None:
        """UPDATING -> HOST: the CPU update ended (its leases are released)."""
        self._expect(BucketState.UPDATING, action="end a CPU update")
        self.keys, self.update, self.state = [], None, BucketState.HOST

    def to_resident(self) -> None:
        """FETCHED or RESIDENT -> RESIDENT: its state stays on the device, newer
        than the pool's ([Note: resident optimizer state])."""
        self._expect(BucketState.FETCHED, BucketState.RESIDENT, action="stay resident")
        self.copy, self.readers = None, []
        self.state, self.dirty = BucketState.RESIDENT, True
        for tp in self.tps:   # its write-back writes their compute copies from now on
            tp.stale_in_store = False

    def left_store(self) -> None:
        """RESIDENT: the store's older copies of its values were deleted
        ([Note: resident state leaves the store] in ``tierd.updates.resident``)."""
        self._expect(BucketState.RESIDENT, action="leave the store")
        self.stored = False

    def written_back(self) -> None:
        """RESIDENT: the store has its current values (until the next update)."""
        self._expect(BucketState.RESIDENT, action="be written back")
        self.stored, self.dirty = True, False

    def discard(self) -> None:
        """RESIDENT -> HOST without writing back: the values were read (detach),
        or the store has the owner's (a replica under torch.distributed)."""
        self._expect(BucketState.RESIDENT, action="be discarded")
        self.work, self.copy, self.readers = {}, None, []
        self.state, self.dirty, self.stored = BucketState.HOST, False, True

    def to_host(self) -> None:
        """Back to HOST: after the step (DONE), a fetch not used (FETCHED), or
        resident state written back (RESIDENT, not dirty)."""
        self._expect(BucketState.HOST, BucketState.FETCHED, BucketState.DONE,
                     BucketState.RESIDENT, action="go back to the host")
        if self.state is BucketState.RESIDENT and self.dirty:
            raise StateError(f"optimizer bucket {self.index} ({self.tps[0].name!r}...) holds "
                             "values the pool does not have; write them back first")
        self.work, self.copy, self.readers, self.hyper = {}, None, [], None
        self.state = BucketState.HOST


def update_window(buckets: list[Bucket], prefetch_bytes: int) -> int:
    """Most device bytes a fused update over ``buckets`` holds at once in a
    backward, resident state aside: streamed buckets' state fetched within
    twice ``prefetch_bytes`` plus the one updating now (fetched whatever its
    size), never more than all of it (a LoRA model's adapters: well under the
    prefetch); and the gradients: the bucket updating holds its own as
    delivered and in fp32, and its new compute-dtype values, while backward,
    which goes on meanwhile ([Note: fused update] in tierd.updates.fused),
    delivers the next one's ([Note: the update window] in tierd.client.placer)."""
    if not buckets:
        return 0
    computed = [sum(tp.param.numel() * tp.param.element_size() for tp in b.tps)
                for b in buckets]
    updating = max(sum(4 * tp.param.numel() for tp in b.tps) + 2 * c
                   for b, c in zip(buckets, computed))
    grads = updating + max(computed)
    streamed = [b.nbytes for b in buckets if not b.pinned and not b.cpu]
    return grads + (min(2 * prefetch_bytes + max(streamed), sum(streamed)) if streamed else 0)

