"""Daemons that start fast and die hard: the fault tests restart one many times.

``python -m tierd`` imports torch through the package ``__init__`` (seconds per
start); the daemon itself needs none of it. :func:`start` runs the very same
``tierd.server.daemon.serve`` with the package's ``__init__`` bypassed, so a
kill -9 / restart cycle costs a fraction of a second.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tierd
from tierd.errors import DaemonUnavailable
from tests.conftest import ROOT, subprocess_env

LAUNCHER = """
import json, logging, sys, types
pkg = types.ModuleType("tierd"); pkg.__path__ = [sys.argv[1]]; sys.modules["tierd"] = pkg
init = open(sys.argv[1] + "/__init__.py").read()   # the version, without running __init__
pkg.__version__ = init.split("__version__ = ")[1].splitlines()[0].strip(chr(34) + chr(39))
from tierd.config import ServeConfig
from tierd.server.daemon import serve
logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
serve(ServeConfig(nvme=sys.argv[2], socket=sys.argv[3], pool=sys.argv[4],
                  nvme_size=sys.argv[5], **{"segment_size": "4MiB", "io_threads": 4,
                                            **json.loads(sys.argv[6])}))
"""


@dataclass
class Daemon:
    process: subprocess.Popen
    socket: Path
    nvme: Path
    log: Path

    def connect(self, job: str | None = None) -> tierd.Client:
        return tierd.connect(self.socket, job=job)

    def kill(self) -> None:
        """kill -9: no drain, no cleanup, as a crash or power cut (for the process)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def launch(workdir: Path, pool: str = "16MiB", nvme_size: str = "64MiB",
           wrapper: tuple[str, ...] = (), preexec_fn=None, **config) -> Daemon:
    """Start a daemon on ``workdir/nvme``; ``config`` adds ServeConfig fields,
    ``wrapper`` a command it runs under (``unshare ...``). Does not wait."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock, nvme, log = workdir / "tierd.sock", workdir / "nvme", workdir / "daemon.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([*wrapper, sys.executable, "-c", LAUNCHER, str(ROOT / "tierd"),
                                 str(nvme), str(sock), pool, nvme_size, json.dumps(config)],
                                stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(),
                                preexec_fn=preexec_fn)
    return Daemon(proc, sock, nvme, log)


def start(workdir: Path, pool: str = "16MiB", nvme_size: str = "64MiB", **kwargs) -> Daemon:
    """A daemon on ``workdir/nvme`` (kept across restarts), answering when returned."""
    d = launch(workdir, pool, nvme_size, **kwargs)
    proc, sock = d.process, d.socket
    deadline = time.monotonic() + 30
    while True:
        try:
            tierd.connect(sock).close()
            return d
        except DaemonUnavailable:
            if proc.poll() is not None or time.monotonic() > deadline:
                d.kill()
                raise RuntimeError(f"daemon did not start:\n{d.output()[-3000:]}")
            time.sleep(0.02)
