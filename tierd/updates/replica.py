"""Replicas: a rank's copy of the resident units another rank owns
([Note: resident units are replicas] in ``tierd.client.distributed``).

Under torch.distributed the owner of a unit keeps its optimizer state and
the node's copy in the daemon. When placement keeps the unit on the device,
every other rank keeps the same master and moments on its own device and
runs the same update on the same averaged gradient, so all copies stay equal
with no copy between them. Here: the state each replica starts from (sent by
the owner once, when the plan is applied) and :class:`ReplicaUpdates`, the
fused updates of those buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tierd.client.distributed import collective
from tierd.client.tiered_param import TieredParam
from tierd.updates.buckets import Bucket, BucketState
from tierd.updates.fused import FusedUpdates


class ReplicaUpdates(FusedUpdates):
    """Fused updates of resident buckets another rank owns, on this rank's copy.

    Its buckets are RESIDENT from the start and never written to the pool
    (the owner writes the node's copy). Gradients of a window's earlier
    backwards, which the owner sums in the pool, are summed here on the
    device in the same order; the update then runs as the owner's does:
    inside the backward that ends the window, or in ``step()`` after a
    shorter one.

    Example:
        >>> replica = ReplicaUpdates(sibling, units, values)   # doctest: +SKIP
    """

    def __init__(self, sibling: FusedUpdates, units: list[list[TieredParam]],
                 values: dict[str, torch.Tensor]) -> None:
        self._units = units
        mine = {tp for unit in units for tp in unit}
        groups = [(g, [p.tiered for p in g["params"] if p.tiered in mine])
                  for g in sibling.opt.param_groups]
        super().__init__(sibling.opt, sibling.session, groups, sibling.prefetch_bytes,
                         fusing=sibling.fusing)
        # the same window as the owner's updates of this optimizer
        self.window, self.backwards = sibling.window, sibling.backwards
        self.learned = sibling.learned
        self.expected = {tp: 1 for tp in mine}   # the reducer delivers one sum per backward
        self._pending: dict[TieredParam, torch.Tensor] = {}
        for b in self.buckets:
            b.pinned = True
            b.to_fetched({k: values[k] for tp in b.tps for k in self.opt.state_keys(tp)}, None)
            b.to_resident()

    def _build(self, groups) -> None:
        """One bucket per unit and param group, as the owner's."""
        group_of = {tp: gi for gi, (_, tps) in enumerate(groups) for tp in tps}
        for unit in self._units:
            for gi in dict.fromkeys(group_of[tp] for tp in unit):
                tps = [tp for tp in unit if group_of[tp] == gi]
                b = Bucket(len(self.buckets), groups[gi][0], tps,
                           sum(self.opt.state_nbytes(tp) for tp in tps))
                self.buckets.append(b)
                self.bucket_of.update({tp: b for tp in tps})

    def begin_backward(self) -> None:
        super().begin_backward()
        if self.active:   # the window's earlier sums, added to first as the owner's pool sum is
            self._grads.update(self._pending)
            self._pending.clear()

    def on_grad(self, tp: TieredParam, grad: torch.Tensor) -> bool:
        if tp not in self.bucket_of:
            return False
        if self.active:
            return super().on_grad(tp, grad)
        g = grad.detach().to(torch.float32)
        prev = self._pending.get(tp)
        self._pending[tp] = g.clone() if prev is None else prev.add_(g)
        return True   # never into the pool: the owner's gradient is there

    def after_step(self) -> None:
        """A window not updated in backward (the first, or a shorter one) is
        updated here, as ``step()`` updates the owner's."""
        if self._pending and not self.updated:
            self._grads.update(self._pending)
            self._pending.clear()
            self._updated.clear()
            for b in self.buckets:
                if any(tp in self._grads for tp in b.tps):
                    self._update(b)
        super().after_step()

    def consumed(self) -> set[TieredParam]:
        return set()   # p.grad shows on the owner only, as for streamed parameters

    def settle(self, *, write_resident: bool = True) -> None:
        """Nothing is fetched or copied out; the pool's copy is the owner's."""

    def drop_resident(self, b: Bucket | None = None) -> None:
        """Free the device state (never written back: see :meth:`settle`)."""
        for bucket in self.buckets if b is None else [b]:
            if bucket.state is BucketState.RESIDENT:
                bucket.discard()


def _covering(session, tp: TieredParam) -> FusedUpdates | None:
    """The (owner's kind of) fused updates whose optimizer has ``tp``."""
    for f in session.optimizers:
        if not isinstance(f, ReplicaUpdates) and any(
                p is tp.outside for g in f.opt.param_groups for p in g["params"]):
            return f
    return None


def can_replicate(session, tps) -> bool:
    """Every rank can keep ``tps`` (a unit's parameters) as replicas: each
    trainable one is updated inside backward by an optimizer this rank knows,
    in a bucket of its gradient bucket's parameters only."""
    share = session.share
    for tp in tps:
        if not tp.param.requires_grad:
            continue
        f = _covering(session, tp)
        if f is None or not f.fusing:
            return False
        b = f.bucket_of.get(tp)
        if b is not None and not set(b.tps).issubset(share.bucket_tps(tp)):
            return False
    return True


def replicate(session, tps: list[TieredParam]) -> list[ReplicaUpdates]:
    """Start replicas of ``tps`` (whole gradient buckets; every rank calls
    this with the same list): each bucket's owner sends its master, moments
    and step counts, the other ranks keep them on their device. Returns this
    rank's new :class:`ReplicaUpdates`."""
    share = session.share
    values: dict[str, torch.Tensor] = {}
    units: dict[FusedUpdates, list[list[TieredParam]]] = {}
    for bucket in dict.fromkeys(share.bucket_tps(tp) for tp in tps):
        covering = [_covering(session, tp) for tp in bucket]
        # (param, key, meta tensor of its stored form: compact state keeps its own)
        parts = [(tp, k, like) for tp, f in zip(bucket, covering)
                 for k, like in zip(f.opt.state_keys(tp), _likes(f.opt, tp))]
        flat = _from_owner(session, bucket, covering, parts)
        if share.owns(bucket[0]):
            continue
        pieces = flat.split([_nbytes(like) for _, _, like in parts] + [8] * len(bucket))
        for (tp, k, like), piece in zip(parts, pieces):   # cloned: aligned for the view
            values[k] = piece.clone().view(like.dtype).reshape(like.shape).to(session.device)
        for tp, f, step in zip(bucket, covering, pieces[len(parts):]):
            count = step.clone().view(torch.float64).item()
            if count > 0:   # a parameter that never stepped has no count, as in torch
                f.opt.state[tp.outside]["step"] = count
        for f in dict.fromkeys(covering):
            units.setdefault(f, []).append([tp for tp, c in zip(bucket, covering) if c is f])
    replicas = []
    for f, unit_list in units.items():
        replica = ReplicaUpdates(f, unit_list, values)
        session.optimizers.append(replica)
        f.opt._fused.append(replica)
        replicas.append(replica)
    return replicas


def _likes(opt, tp: TieredParam) -> list[torch.Tensor]:
    """Meta tensors of the stored forms of ``opt.state_keys(tp)``, in order."""
    return [opt.master_like(tp)] + [opt.state_like(tp, n) for n in opt.state_names]


def _nbytes(like: torch.Tensor) -> int:
    return like.numel() * like.element_size()


def _from_owner(session, bucket, covering, parts) -> torch.Tensor:
    """One gradient bucket's state (``parts``: (param, key, form) in order,
    then a float64 step count per parameter) as the bytes of one CPU tensor
    (each key in its stored form: fp32, or compact state's), broadcast by its
    owner over the node's gloo group. One bucket at a time, so the host holds
    one unit's state at most (once per plan, never per step)."""
    share = session.share
    ranks = share.ranks
    if share.owns(bucket[0]):   # its state is in the pool: the plan settled first
        stored = session.read([k for _, k, _ in parts])
        steps = [torch.tensor([float(f.opt.state[tp.outside].get("step", 0.0))],
                              dtype=torch.float64) for tp, f in zip(bucket, covering)]
        flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8)
                          for t in [stored[k] for _, k, _ in parts] + steps])
    else:
        flat = torch.empty(sum(_nbytes(like) for _, _, like in parts) + 8 * len(bucket),
                           dtype=torch.uint8)
    src = ranks.node_ranks[share.owner_of[bucket[0]]]
    collective(lambda: dist.broadcast(flat, src=src, group=ranks.node),
               "sending resident optimizer state to the replicas")
    return flat


def drop_replicas(session, replicas: list[ReplicaUpdates]) -> None:
    """Stop the replicas (their state is dropped; the owners wrote the pool)."""
    for r in replicas:
        r.drop_resident()
        session.optimizers.remove(r)
        r.opt._fused.remove(r)
        for tp in r.bucket_of:
            r.opt.state.pop(tp.outside, None)
