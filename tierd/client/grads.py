"""Gradients leave the compute device as autograd produces them.

Each parameter's gradient is summed into its ``grad`` key in the pool, in
the key's dtype (fp32, or the bf16 master's: [Note: the stored gradient's
dtype] in tierd.client.tiered_param), in the order autograd delivers it: the first delivery after a
``zero_grad`` overwrites, later ones add (``acc += g``), which is exactly what
``AccumulateGrad`` does to ``param.grad``, so accumulated values are bitwise
those torch would hold. Deliveries are buffered and written in buckets of
``bucket_bytes`` with one lease request each.

[Note: global clipping]
Clipping by the global norm needs every gradient before any update. After
each write the L2 norm of the parameter's *accumulated* gradient is kept as a
0-dim tensor (``TieredParam.grad_norm``); at ``step()`` the optimizer combines
the latest norms exactly like ``torch.nn.utils.clip_grad_norm_`` and applies
the factor while it updates each block, so no extra pass over the gradients
is needed.

The measuring step may keep its gradients on the device instead: see
[Note: the measuring step keeps its gradients on the device] in
tierd.client.held_grads.
"""

from __future__ import annotations

from typing import Callable

import torch

from tierd.client.copy_stream import CopyStream
from tierd.client.releases import PendingReleases
from tierd.client.tiered_param import TieredParam


class GradBucket:
    """Buffers (parameter, gradient) deliveries and writes them to the pool.

    Example:
        >>> bucket = GradBucket(client, copy_stream, releases, bucket_bytes=1 << 20)  # doctest: +SKIP
        >>> bucket.add(tp, grad); bucket.flush()                                        # doctest: +SKIP
    """

    def __init__(self, client, leases, stream: CopyStream, releases: PendingReleases,
                 bucket_bytes: int) -> None:
        self._client = client
        self._leases = leases   # the session's LeaseTable
        self._stream = stream
        self._releases = releases
        self._bucket_bytes = bucket_bytes
        self._entries: list[tuple[TieredParam, torch.Tensor]] = []
        self._bytes = 0
        #: the parameters whose gradients are summed on the device while resident
        #: (tierd.client.held_grads: [Note: the measuring step keeps its gradients on the device])
        self.hold: frozenset[TieredParam] = frozenset()
        self.held_bytes = 0
        #: told each change of ``held_bytes``: before an allocation, after a free
        self.on_held: Callable[[int], None] = lambda delta: None

    def add(self, tp: TieredParam, grad: torch.Tensor) -> None:
        if tp.grad_on_device or (tp in self.hold and tp.resident and not tp.grad_in_pool):
            self._hold(tp, grad)
            return
        self._entries.append((tp, grad))
        self._bytes += tp.grad_nbytes
        if self._bytes >= self._bucket_bytes:
            self.flush()

    def flush(self) -> None:
        """Write every buffered gradient into the pool (one lease request)."""
        if not self._entries:
            return
        entries, self._entries, self._bytes = self._entries, [], 0
        # the earlier buckets' copies out that landed give back their leases
        # and sources: with every unit kept on the device nothing else drains
        # in backward, and a first step held every fp32 gradient to its end
        self._releases.drain()
        keys = list(dict.fromkeys(tp.grad_key for tp, _ in entries))
        self._create([tp for tp, _ in entries])
        self._leases.acquire(keys)
        views = self._leases.views(keys)
        on_device = self._stream.on_device
        # an earlier backward's copy out into a key added to here has landed
        # before the pool is read (CUDA; at once in practice: a forward ran since)
        for event in self._stream.pending_writes([tp.grad_key for tp, _ in entries
                                                  if tp.grad_in_pool]):
            event.synchronize()
        accumulated: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for tp, grad in entries:
                g = grad.detach().to(views[tp.grad_key].dtype)
                if tp.grad_key in accumulated:      # delivered twice in one bucket
                    accumulated[tp.grad_key].add_(g)
                elif tp.grad_in_pool:
                    view = views[tp.grad_key]
                    acc = view.to(g.device) if on_device else view
                    acc.add_(g)
                    accumulated[tp.grad_key] = acc
                else:
                    # torch steals the first gradient as is; copy keeps the bits
                    accumulated[tp.grad_key] = g if on_device else views[tp.grad_key].copy_(g)
            for tp, _ in entries:
                tp.to_gradient_in_pool(grad_norm(accumulated[tp.grad_key]))
        self._write_back(keys, views, accumulated, on_device)

    def _hold(self, tp: TieredParam, grad: torch.Tensor) -> None:
        """Sum ``grad`` into ``tp``'s gradient on the device, as :meth:`flush`
        sums into the pool (the first delivery as is, in the stored dtype)."""
        with torch.no_grad():
            if tp.grad_on_device:
                acc = tp.device_grad
                acc.add_(grad.detach().to(acc.dtype))
            else:
                self.on_held(tp.grad_nbytes)   # before the bytes are allocated
                self.held_bytes += tp.grad_nbytes
                acc = grad.detach().to(tp.grad_dtype)
            tp.to_gradient_on_device(acc, grad_norm(acc))

    def dropped(self, nbytes: int) -> None:
        """A gradient held on the device was freed (``TieredParam``'s transitions)."""
        self.held_bytes -= nbytes
        self.on_held(-nbytes)

    def spill(self, tps) -> None:
        """Write the gradients of ``tps`` held on the device into the pool
        (IN_POOL from here), a bucket's bytes at a time; the others are left
        alone. Blocking: the device's bytes are freed once they have landed.
        A failure leaves the gradients not yet written where they were."""
        tps = [tp for tp in dict.fromkeys(tps) if tp.grad_on_device]
        self.flush()
        while tps:
            batch, size = [], 0
            while tps and (not batch or size + tps[0].grad_nbytes <= self._bucket_bytes):
                size += tps[0].grad_nbytes
                batch.append(tps.pop(0))
            self._spill(batch)

    def _spill(self, tps: list[TieredParam]) -> None:
        self._create(tps)
        keys = [tp.grad_key for tp in tps]
        self._leases.acquire(keys)
        try:
            views = self._leases.views(keys)
            pairs = [(views[tp.grad_key], tp.device_grad) for tp in tps]
            if self._stream.on_device:
                self._stream.copy_out_many(pairs, tuple(keys)).synchronize()
            else:
                for dst, src in pairs:
                    dst.copy_(src)
        except BaseException:
            self._leases.release(keys)
            raise
        self._leases.release(keys, written=True)
        for tp in tps:
            tp.to_gradient_in_pool(tp.grad_norm)

    def _create(self, tps: list[TieredParam]) -> None:
        """Gradient keys are made on first use: a model trained with a fused
        optimizer never needs them."""
        missing = {tp.grad_key: torch.empty(tp.param.shape, dtype=tp.grad_dtype, device="meta")
                   for tp in tps if not tp.grad_created}
        if missing:   # zeroed slots: no zeros made here and copied in
            self._client.put_zeros(missing)
            for tp in tps:
                tp.grad_created = True

    def _write_back(self, keys: list[str], views: dict[str, torch.Tensor],
                    accumulated: dict[str, torch.Tensor], on_device: bool) -> None:
        if not on_device:   # summed in place in the pool already
            self._leases.release(keys, written=True)
            return
        copy = self._stream.copy_out_many([(views[k], accumulated[k]) for k in keys],
                                          tuple(keys))
        self._releases.add(copy, written=True)


def grad_norm(grad: torch.Tensor) -> torch.Tensor:
    """The 0-dim L2 norm kept for global clipping, in fp32 (a bf16
    gradient's norm too: [Note: global clipping])."""
    return torch.linalg.vector_norm(grad, 2.0, dtype=torch.float32)


def unused_grads(session, tps: list[TieredParam]) -> list[TieredParam]:
    """Of ``tps``, those whose gradient key no later backward writes: a
    fused optimizer consumes their gradients inside every backward (a
    window of one; not a CPU-updated bucket, which writes its gradients to
    their keys every step)."""
    if session.share is not None:
        return []   # the node's ranks write gradient keys for each other
    fused = [f for f in session.optimizers
             if f.fusing and f.learned and (f.window or f.backwards) == 1]
    return [tp for tp in tps if (tp.grad_created or tp.grad_on_device)
            and any(tp in f.bucket_of and not f.bucket_of[tp].cpu for f in fused)]


def free_grads(session, tps: list[TieredParam]) -> None:
    """Delete the gradient keys of ``tps`` (no lease on them, no write in
    flight) and free those held on the device; their ``p.grad`` shows a
    consumed view until ``zero_grad``."""
    created = [tp for tp in tps if tp.grad_created]
    if created:
        session.drop_keys([tp.grad_key for tp in created],
                          {tp.grad_key: tp.grad_nbytes for tp in created})
    for tp in tps:
        tp.grad_created = False
        tp.to_no_gradient()
    session.grad_views.consume(tps)
