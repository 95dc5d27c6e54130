"""The GPU tier sharded by unit across a node's ranks (``gpu_tier="sharded"``).

Only built under torch.distributed with ``AttachConfig.gpu_tier="sharded"``;
:class:`~tierd.client.rank_share.RankShare` owns it.

[Note: resident state sharded by unit]
With ``gpu_tier="replicated"`` every rank keeps a unit placed whole on its
GPU with its master and moments ([Note: resident units are replicas] in
``tierd.client.distributed``): P*(b+s) bytes on each of the node's G ranks.
With ``"sharded"`` a resident unit's master and moments stay on its owner's
GPU only (the owner's pinned buckets, as without ranks), and every rank
keeps the unit's weights:

- backward reduces the unit's gradient to its owner (``reduce``, not
  ``all_reduce``: (G-1)/G * P*b sent per rank, half the all-reduce's; with
  several nodes every node's owner needs it: ``all_reduce``);
- the owner updates on its GPU; no other rank runs the update;
- at the end of ``opt.step()`` each unit's owner broadcasts its new values
  (fp32: the master where one is separate, else the compute copy itself)
  over the caller's backend within the node (NCCL: NVLink), one unit after
  another with at most ``LAG`` in flight. The other ranks cast them to the
  compute dtype (bitwise the owner's cast) and, below fp32 compute, keep the
  fp32 value, so every rank reads the exact value (``state_dict``,
  ``detach``) without asking the owner (no collective on one rank's read).

A rank then holds P*b for every resident unit, plus P*s for the units it owns
(about 1/G of them, :func:`~tierd.client.distributed.assign_owners` balances
optimizer bytes), plus 4 B/param of kept fp32 values of the others' units
below fp32 compute. With bf16 and AdamW (b=2, s=12) on 2 ranks that is
2 + 6 + 2 = 10 B/param instead of 14; on 8, 2 + 1.5 + 3.5 = 7.

Interconnect per step and rank: (G-1)/G * P*b to reduce plus P*4 broadcast,
against 2(G-1)/G * P*b for the replicas' all-reduce; the broadcast runs after
the update, on the critical path, where the all-reduce hid under backward.
The owner's copy in the daemon is written back by the owner alone when the
host reads the store, as for replicas. Units are whole (owner granularity):
a unit's weights are not split, so forward and backward need no gather and
resident units keep running hook-free. Every rank runs one plan ([Note:
one plan for every rank] in ``tierd.client.placer``), made counting each
rank's bytes as it holds them ([Note: one budget on every rank] in
``tierd.client.placement``): the device bytes sharding frees are spent on
more resident units.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from tierd.client.distributed import LAG, Ranks, collective
from tierd.client.store import Store
from tierd.client.tiered_param import TieredParam


class ShardedResident:
    """The resident units this node shards, from this rank's side: the values
    it broadcasts as an owner and keeps from the others' owners.

    ``buckets`` are the gradient buckets (a unit's trainable parameters) in
    the order every rank uses, ``owner_of`` each parameter's owner (local
    rank), ``device_masters(tps)`` the fp32 masters this rank's resident
    optimizer state holds on the device.

    Example:
        >>> sharded.shard(resident_tps)   # when a plan is applied   # doctest: +SKIP
        >>> sharded.refresh()             # end of opt.step(), every rank  # doctest: +SKIP
    """

    def __init__(self, ranks: Ranks, buckets: list[tuple[TieredParam, ...]],
                 owner_of: dict[TieredParam, int], *, store: Store, device: torch.device,
                 device_masters: Callable[[list[TieredParam]], dict]) -> None:
        if ranks.node_compute is None:
            raise ValueError("a sharded GPU tier needs the node's group in the caller's "
                             "backend (Ranks.node_compute): join with gpu_tier='sharded'")
        self._ranks = ranks
        self._all_buckets = buckets
        self._owner_of = owner_of
        self._store = store
        self._device = device
        self._device_masters = device_masters
        self._buckets: list[tuple[TieredParam, ...]] = []   # sharded now, in order
        self._kept: dict[TieredParam, torch.Tensor] = {}    # others' fp32 values

    @property
    def tps(self) -> frozenset[TieredParam]:
        """The parameters sharded now."""
        return frozenset(tp for b in self._buckets for tp in b)

    def shard(self, tps) -> None:
        """From now on (a plan was applied) the buckets made only of ``tps``
        are sharded; none with an empty ``tps`` (everything streams again)."""
        chosen = set(tps)
        self._buckets = [b for b in self._all_buckets if chosen.issuperset(b)]
        self._kept.clear()

    def _owns(self, bucket: tuple[TieredParam, ...]) -> bool:
        return self._owner_of[bucket[0]] == self._ranks.local_rank

    def refresh(self) -> None:
        """Every rank, at the end of ``opt.step()``: each sharded unit's owner
        broadcasts its new values, the others take them ([Note: resident
        state sharded by unit])."""
        inflight: deque = deque()
        for bucket in self._buckets:
            inflight.append(self._launch(bucket))
            if len(inflight) > LAG:
                self._take(*inflight.popleft())
        while inflight:
            self._take(*inflight.popleft())

    def _launch(self, bucket: tuple[TieredParam, ...]):
        ranks = self._ranks
        src = ranks.node_ranks[self._owner_of[bucket[0]]]
        if self._owns(bucket):
            flat = torch.cat([v.reshape(-1) for v in self._values(bucket)])
        else:
            flat = torch.empty(sum(tp.param.numel() for tp in bucket), dtype=torch.float32,
                               device=self._device)
        work = collective(lambda: dist.broadcast(flat, src=src, group=ranks.node_compute,
                                                 async_op=True),
                          "broadcasting a sharded unit's new weights")
        return bucket, flat, work

    def _take(self, bucket: tuple[TieredParam, ...], flat: torch.Tensor, work) -> None:
        collective(work.wait, "broadcasting a sharded unit's new weights")
        if self._owns(bucket):
            return
        with torch.no_grad():
            for tp, value in zip(bucket, flat.split([tp.param.numel() for tp in bucket])):
                value = value.view(tp.param.shape)
                tp.compute.copy_(value)
                if tp.compute.dtype != torch.float32:   # the exact value, for reads
                    self._kept[tp] = value

    def _values(self, bucket: tuple[TieredParam, ...]) -> list[torch.Tensor]:
        """The owner's current fp32 values of ``bucket``: the device masters of
        its resident state; a bucket no update made resident yet (no gradient
        since the plan) has them in the store."""
        masters = self._device_masters(list(bucket))
        missing = [tp for tp in bucket if tp not in masters]
        if missing:
            stored = self._store.get_many([tp.value_key for tp in missing])
            masters.update({tp: stored[tp.value_key].to(self._device) for tp in missing})
        return [masters[tp].to(torch.float32) for tp in bucket]

    def masters(self, tps) -> dict[TieredParam, torch.Tensor]:
        """The current values of ``tps`` another rank owns, on the device:
        the kept fp32 value, or the compute copy where it is fp32 (the value)."""
        out = {}
        sharded = self.tps
        for tp in tps:
            if tp not in sharded or self._owner_of[tp] == self._ranks.local_rank:
                continue
            if tp in self._kept:
                out[tp] = self._kept[tp]
            elif tp.compute.dtype == torch.float32:
                out[tp] = tp.compute
        return out

    def kept_by_rank(self, tps) -> list[int]:
        """Device bytes of ``tps``' fp32 values each local rank would keep
        of them sharded: every rank but a parameter's owner, below fp32
        compute (placement counts them: [Note: one budget on every rank] in
        ``tierd.client.placement``)."""
        out = [0] * len(self._ranks.node_ranks)
        for tp in tps:
            owner = self._owner_of.get(tp)
            if owner is None or tp.param.dtype == torch.float32:
                continue
            for r in range(len(out)):
                out[r] += 4 * tp.param.numel() if r != owner else 0
        return out

    def kept_bytes(self) -> int:
        """Device bytes of the fp32 values kept of others' units."""
        return sum(v.numel() * v.element_size() for v in self._kept.values())
