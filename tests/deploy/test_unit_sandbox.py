"""The systemd unit's sandbox lets the daemon work: every system call, socket
family and memory mapping a real daemon makes (start, a job that spills to
NVMe and commits, a metrics scrape, stop), traced with strace, is one the
unit's SystemCallFilter=, RestrictAddressFamilies= and
MemoryDenyWriteExecute= allow. Without systemd as init the unit cannot be
started here; this is what would fail if it were."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import tierd
from tests.conftest import ROOT, subprocess_env
from tierd.errors import DaemonUnavailable

UNIT = ROOT / "deploy" / "systemd" / "tierd.service"

pytestmark = pytest.mark.skipif(
    shutil.which("strace") is None or shutil.which("systemd-analyze") is None,
    reason="needs strace and systemd-analyze")


def filter_sets() -> dict[str, set[str]]:
    """``{"@group": {syscalls and @subgroups}}`` as this systemd knows them."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    groups: dict[str, set[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.split()[0], set())
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.add(line.strip())
    return groups


def expand(names: list[str], groups: dict[str, set[str]]) -> set[str]:
    calls: set[str] = set()
    for name in names:
        calls |= expand(sorted(groups[name]), groups) if name.startswith("@") else {name}
    return calls


def allowed_syscalls() -> set[str]:
    groups, allowed, denied = filter_sets(), set(), set()
    for value in re.findall(r"^SystemCallFilter=(.+)$", UNIT.read_text(), re.M):
        names = value.removeprefix("~").split()
        (denied if value.startswith("~") else allowed).update(expand(names, groups))
    assert allowed, "the unit has an allow list"
    return allowed - denied


def traced_daemon_session(tmp_path, run_dir) -> str:
    """A daemon serving its own group, as the unit runs it (--group Group=)."""
    trace, log, sock = tmp_path / "trace", tmp_path / "log", run_dir / "tierd" / "t.sock"
    with open(log, "wb") as out:
        strace = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", str(trace), sys.executable, "-m", "tierd", "serve",
             "--nvme", str(tmp_path / "nvme"), "--socket", str(sock), "--pool", "16MiB",
             "--nvme-size", "128MiB", "--segment-size", "4MiB", "--metrics-port", "0",
             "--group", str(os.getegid())],
            stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
    try:
        client = connect_when_up(sock, strace, log)
        with client:
            for i in range(6):                          # 24 MiB into a 16 MiB pool
                client.put(f"t{i}", torch.full((1 << 20,), float(i)))
            assert torch.equal(client.get("t0"), torch.full((1 << 20,), 0.0))
            client.commit("traced")
            url = re.search(r"metrics at (http://\S+)", log.read_text()).group(1)
            with urllib.request.urlopen(url, timeout=30) as r:
                assert b"tierd_pool_bytes" in r.read()
        (daemon,) = open(f"/proc/{strace.pid}/task/{strace.pid}/children").read().split()
        os.kill(int(daemon), signal.SIGTERM)
        assert strace.wait(60) == 0, log.read_text()
    finally:
        if strace.poll() is None:
            strace.send_signal(signal.SIGKILL)
            strace.wait(30)
    return trace.read_text()


def connect_when_up(sock, strace: subprocess.Popen, log) -> tierd.Client:
    deadline = time.monotonic() + 120
    while True:
        try:
            return tierd.connect(sock, job="traced")
        except DaemonUnavailable:
            if strace.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"daemon did not start under strace:\n{log.read_text()}")
            time.sleep(0.1)


def test_the_daemon_stays_inside_the_units_sandbox(tmp_path):
    if subprocess.run(["strace", "-qq", "-o", "/dev/null", "true"], timeout=60).returncode:
        pytest.skip("strace cannot trace here (ptrace not permitted)")
    run_dir = Path(tempfile.mkdtemp(prefix="tierd-run-"))   # the group may search it
    os.chmod(run_dir, 0o755)
    try:
        text = traced_daemon_session(tmp_path, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    used = set(re.findall(r"^\d+ +([a-z0-9_]+)\(", text, re.M))
    assert {"memfd_create", "fallocate", "accept4", "getsockopt"} <= used   # it worked
    assert not used - allowed_syscalls(), sorted(used - allowed_syscalls())
    families = set(re.findall(r"\bsocket\((AF_[A-Z0-9]+)", text))
    allowed = set(re.search(r"^RestrictAddressFamilies=(.+)$", UNIT.read_text(),
                            re.M).group(1).split())
    assert families and families <= allowed, families
    assert not re.search(r"PROT_WRITE\|PROT_EXEC|PROT_EXEC\|PROT_WRITE", text)
