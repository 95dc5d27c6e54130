import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from tierd import protocol as P
from tierd.errors import ProtocolError

REQUESTS = [
    P.Reserve((P.TensorSpec("a", "float32", (2, 3), 24), P.TensorSpec("b", "bool", (), 1))),
    P.Reserve((P.TensorSpec("z", "bfloat16", (4,), 8),), zero=True),
    P.Publish(("a", "b")), P.Abort(("a",)), P.Lease(("a",), write=True), P.Release(("a",), True),
    P.Prefetch(("x", "y")), P.Evict(("a",)), P.Demote(("a", "b")), P.Delete(("a",)),
    P.Keys("opt/"), P.Stats(), P.Expect((1 << 30, 4096, 0)),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.op)
def test_every_request_round_trips(req):
    assert P.decode_request(P.encode_request(7, req)) == (7, req)


def test_replies_round_trip():
    placed = P.Placed((P.Placement("k", 3, 4096, 24, "bfloat16", (3, 4), 2),))
    for reply in (placed, P.Done(), P.KeyList(("a", "b")), P.StatsReply({"tensors": 1})):
        assert P.decode_reply(P.encode_reply(9, reply)) == (9, reply)
    assert P.decode_reply(P.encode_error(5, "key", "no")) == (5, ("key", "no"))


@pytest.mark.parametrize("frame, why", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), "map"),
    (msgpack.packb({"v": 99, "id": 1, "op": "stats"}), "version"),
    (msgpack.packb({"v": P.VERSION, "id": -1, "op": "stats"}), "id"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "pickle"}), "unknown op"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "lease", "body": {"keys": [1]}}), "key"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "lease", "body": {"keys": "abc"}}), "list"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "reserve",
                    "body": {"specs": [["k", "float32", [-1], 4]]}}), "shape dim"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "reserve",
                    "body": {"specs": [["k", "object", [1], 4]]}}), "dtype"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "reserve",
                    "body": {"specs": [], "zero": 1}}), "zero"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "expect", "body": {"sizes": [-1]}}),
     "size"),
    (msgpack.packb({"v": P.VERSION, "id": 1, "op": "expect", "body": {"sizes": 5}}), "list"),
    (b"\x00" * (P.MAX_FRAME_BYTES + 1), "exceeds"),
])
def test_malformed_frames_are_protocol_errors(frame, why):
    with pytest.raises(ProtocolError, match=why):
        P.decode_request(frame)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(max_size=200),
                 st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8)
                              | st.binary(max_size=8),
                              lambda c: st.lists(c, max_size=4)
                              | st.dictionaries(st.text(max_size=6), c, max_size=4),
                              max_leaves=20).map(msgpack.packb)))
def test_random_frames_only_ever_raise_protocol_error(frame):
    try:
        P.decode_request(frame)
    except ProtocolError:
        pass
