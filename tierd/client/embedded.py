"""The embedded daemon: a private ``tierd serve`` for a job that found none.

``tierd.attach(model)`` with no daemon running calls :func:`ensure_daemon`,
which starts one as a child process with its socket in a private temp dir and
its NVMe file under the user's cache dir, and stops it when this process
exits. The child asks the kernel to kill it if this process dies first
(``PR_SET_PDEATHSIG``), so a crashed job leaves no daemon behind.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tierd.backends.hostpool import available_memory
from tierd.client.control import ControlChannel
from tierd.config import default_socket_path
from tierd.errors import DaemonUnavailable

START_TIMEOUT = 30.0
PR_SET_PDEATHSIG = 1


@dataclass
class EmbeddedDaemon:
    process: subprocess.Popen
    socket: Path
    workdir: Path
    nvme: Path

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
        shutil.rmtree(self.nvme, ignore_errors=True)


class _Embedded:
    """The one embedded daemon of this process (created on first need)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.daemon: EmbeddedDaemon | None = None


_EMBEDDED = _Embedded()


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierd"


def answers(path: Path) -> bool:
    """True if a daemon answers on the control socket of ``path``."""
    try:
        ControlChannel(path, None).close()
        return True
    except DaemonUnavailable:
        return False


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the atexit hook still stops it on a clean exit


def start_daemon(pool: int | None = None, nvme_size: int | None = None,
                 nvme_dir: Path | None = None) -> EmbeddedDaemon:
    """Start a private daemon and wait until it answers."""
    workdir = Path(tempfile.mkdtemp(prefix="tierd-"))
    nvme = Path(tempfile.mkdtemp(prefix="nvme-", dir=_mkdir(nvme_dir or cache_dir())))
    sock = workdir / "tierd.sock"
    pool = pool or int(os.environ.get("TIERD_POOL", 0)) or min(available_memory() // 2, 32 << 30)
    if nvme_size is None:
        nvme_size = min(shutil.disk_usage(nvme).free // 2, 256 << 30)
    cmd = [sys.executable, "-m", "tierd", "serve", "--nvme", str(nvme), "--socket", str(sock),
           "--pool", str(pool), "--nvme-size", str(nvme_size), "--log-level", "WARNING"]
    log = open(workdir / "daemon.log", "wb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=_die_with_parent)
    log.close()
    daemon = EmbeddedDaemon(proc, sock, workdir, nvme)
    deadline = time.monotonic() + START_TIMEOUT
    while not answers(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            text = (workdir / "daemon.log").read_text(errors="replace")[-2000:]
            daemon.stop()
            raise DaemonUnavailable(f"the embedded tierd daemon did not start:\n{text}")
        time.sleep(0.05)
    return daemon


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_daemon(socket_path: str | Path | None = None) -> Path:
    """The socket of a daemon that answers: the given or default one if it
    does, else this process's embedded daemon (started on first call)."""
    path = Path(socket_path) if socket_path else default_socket_path()
    if socket_path or answers(path):
        return path
    with _EMBEDDED.lock:
        if _EMBEDDED.daemon is None or _EMBEDDED.daemon.process.poll() is not None:
            _EMBEDDED.daemon = start_daemon()
            atexit.register(_EMBEDDED.daemon.stop)
        return _EMBEDDED.daemon.socket
