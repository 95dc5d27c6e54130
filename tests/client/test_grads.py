"""GradBucket on its own: gradients summed into their pool keys, copies out
released as they land."""

from __future__ import annotations

import torch

from tierd.client.copy_stream import InflightCopy
from tierd.client.grads import GradBucket
from tierd.client.releases import PendingReleases


class _Event:
    """A copy's completion, set by the test (the copy stream's pace)."""

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


class _Stream:
    """A device copy stream whose copies out land when the test says."""

    on_device = True

    def __init__(self) -> None:
        self.events: list[_Event] = []

    def pending_writes(self, keys) -> tuple:
        return ()

    def copy_out_many(self, pairs, keys) -> InflightCopy:
        for dst, src in pairs:
            dst.copy_(src)
        self.events.append(_Event())
        return InflightCopy(tuple(d for d, _ in pairs), tuple(s for _, s in pairs), keys,
                            self.events[-1])


class _Store:
    """Pool keys as CPU tensors; leases and releases counted."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.leased: set[str] = set()

    def put_zeros(self, specs) -> None:
        self.values.update({k: torch.zeros(v.shape, dtype=v.dtype) for k, v in specs.items()})

    def acquire(self, keys) -> None:
        self.leased.update(keys)

    def views(self, keys) -> dict:
        return {k: self.values[k] for k in keys}

    def release_async(self, keys, written=False) -> None:
        assert written
        self.leased.difference_update(keys)


class _Param:
    def __init__(self, i: int, grad_dtype: torch.dtype = torch.float32) -> None:
        self.grad_key, self.grad_created, self.grad_in_pool = f"g{i}", False, False
        self.grad_on_device, self.resident = False, False
        self.param = torch.empty(4)
        self.grad_dtype, self.grad_nbytes = grad_dtype, 4 * grad_dtype.itemsize
        self.norm = None

    def to_gradient_in_pool(self, norm) -> None:
        self.grad_in_pool, self.norm = True, norm


def test_copies_out_that_landed_are_released_at_the_next_bucket():
    store, stream = _Store(), _Stream()
    releases = PendingReleases(store)
    bucket = GradBucket(store, store, stream, releases, bucket_bytes=16)   # one gradient a bucket
    params = [_Param(i) for i in range(6)]
    for i, tp in enumerate(params):
        bucket.add(tp, torch.full((4,), float(i), dtype=torch.bfloat16))
        stream.events[-1].landed = True   # the copy stream keeps up
        # at most the bucket just queued holds its lease and its fp32 source
        assert len(releases) == 1 and store.leased == {tp.grad_key}
    releases.drain(block=True)
    assert not store.leased
    assert all(torch.equal(store.values[f"g{i}"], torch.full((4,), float(i))) for i in range(6))


def test_a_copy_still_in_flight_keeps_its_lease_and_those_after_it():
    store, stream = _Store(), _Stream()
    releases = PendingReleases(store)
    bucket = GradBucket(store, store, stream, releases, bucket_bytes=16)
    params = [_Param(i) for i in range(3)]
    for tp in params:
        bucket.add(tp, torch.ones(4))
    assert len(releases) == 3 and store.leased == {"g0", "g1", "g2"}   # none landed
    stream.events[0].landed = True
    bucket.add(_Param(3), torch.ones(4))
    assert store.leased == {"g1", "g2", "g3"}


def test_a_bf16_key_sums_deliveries_as_torch_sums_a_bf16_grad():
    """Under a bf16 master the gradient key is bf16 ([Note: the stored
    gradient's dtype]): each delivery is added into it and rounded, as
    torch's AccumulateGrad adds into a bf16 parameter's ``.grad``; the norm
    kept for clipping is fp32."""
    store, stream = _Store(), _Stream()
    releases = PendingReleases(store)
    bucket = GradBucket(store, store, stream, releases, bucket_bytes=8)   # one delivery a bucket
    tp = _Param(0, torch.bfloat16)
    deliveries = [torch.tensor([1.0, 3.0, -2.0, 0.5]).bfloat16(),
                  torch.tensor([2.0 ** -9, 1.0e-3, 7.0, 1.0 / 3]).bfloat16()]
    for g in deliveries:
        bucket.add(tp, g)
        stream.events[-1].landed = True
    releases.drain(block=True)
    torch_grad = deliveries[0].clone()
    torch_grad += deliveries[1]
    stored = store.values["g0"]
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, torch_grad)
    assert not torch.equal(stored.float(), deliveries[0].float() + deliveries[1].float())
    assert tp.norm.dtype == torch.float32
    assert tp.norm == torch.linalg.vector_norm(torch_grad.float())
