"""A protocol fuzzer for the commit ops (and frames around them): whatever a
client sends, the daemon answers with a reply or a ProtocolError, stays up, and
its committed data stays correct."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from tierd import protocol as P
from tierd.client.control import ControlChannel
from tests.faults import harness

JOB = "fuzzed"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=300))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)
tags = st.one_of(values, st.text(min_size=0, max_size=400), st.just("x" * 100_000))
ops = st.sampled_from(["commit", "commits", "keys", "stats", "nope", "", None])


@st.composite
def frames(draw) -> bytes:
    kind = draw(st.sampled_from(["commit", "any_op", "garbage", "truncated", "version"]))
    rid = draw(st.one_of(st.integers(0, 1 << 62), values))
    if kind == "commit":
        return msgpack.packb({"v": P.VERSION, "id": rid, "op": "commit",
                              "body": draw(st.one_of(st.fixed_dictionaries({"tag": tags}),
                                                     values))})
    if kind == "any_op":
        return msgpack.packb({"v": P.VERSION, "id": rid, "op": draw(ops), "body": draw(values)})
    if kind == "garbage":
        return draw(st.binary(min_size=0, max_size=2000))
    good = P.encode_request(1, P.Commit("tag"))
    if kind == "truncated":
        return good[:draw(st.integers(0, len(good) - 1))]
    return msgpack.packb({"v": draw(st.one_of(values, st.integers(-(1 << 63), (1 << 64) - 1))), "id": 1,
                          "op": "commits", "body": {}})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = harness.start(tmp_path_factory.mktemp("fuzz"))
    with d.connect(job=JOB) as c:
        c.put("keep", torch.arange(1000, dtype=torch.int32))
        c.commit("base")
    ctl = ControlChannel(d.socket, JOB)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ctl.token)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"ipc://{d.socket}")
    yield d, sock
    sock.close()
    ctl.close()
    d.stop()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=frames())
def test_fuzzed_frames_get_an_answer_and_the_daemon_stays_correct(target, frame):
    d, sock = target
    sock.send(frame)
    reply = sock.recv()              # every frame gets exactly one answer
    rid, body = P.decode_reply(reply)
    if isinstance(body, tuple):
        assert body[0] in ("protocol", "state"), body
    assert d.alive()


def test_after_fuzzing_the_commit_and_its_data_are_intact(target):
    d, _ = target
    with d.connect(job=JOB) as c:
        assert c.commits()[0] == "base"
        assert torch.equal(c.get("keep"), torch.arange(1000, dtype=torch.int32))
        c.commit("after-fuzz")
