"""One rank's part of a node's shared copy under torch.distributed.

Only built when the model is attached with several ranks; see [Note: one copy
per node], [Note: shared and private keys] and [Note: when an update is
visible] in ``tierd.client.distributed``. It decides which rank owns each
parameter's optimizer state, reduces gradients to owners, and publishes the
owner's new versions of shared keys. Parameters of units placement keeps on
every rank's device are *replicated* ([Note: resident units are replicas]):
their gradients reach every rank, and no rank reads them from the pool; or,
with ``gpu_tier="sharded"``, updated by their owner alone, which sends the
others the new weights ([Note: resident state sharded by unit] in
``tierd.client.sharded``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tierd.client.copy_stream import CopyStream, InflightCopy
from tierd.client.distributed import GradReducer, Ranks, assign_owners
from tierd.client.leases import LeaseTable
from tierd.client.registry import ParamRegistry
from tierd.client.releases import PendingReleases
from tierd.client.sharded import ShardedResident
from tierd.client.store import Store
from tierd.client.tiered_param import TieredParam


class RankShare:
    """Owners, the gradient reducer and publishing for one rank.

    Example:
        >>> share.owns(tp)                       # doctest: +SKIP
        >>> share.publish([(tp.key, new_value)])  # doctest: +SKIP
    """

    def __init__(self, ranks: Ranks, registry: ParamRegistry, *, store: Store,
                 leases: LeaseTable, releases: PendingReleases, copy: CopyStream,
                 counters, device: torch.device, dtype: torch.dtype,
                 deliver: Callable[[TieredParam, torch.Tensor], None],
                 gpu_tier: str = "replicated",
                 device_masters: Callable[[list[TieredParam]], dict] | None = None) -> None:
        self.ranks = ranks
        self._registry = registry
        self._store = store
        self._leases = leases
        self._releases = releases
        self._copy = copy
        self._counters = counters
        seen: set[TieredParam] = set()   # a tied parameter is in its first unit only
        buckets = []
        for tps in [u.params for u in registry.units] + [tuple(registry.resident())]:
            bucket = tuple(tp for tp in tps if tp.param.requires_grad and tp not in seen)
            seen.update(bucket)
            if bucket:
                buckets.append(bucket)
        owners = assign_owners([sum(tp.param.numel() for tp in b) for b in buckets],
                               len(ranks.node_ranks))
        self.owner_of = {tp: o for b, o in zip(buckets, owners) for tp in b}
        self.reducer = GradReducer(ranks, buckets, owners, device, deliver,
                                   dtype=dtype, stats=counters)
        for tp in registry.params.values():
            leases.shared.update((tp.key, tp.master_key))
        #: every rank updates these on its device (see :meth:`replicate`)
        self.replicated: frozenset[TieredParam] = frozenset()
        #: gpu_tier="sharded": resident units are updated by their owner only
        self.sharded = None if gpu_tier != "sharded" else ShardedResident(
            ranks, buckets, self.owner_of, store=store, device=device,
            device_masters=device_masters)

    def replicable(self, tps) -> list[TieredParam]:
        """The parameters of every gradient bucket made only of ``tps`` (a
        replica needs its whole bucket: its gradients come in one reduction)."""
        chosen = set(tps)
        return [tp for bucket in self.reducer.buckets if chosen.issuperset(bucket)
                for tp in bucket]

    def bucket_tps(self, tp: TieredParam) -> tuple[TieredParam, ...]:
        """The parameters whose gradients are reduced with ``tp``'s."""
        return self.reducer.buckets[self.reducer.bucket_of[tp]]

    def replicate(self, tps) -> None:
        """From the next backward on, every rank gets (and updates) the averaged
        gradients of ``tps``, whole gradient buckets (:meth:`replicable`);
        with a sharded GPU tier their owners update them and send the new
        weights instead ([Note: resident state sharded by unit])."""
        if self.sharded is not None:
            self.sharded.shard(tps)
            return
        self.replicated = frozenset(tps)
        self.reducer.replicate(frozenset(self.reducer.bucket_of[tp] for tp in tps))

    def owns(self, tp: TieredParam) -> bool:
        """This rank keeps ``tp``'s optimizer state."""
        return self.owner_of.get(tp) == self.ranks.local_rank

    def reserve(self, tps: list[TieredParam]):
        """Ask early for new slots of ``tps``' shared keys (fp32 master, and
        the compute-dtype copy when separate); hand the result to :meth:`publish`."""
        like = {}
        for tp in tps:
            like[tp.master_key] = torch.empty(tp.param.shape, dtype=torch.float32, device="meta")
            if tp.has_master:
                like[tp.key] = torch.empty(tp.param.shape, dtype=tp.param.dtype, device="meta")
        self._counters.requests += 1
        return self._store.reserve_async(like)

    def publish(self, pairs: list[tuple[str, torch.Tensor]], reserved=None) -> None:
        """Write new versions of shared keys: reserve (unless ``reserved``, from
        :meth:`reserve`), copy (after the compute stream on a device), publish
        once the copy has landed. Reserved keys not written are given back."""
        keys = tuple(k for k, _ in pairs)
        if reserved is None:
            self._counters.requests += 1
            reserved = self._store.reserve_async(dict(pairs))
        t0 = time.perf_counter()
        placed = {lease.key: lease.tensor for lease in reserved.result()}
        self._counters.wait_seconds += time.perf_counter() - t0
        unused = [k for k in placed if k not in dict(pairs)]
        if unused:
            self._store.abort(unused)
        on_device = [(placed[k], t) for k, t in pairs if t.device.type != "cpu"]
        for k, t in pairs:
            if t.device.type == "cpu":
                placed[k].copy_(t)
        copy = (self._copy.copy_out_many(on_device, keys) if on_device
                else InflightCopy((), (), keys, None))
        self._releases.add_publish(copy)

    def finish_update(self, settle: Callable[[], None]) -> None:
        """The end of ``opt.step()`` on every rank ([Note: when an update is
        visible]): resident parameters another rank owns are read again,
        but for replicas (this rank updated its own copy) and sharded units
        (their owners send them)."""
        self.sync(settle, "the end of opt.step()")
        sharded = frozenset() if self.sharded is None else self.sharded.tps
        if sharded:
            self.sharded.refresh()
        stale = [tp for tp in self._registry.resident() if tp.param.requires_grad
                 and not self.owns(tp) and tp not in self.replicated and tp not in sharded]
        if stale:
            values = self._store.get_many([tp.key for tp in stale])
            with torch.no_grad():
                for tp in stale:
                    tp.compute.copy_(values[tp.key])

    def sync(self, settle: Callable[[], None], what: str) -> None:
        """Once every rank of the node is here, each reads what the others
        published before: settle, have the daemon take this rank's publishes,
        a barrier, then lease the shared keys' current versions."""
        settle()
        self._leases.confirm_publishes()
        self.ranks.barrier(what)
        self._leases.renew_shared()
