"""The control channel waits for a busy daemon's segment reply as long as a
request may take, and only the liveness probe gives up after seconds."""

from __future__ import annotations

import copy
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


def test_mapping_new_segments_is_counted_for_the_sessions_stats(daemon):
    """The seconds and bytes of segments mapped here (a lease that brings a
    new segment waits for them) show in an attached model's stats."""
    from tierd.client.attach import attach, detach, session_of
    with tierd.connect(daemon) as client:
        assert client.control.mapped_bytes == 0 and client.control.map_seconds == 0
        client.put("w", torch.arange(256.0))
        mapped = client.control.mapped_bytes
        assert mapped > 0 and client.control.map_seconds > 0
        model = attach(torch.nn.Sequential(torch.nn.Linear(64, 64)), client=client,
                       device="cpu")
        stats = session_of(model).stats()
        assert stats["pool_mapped_bytes"] == client.control.mapped_bytes >= mapped
        assert stats["pool_map_seconds"] == client.control.map_seconds
        detach(model)


def test_the_first_steps_pool_segments_are_mapped_ahead_not_in_its_lease_waits(daemon_factory):
    """[Note: segments mapped ahead]: the optimizer tells the daemon the
    gradients and state the first step stores; the client maps their
    segments as it is built, so the first step's leases map nothing where
    they wait, and the step matches torch's."""
    from tierd.client.attach import attach, detach, session_of
    import tierd.optim
    d = daemon_factory(pool="512MiB", extra=("--pool-threads", "2", "--segment-size", "4MiB"))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    model = copy.deepcopy(ref)
    with d.connect() as client:
        model = attach(model, client=client, device="cpu")
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        ahead, on_demand = client.control.ahead_bytes, client.control.mapped_bytes
        assert ahead >= 3 * 8 * 256 * 256 * 4   # a master and two moments of each weight
        x = torch.randn(4, 256)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
        assert client.control.mapped_bytes == on_demand   # nothing mapped in a wait
        stats = session_of(model).stats()
        assert stats["pool_mapped_ahead_bytes"] == client.control.ahead_bytes >= ahead
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach())
        detach(model)
