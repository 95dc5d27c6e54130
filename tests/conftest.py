"""Fixtures shared by every test: real daemon processes on temp dirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import tierd
from tierd.errors import DaemonUnavailable

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class DaemonProcess:
    """A ``tierd serve`` child process; ``socket`` is what clients connect to."""

    process: subprocess.Popen
    socket: Path
    nvme: Path
    log: Path

    def __fspath__(self) -> str:  # so tierd.connect(daemon) works
        return str(self.socket)

    def connect(self, job: str | None = None) -> tierd.Client:
        return tierd.connect(self.socket, job=job)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout)
        return self.process.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def tierd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tierd", *args]


def subprocess_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def start_daemon(tmp: Path, pool: str = "64MiB", nvme_size: str = "512MiB",
                 extra: tuple[str, ...] = (), wait: bool = True) -> DaemonProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    sock, nvme, log = tmp / "tierd.sock", tmp / "nvme", tmp / "daemon.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            tierd_command("serve", "--nvme", str(nvme), "--socket", str(sock), "--pool", pool,
                          "--nvme-size", nvme_size, "--segment-size", "16MiB", *extra),
            stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    d = DaemonProcess(proc, sock, nvme, log)
    if wait:
        deadline = time.monotonic() + 30
        while True:
            try:
                tierd.connect(sock).close()
                break
            except DaemonUnavailable:
                if proc.poll() is not None or time.monotonic() > deadline:
                    d.stop(signal.SIGKILL)
                    raise RuntimeError(f"daemon did not start:\n{d.output()}")
                time.sleep(0.05)
    return d


@pytest.fixture
def daemon_factory(tmp_path):
    """``daemon_factory(pool="64MiB", nvme_size="512MiB")`` starts a daemon;
    all are stopped at the end of the test."""
    started: list[DaemonProcess] = []

    def factory(**kwargs) -> DaemonProcess:
        d = start_daemon(tmp_path / f"d{len(started)}", **kwargs)
        started.append(d)
        return d

    yield factory
    for d in started:
        try:
            d.stop()
        except subprocess.TimeoutExpired:
            d.stop(signal.SIGKILL)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    """A real daemon with a 64 MiB pool and 512 MiB of NVMe on a temp dir."""
    return daemon_factory()


@pytest.fixture
def client(daemon):
    c = daemon.connect()
    yield c
    c.close()
