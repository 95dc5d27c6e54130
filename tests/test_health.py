"""``tierd health`` says why a daemon is unhealthy; the daemon's version and
uptime are in ``status``, ``--json`` and ``/metrics``. Real daemons, real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tierd
from tests.conftest import ROOT, DaemonProcess, start_daemon, subprocess_env, tierd_command
from tests.server.test_metrics import metrics_url, scrape


def tierd_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(tierd_command(*args), env=subprocess_env(), capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_health_of_a_missing_socket_says_none_was_started(tmp_path):
    proc = tierd_run("health", "--socket", str(tmp_path / "t.sock"))
    assert proc.returncode == 1
    assert f"unhealthy: no daemon: {tmp_path / 't.sock.ctl'} does not exist" in proc.stderr


def test_health_of_a_killed_daemon_says_refused(daemon):
    daemon.stop(signal.SIGKILL)                      # its socket files stay behind
    proc = tierd_run("health", "--socket", str(daemon.socket))
    assert proc.returncode == 1
    assert "unhealthy: refused: nothing listens on" in proc.stderr


def test_health_of_a_hung_daemon_says_it_timed_out(daemon):
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        proc = tierd_run("health", "--socket", str(daemon.socket), "--timeout", "1")
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    assert proc.returncode == 1
    assert f"no reply from the daemon at {daemon.socket} within 1 s" in proc.stderr


@pytest.fixture
def other_version(tmp_path):
    sock, nvme = tmp_path / "t.sock", tmp_path / "nvme"
    log = tmp_path / "daemon.log"
    code = ("import sys, tierd; tierd.__version__ = '9.9.9'\n"
            "from tierd.cli import main; sys.exit(main(sys.argv[1:]))")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--nvme", str(nvme),
                                 "--socket", str(sock), "--pool", "16MiB", "--nvme-size",
                                 "64MiB", "--segment-size", "4MiB"],
                                env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
    d = DaemonProcess(proc, sock, nvme, log)
    ctl, deadline = Path(f"{sock}.ctl"), time.monotonic() + 60
    while not ctl.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)   # it imports torch first: seconds on a loaded machine
    assert ctl.exists(), log.read_text()[-2000:]
    yield d
    d.stop()


def test_health_of_a_daemon_of_another_version_says_so(other_version):
    proc = tierd_run("health", "--socket", str(other_version.socket), "--timeout", "20")
    assert proc.returncode == 1
    assert (f"wrong version: the daemon at {other_version.socket} runs tierd 9.9.9, this client "
            f"{tierd.__version__}") in proc.stderr
    status = tierd_run("status", "--socket", str(other_version.socket))
    assert status.stdout.startswith("tierd 9.9.9 up ")
    assert f"this client is {tierd.__version__}: upgrade both together" in status.stdout


def test_status_and_json_carry_version_and_uptime(daemon):
    proc = tierd_run("status", "--socket", str(daemon.socket))
    assert proc.returncode == 0 and proc.stdout.startswith(f"tierd {tierd.__version__} up ")
    view = json.loads(tierd_run("status", "--json", "--socket", str(daemon.socket)).stdout)
    assert view["version"] == tierd.__version__ and view["uptime_s"] >= 0
    health = tierd_run("health", "--socket", str(daemon.socket))
    assert health.returncode == 0 and health.stdout.startswith(f"ok: tierd {tierd.__version__} up")


def test_metrics_carry_build_info_and_a_tierd_job_label(tmp_path):
    d = start_daemon(tmp_path, extra=("--metrics-port", "0"))
    try:
        with d.connect(job="lab") as c:
            c.put("x", torch.ones(4))
            families = scrape(metrics_url(d))
        (info,) = families["tierd_build_info"].samples
        assert info.labels == {"version": tierd.__version__} and info.value == 1
        (up,) = families["tierd_uptime_seconds"].samples
        assert up.value >= 0
        labels = [s.labels for s in families["tierd_job_tensors"].samples]
        assert {"tierd_job": "lab"} in labels and all("job" not in lab for lab in labels)
    finally:
        d.stop()
