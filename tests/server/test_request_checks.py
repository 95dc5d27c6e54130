"""Requests that can never succeed get an error that says why: a tensor
larger than the whole pool, a segment id that is not positive. A real daemon."""

from __future__ import annotations

import pytest
import torch

import tierd


def test_a_tensor_larger_than_the_pool_can_never_be_stored(daemon, client):
    pool = client.stats()["pool_bytes"]
    big = torch.empty(pool // 4 + 1024, dtype=torch.float32, device="meta")
    with pytest.raises(tierd.CapacityError,
                       match=rf"'?big'?: a tensor of {big.numel() * 4} B is larger than the pool "
                             rf"\({pool} B\); it can never be stored") as err:
        client.put_zeros({"big": big})
    assert "-" not in str(err.value).split("B")[0]   # no negative "at most -N B fit"
    client.put("small", torch.ones(8))   # nothing was lost or held
    assert torch.equal(client.get("small"), torch.ones(8))
    assert client.keys() == ["small"]


def test_a_segment_id_of_zero_is_refused_saying_ids_are_positive(daemon):
    c = tierd.connect(daemon.socket)
    try:
        with pytest.raises(tierd.ProtocolError, match=r"segment ids are positive .*got \[0\]"):
            c.control.map([0])
    finally:
        c.close()
    with tierd.connect(daemon.socket) as other:   # the daemon serves on
        other.put("x", torch.ones(2))
