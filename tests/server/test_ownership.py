"""Two daemons on one socket or one NVMe directory: exactly one serves, the
other exits with one line naming the live one's pid and changes nothing.
Real `tierd serve` processes started together, with jitter."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import tierd
from tests.conftest import start_daemon, subprocess_env, tierd_command


def _serve(sock: Path, nvme: Path, log: Path, delay: float) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            tierd_command("serve", "--nvme", str(nvme), "--socket", str(sock), "--pool", "16MiB",
                          "--nvme-size", "32MiB", "--segment-size", "4MiB", "--io-threads", "1"),
            stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(),
            preexec_fn=lambda: time.sleep(delay))   # the jitter, before exec


def _race(tmp: Path, seed: int, same_socket: bool) -> None:
    """Start two daemons at (nearly) the same moment on one socket (each with
    its own NVMe directory) or on one NVMe directory (each with its own
    socket); check the outcome, then stop the survivor."""
    rng = random.Random(seed)
    socks = [tmp / "run" / "t.sock"] * 2 if same_socket else [tmp / f"run{k}" / "t.sock"
                                                              for k in (0, 1)]
    nvmes = [tmp / f"nvme{k}" for k in (0, 1)] if same_socket else [tmp / "nvme"] * 2
    logs = [tmp / f"log{k}" for k in (0, 1)]
    procs = [_serve(socks[k], nvmes[k], logs[k], rng.uniform(0, 0.15)) for k in (0, 1)]
    try:
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither daemon gave way"
            time.sleep(0.02)
        loser = next(k for k in (0, 1) if procs[k].poll() is not None)
        winner = 1 - loser
        assert procs[loser].returncode != 0
        lines = [line for line in logs[loser].read_text().splitlines() if line.strip()]
        assert len(lines) == 1, logs[loser].read_text()
        assert f"is in use by a live daemon (tierd pid {procs[winner].pid}," in lines[0]
        assert ("--socket" if same_socket else "--nvme") in lines[0]
        if same_socket:
            assert not nvmes[loser].exists()   # it touched nothing
        else:
            assert not socks[loser].exists() and not socks[loser].with_suffix(".sock.ctl").exists()
        with tierd.connect(socks[winner], request_timeout=20) as c:
            c.put("a", torch.arange(4.0))
            assert torch.equal(c.get("a"), torch.arange(4.0))
        assert procs[winner].poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert procs[winner].returncode == 0, logs[winner].read_text()


@pytest.mark.parametrize("seed", range(8))
def test_two_daemons_on_one_socket_exactly_one_serves(tmp_path, seed):
    _race(tmp_path, seed, same_socket=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(50))
def test_two_daemons_on_one_socket_fifty_times(tmp_path, seed):
    _race(tmp_path, 1000 + seed, same_socket=True)


@pytest.mark.parametrize("seed", range(2))
def test_two_daemons_on_one_nvme_directory_exactly_one_serves(tmp_path, seed):
    _race(tmp_path, seed, same_socket=False)


def test_a_killed_daemons_lock_file_does_not_keep_the_next_out(tmp_path):
    d = start_daemon(tmp_path, pool="16MiB", nvme_size="32MiB")
    d.stop(signal.SIGKILL)
    assert d.socket.with_name("tierd.sock.lock").exists()   # left, and stale
    d = start_daemon(tmp_path, pool="16MiB", nvme_size="32MiB")
    try:
        with d.connect() as c:
            c.put("b", torch.ones(3))
            assert torch.equal(c.get("b"), torch.ones(3))
    finally:
        assert d.stop() == 0
