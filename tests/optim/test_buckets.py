"""An optimizer bucket changes state only through its transitions; a wrong
one raises StateError naming the bucket, its state and what was asked."""

from __future__ import annotations

import pytest
import torch

from tierd.client.keys import ModelKeys
from tierd.client.releases import PendingReleases, ReleaseKind
from tierd.client.copy_stream import InflightCopy
from tierd.client.tiered_param import DeviceParameter, TieredParam
from tierd.errors import StateError
from tierd.updates.buckets import Bucket, BucketState, update_window


def _param(numel: int = 2, dtype=torch.float32) -> TieredParam:
    return TieredParam(name="h.0.weight", keys=ModelKeys("m"),
                       param=DeviceParameter(torch.empty(numel, dtype=dtype)),
                       orig_dtype=torch.float32, orig_device=torch.device("cpu"),
                       resident=False, session=None)


def _bucket() -> Bucket:
    return Bucket(3, {}, [_param()], 24)


def test_a_bucket_goes_host_fetched_done_host():
    b = _bucket()
    b.to_fetched({"k": torch.zeros(1)}, None)
    assert b.state is BucketState.FETCHED and "k" in b.work
    b.to_updated(all_params=True)
    assert b.state is BucketState.DONE and b.work == {}
    b.to_host()
    assert b.state is BucketState.HOST


def test_wrong_transitions_name_the_bucket_and_state():
    b = _bucket()
    with pytest.raises(StateError, match=r"bucket 3 \('h.0.weight'...\) cannot finish its "
                                         r"update: it is HOST, finish its update needs FETCHED"):
        b.to_updated(all_params=True)
    b.to_fetched({}, None)
    with pytest.raises(StateError, match="it is FETCHED, be fetched needs HOST"):
        b.to_fetched({}, None)


def test_a_bucket_fetched_ahead_of_its_update_is_updated_or_given_back():
    b = _bucket()
    b.to_pending({"lr": 0.1})
    b.to_fetched({"k": torch.zeros(1)}, None, ahead=True)
    assert b.state is BucketState.AHEAD and "k" in b.work
    b.to_pending_again()   # given back: the update still waits, as it was held
    assert b.state is BucketState.PENDING and b.work == {} and b.hyper == {"lr": 0.1}
    b.to_fetched({"k": torch.zeros(1)}, None, ahead=True)
    b.to_update_ahead()
    assert b.state is BucketState.FETCHED and "k" in b.work
    with pytest.raises(StateError, match="it is FETCHED, be fetched ahead of its update "
                                         "needs PENDING"):
        b.to_fetched({}, None, ahead=True)
    with pytest.raises(StateError, match="it is FETCHED, give back its fetch needs AHEAD"):
        b.to_pending_again()


def test_resident_state_must_be_written_back_before_it_goes():
    b = _bucket()
    b.to_fetched({"k": torch.zeros(1)}, None)
    b.to_resident()
    assert b.state is BucketState.RESIDENT and b.dirty
    b.to_resident()   # updated again, still on the device
    with pytest.raises(StateError, match="write them back first"):
        b.to_host()
    b.dirty = False
    b.to_host()
    assert b.state is BucketState.HOST


def test_pending_releases_go_by_kind_in_one_request_each():
    calls = []

    class Client:
        def release_async(self, keys, written=False):
            calls.append(("release", sorted(keys), written))

        def publish_async(self, keys):
            calls.append(("publish", sorted(keys)))

    r = PendingReleases(Client())
    for keys, kind in ((("a", "b"), ReleaseKind.READ), (("c",), ReleaseKind.WRITTEN),
                       (("d",), ReleaseKind.PUBLISH), (("e",), ReleaseKind.READ)):
        copy = InflightCopy((), (), keys, None)
        if kind is ReleaseKind.PUBLISH:
            r.add_publish(copy)
        else:
            r.add(copy, written=kind is ReleaseKind.WRITTEN)
    r.drain()
    assert calls == [("publish", ["d"]), ("release", ["a", "b", "e"], False),
                     ("release", ["c"], True)]
    assert len(r) == 0


def test_the_update_window_counts_the_largest_streamed_bucket_and_gradients():
    def bucket(numel: int, dtype=torch.bfloat16, **kw) -> Bucket:
        return Bucket(0, {}, [_param(numel, dtype)], numel * 12, **kw)

    streamed, big_pinned = bucket(100), bucket(1000, pinned=True)
    # a pinned bucket's state is resident (not fetched), but its gradients are
    # held while it updates: 1000 x (fp32 + bf16 as delivered + the bf16 new
    # value), and backward delivers the next bucket's meanwhile (1000 x bf16
    # at most); ahead of the one streamed bucket there is nothing to fetch
    grads = 1000 * (4 + 2 + 2) + 1000 * 2
    assert update_window([streamed, big_pinned], 64) == grads + 1200
    assert update_window([streamed, bucket(100), big_pinned], 64) == grads + 2 * 64 + 1200
    assert update_window([big_pinned], 64) == grads          # nothing streams
    assert update_window([bucket(10, cpu=True)], 64) == 100   # CPU updates fetch nothing
    assert update_window([bucket(10, torch.float32)], 0) == 10 * (4 + 8 + 4) + 120
    # all the streamed state is less than the prefetch: no more than it is held
    assert update_window([streamed, bucket(100)], 1 << 30) == 1000 + 2 * 1200
    assert update_window([], 64) == 0
