"""Fuzzers of the wire protocol (request frames) and of the control channel:
whatever a client sends, the daemon answers it with a reply or a clean error
(never an internal error), stays up, and its committed data stays correct.

Each test runs a bounded number of examples (a few seconds in CI); set
``TIERD_FUZZ_EXAMPLES`` to run more.
"""

from __future__ import annotations

import os
import socket

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from tierd import protocol as P
from tierd.client.control import ControlChannel
from tests.faults import harness

JOB = "precious"     # committed before fuzzing, never touched by it
FUZZ_JOB = "fuzzed"  # the job the fuzzing session sends its frames in
EXAMPLES = int(os.environ.get("TIERD_FUZZ_EXAMPLES", "0"))
# Errors a well-behaved daemon may answer garbage with; "internal" is a bug.
CLEAN_ERRORS = ("protocol", "state", "key", "capacity", "busy")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                    st.floats(allow_nan=True), st.text(max_size=300), st.binary(max_size=300))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)
tags = st.one_of(values, st.text(min_size=0, max_size=400), st.just("x" * 100_000))
ops = st.sampled_from(["commit", "commits", "keys", "stats", "nope", "", None])
any_op = st.one_of(st.sampled_from(list(P.REQUESTS)), values)
weird_keys = st.one_of(st.text(min_size=1, max_size=20), st.just("a\x00b"), st.just("k" * 1025),
                       st.just("../" * 10), values)
dims = st.one_of(st.integers(-2, 8), st.just(1 << 62), st.just(1 << 63), values)


@st.composite
def requests(draw, rid) -> bytes:
    """A request of a real op (or an op of any type) with a body of any shape."""
    op = draw(any_op)
    body = draw(st.one_of(
        values,
        st.fixed_dictionaries({"keys": st.lists(weird_keys, max_size=6)}),
        st.fixed_dictionaries({"keys": st.lists(weird_keys, max_size=3), "write": values,
                               "written": values}),
        st.fixed_dictionaries({"specs": st.lists(st.one_of(
            st.tuples(weird_keys, st.sampled_from(P.DTYPES + ("object",)),
                      st.lists(dims, max_size=4), dims).map(list), values), max_size=3)})))
    return msgpack.packb({"v": P.VERSION, "id": rid, "op": op, "body": body})


@st.composite
def frames(draw) -> bytes:
    kind = draw(st.sampled_from(["commit", "any_op", "request", "garbage", "truncated",
                                 "version"]))
    rid = draw(st.one_of(st.integers(0, 1 << 62), values))
    if kind == "request":
        return draw(requests(rid))
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
    for job in (JOB, FUZZ_JOB):
        with d.connect(job=job) as c:
            c.put("keep", torch.arange(1000, dtype=torch.int32))
            c.commit("base")
    ctl = ControlChannel(d.socket, FUZZ_JOB)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ctl.token)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"ipc://{d.socket}")
    yield d, sock
    sock.close()
    ctl.close()
    d.stop()


@settings(max_examples=EXAMPLES or 300, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=frames())
def test_fuzzed_frames_get_an_answer_and_the_daemon_stays_correct(target, frame):
    d, sock = target
    sock.send(frame)
    reply = sock.recv()              # every frame gets exactly one answer
    rid, body = P.decode_reply(reply)
    if isinstance(body, tuple):
        assert body[0] in CLEAN_ERRORS, body
    assert d.alive()


@st.composite
def control_messages(draw) -> list[bytes]:
    """What a client may write on the control socket: hellos with any job,
    segment requests of any shape (more than the kernel passes at once too),
    wrong lengths, garbage."""
    hello = {"v": draw(st.one_of(st.just(P.VERSION), values)),
             "op": draw(st.one_of(st.just("hello"), values)),
             "job": draw(st.one_of(st.none(), st.just(JOB), weird_keys, st.just("pid-1"),
                                   st.just("session-1"), st.just("j" * 300)))}
    segments = st.one_of(
        st.lists(st.one_of(st.integers(-1, (1 << 64) - 1), st.booleans(), values), max_size=8),
        st.integers(0, 400).map(lambda n: list(range(1, n + 1))), values)
    msgs = [P.encode_ctl(draw(st.one_of(st.just(hello), values.map(lambda v: {"x": v}))))]
    for _ in range(draw(st.integers(0, 3))):
        msgs.append(draw(st.one_of(
            st.builds(lambda s: P.encode_ctl({"segments": s}), segments),
            st.binary(max_size=64),
            st.integers(0, (1 << 32) - 1).map(lambda n: P.CTL_HEADER.pack(n) + b"\x90"))))
    return msgs


@settings(max_examples=EXAMPLES or 150, deadline=None, suppress_health_check=list(HealthCheck))
@given(msgs=control_messages())
def test_fuzzed_control_messages_end_only_their_session(target, msgs):
    d, _ = target
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(str(d.socket) + ".ctl")
    try:
        for m in msgs:
            conn.sendall(m)
    except (BrokenPipeError, ConnectionResetError):
        pass                         # the daemon already refused and closed: fine
    try:
        conn.shutdown(socket.SHUT_WR)
        while conn.recv(1 << 16):    # answers, then EOF: never a hang
            pass
    except (ConnectionResetError, OSError):
        pass
    finally:
        conn.close()
    assert d.alive()


def test_after_fuzzing_the_commit_and_its_data_are_intact(target):
    d, _ = target
    assert "internal error" not in d.output()
    with d.connect(job=JOB) as c:
        assert c.commits() == ["base"]
        assert torch.equal(c.get("keep"), torch.arange(1000, dtype=torch.int32))
        c.commit("after-fuzz")
    with d.connect(job=FUZZ_JOB) as c:   # the fuzzed job still works
        c.put("after", torch.ones(3))
        c.commit("after-fuzz")
        assert c.commits()[-1] == "after-fuzz"
