"""The control channel waits for a busy daemon's segment reply as long as a
request may take, and only the liveness probe gives up after seconds."""

from __future__ import annotations

import os
import signal
import threading

import torch

import tierd
from tierd import protocol as P
from tierd.client import control


def test_a_segment_reply_slower_than_the_connect_timeout_still_maps(daemon, monkeypatch):
    """A daemon busy past the connect timeout (a reserve making a large
    segment holds its loop) still hands over the segment: the channel is not
    lost, and the bytes written through it read back."""
    monkeypatch.setattr(control, "CONNECT_TIMEOUT", 0.2)
    with tierd.connect(daemon, request_timeout=30) as client:
        placed = client._submit(P.Reserve((P.TensorSpec("w", "float32", (256,), 1024),))).result()
        (p,) = placed.placements
        assert p.segment not in client.control.views
        os.kill(daemon.process.pid, signal.SIGSTOP)
        resume = threading.Timer(1.0, os.kill, (daemon.process.pid, signal.SIGCONT))
        resume.start()
        try:
            client.control.tensor(p).copy_(torch.arange(256.0))
        finally:
            resume.join()
            os.kill(daemon.process.pid, signal.SIGCONT)
        client.publish_async(["w"]).result()
        assert torch.equal(client.get("w"), torch.arange(256.0))
        assert client.control.lost() is None
