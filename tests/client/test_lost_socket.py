"""A client never waits forever: a daemon whose data socket was removed (or
replaced by a dead one) while it runs answers on its control socket and never
on its data socket; a request then raises DaemonUnavailable naming the data
socket once the (here shortened) request timeout has passed. Real daemons."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import torch

import tierd
from tierd.client.control import check_sockets
from tierd.config import default_request_timeout


def test_a_removed_data_socket_fails_the_request_naming_it(daemon):
    os.unlink(daemon.socket)   # the daemon runs on; its control socket answers
    with tierd.connect(daemon.socket, request_timeout=0.5) as c:
        with pytest.raises(tierd.DaemonUnavailable, match=r"data socket .*tierd.sock is gone"):
            c.put("a", torch.ones(4))
        # the client knows: the next request fails at once, naming the same loss
        with pytest.raises(tierd.DaemonUnavailable, match="is gone"):
            c.get("a")


def test_a_stale_data_socket_fails_the_request_naming_it(daemon):
    os.unlink(daemon.socket)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(daemon.socket))   # a socket file nobody listens on
    stale.close()
    with tierd.connect(daemon.socket, request_timeout=0.5) as c:
        with pytest.raises(tierd.DaemonUnavailable, match="nobody listens on its data socket"):
            c.keys()


def test_the_async_client_fails_the_same_way(daemon):
    os.unlink(daemon.socket)

    async def put() -> None:
        async with await tierd.aconnect(daemon.socket, request_timeout=0.5) as c:
            await c.put("a", torch.ones(4))
    with pytest.raises(tierd.DaemonUnavailable, match="data socket .* is gone"):
        asyncio.run(asyncio.wait_for(put(), 60))


def test_a_slow_reply_is_waited_for_while_the_daemon_and_its_sockets_are_there(daemon):
    # a bound far below a round trip on a busy machine: each overdue check finds
    # both sockets in place and the request completes
    with tierd.connect(daemon.socket, request_timeout=0.001) as c:
        c.put("a", torch.arange(1 << 20, dtype=torch.float32))
        c.evict(["a"])
        assert torch.equal(c.get("a"), torch.arange(1 << 20, dtype=torch.float32))


def test_check_sockets_names_the_socket_that_fails(daemon, tmp_path):
    check_sockets(daemon.socket)   # both fine: no error
    os.unlink(daemon.socket)
    with pytest.raises(tierd.DaemonUnavailable, match="data socket .* is gone"):
        check_sockets(daemon.socket)
    with pytest.raises(tierd.DaemonUnavailable, match="no tierd daemon"):
        check_sockets(tmp_path / "none.sock")


def test_the_request_timeout_is_read_from_the_environment_and_checked(monkeypatch, daemon):
    monkeypatch.setenv("TIERD_REQUEST_TIMEOUT", "90")
    assert default_request_timeout() == 90.0
    with tierd.connect(daemon.socket) as c:
        assert c.request_timeout == 90.0
    monkeypatch.setenv("TIERD_REQUEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TIERD_REQUEST_TIMEOUT='soon'.*positive number"):
        default_request_timeout()
    with pytest.raises(ValueError, match="request_timeout=0"):
        tierd.connect(daemon.socket, request_timeout=0)
