"""The embedded daemon: a private ``tierd serve`` for a job that found none.

``tierd.attach(model)`` with no socket configured and no daemon at the
default path calls :func:`ensure_daemon`,
which starts one as a child process with its socket in a private temp dir and
its NVMe file in a private directory under ``$TIERD_NVME`` (default: the
user's cache dir), and stops it when this process exits. The child asks the
kernel to kill it if this process dies first (``PR_SET_PDEATHSIG``), so a
crashed job leaves no daemon behind.

Its sizes come from what the model needs and what the machine has
([Note: embedded daemon sizes] in ``tierd.client.capacity``); arguments,
then ``TIERD_POOL`` / ``TIERD_NVME_SIZE``, win over that. A later attach in
this process whose model does not fit restarts it larger when it holds
nothing; :func:`room_problem` gives the CapacityError text otherwise.

[Note: an explicit socket is authoritative]
A socket given as an argument (``connect(path)``, ``--socket``) or by
``$TIERD_SOCKET`` names the daemon the operator means; when nothing answers
there, the job fails with DaemonUnavailable naming the path instead of
starting a private daemon sized from the host (in a 4 GiB pod, a pool sized
for the node). Only with no socket configured does a job start its own.
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

from tierd.backends.memory import available_memory
from tierd.client.capacity import (
    DaemonRoom, Machine, Sizes, Sizing, StoreNeed, embedded_sizes, shortfall, unsized_defaults)
from tierd.client.control import ControlChannel, no_daemon
from tierd.config import default_socket_path, parse_size
from tierd.errors import DaemonUnavailable

START_TIMEOUT = 30.0
PR_SET_PDEATHSIG = 1
NVME_DIR_VAR = "TIERD_NVME"   # the embedded daemon's NVMe files go in a private dir under it


@dataclass
class EmbeddedDaemon:
    process: subprocess.Popen
    socket: Path
    workdir: Path
    nvme: Path
    sizing: Sizing | None = None   # how its sizes were chosen

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
        self.stop_registered = False

    def running(self) -> EmbeddedDaemon | None:
        d = self.daemon
        return d if d is not None and d.process.poll() is None else None

    def replace(self, daemon: EmbeddedDaemon) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        self.daemon = daemon
        if not self.stop_registered:
            atexit.register(self.stop)
            self.stop_registered = True

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


_EMBEDDED = _Embedded()


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierd"


def nvme_root() -> Path:
    """Where embedded daemons put their NVMe dirs: ``$TIERD_NVME``, else the cache dir."""
    return Path(os.environ[NVME_DIR_VAR]) if os.environ.get(NVME_DIR_VAR) else cache_dir()


@dataclass(frozen=True)
class SocketChoice:
    """The daemon socket a job uses and why (``tierd doctor`` prints both).

    ``explicit``: named by the caller or ``$TIERD_SOCKET``, so no embedded
    daemon may stand in for it ([Note: an explicit socket is authoritative]).

    >>> resolve_socket("/run/tierd/tierd.sock")
    SocketChoice(path=PosixPath('/run/tierd/tierd.sock'), why='given as an argument', explicit=True)
    """

    path: Path
    why: str
    explicit: bool


def resolve_socket(socket_path: str | Path | None = None) -> SocketChoice:
    """The socket for ``socket_path``: itself, else ``$TIERD_SOCKET``, else the default path."""
    if socket_path:
        return SocketChoice(Path(socket_path), "given as an argument", True)
    if os.environ.get("TIERD_SOCKET"):
        return SocketChoice(Path(os.environ["TIERD_SOCKET"]), "set by $TIERD_SOCKET", True)
    where = "$XDG_RUNTIME_DIR" if os.environ.get("XDG_RUNTIME_DIR") else "/tmp/tierd-$UID"
    return SocketChoice(default_socket_path(), f"the default path under {where}, as no "
                        "--socket or $TIERD_SOCKET is set", False)


def node_socket(socket_path: str | Path | None = None) -> Path | None:
    """The socket of the daemon to use when one answers; None when none is
    configured and none answers at the default path (start an embedded one).
    DaemonUnavailable, naming the path, when an explicit socket has no daemon."""
    choice = resolve_socket(socket_path)
    if answers(choice.path):
        return choice.path
    if choice.explicit:
        raise no_daemon(choice.path, f"{choice.why}; tierd starts a private daemon only "
                                     "when no socket is configured")
    return None


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


def _given(value: int | None, var: str) -> tuple[int | None, str]:
    """A size given as an argument, else by ``var``, with where it came from."""
    if value is not None:
        return value, "given to start_daemon"
    text = os.environ.get(var)
    if not text:
        return None, ""
    try:
        return parse_size(text), var
    except ValueError as exc:
        raise ValueError(f"{var}={text!r}: {exc}") from None


def choose_sizes(nvme_dir: Path, need: StoreNeed | None, *, commits: bool,
                 pool: int | None = None, nvme_size: int | None = None) -> Sizing:
    """The embedded daemon's sizes: arguments, then ``TIERD_POOL`` /
    ``TIERD_NVME_SIZE``, then sized from ``need`` and this machine (without
    a need: :func:`~tierd.client.capacity.unsized_defaults`)."""
    pool, pool_from = _given(pool, "TIERD_POOL")
    nvme_size, nvme_from = _given(nvme_size, "TIERD_NVME_SIZE")
    machine = Machine(available_ram=available_memory(), free_disk=shutil.disk_usage(nvme_dir).free,
                      nvme_dir=nvme_dir, released=need.released if need is not None else 0)
    if need is None:   # no model to size for
        unsized = unsized_defaults(machine)
        sizes = Sizes(pool or unsized.pool, nvme_size or unsized.nvme_size)
    else:
        sizes = embedded_sizes(need, machine, commits=commits, pool=pool, nvme_size=nvme_size)
    return Sizing(machine, sizes, pool_from=pool_from, nvme_from=nvme_from)


def start_daemon(pool: int | None = None, nvme_size: int | None = None,
                 nvme_dir: Path | None = None, *, need: StoreNeed | None = None,
                 commits: bool = False) -> EmbeddedDaemon:
    """Start a private daemon and wait until it answers; sizes as :func:`choose_sizes`."""
    root = _mkdir(nvme_dir or nvme_root())
    sizing = choose_sizes(root, need, commits=commits, pool=pool, nvme_size=nvme_size)
    workdir = Path(tempfile.mkdtemp(prefix="tierd-"))
    nvme = Path(tempfile.mkdtemp(prefix="nvme-", dir=root))
    sock = workdir / "tierd.sock"
    cmd = [sys.executable, "-m", "tierd", "serve", "--nvme", str(nvme), "--socket", str(sock),
           "--pool", str(sizing.sizes.pool), "--nvme-size", str(sizing.sizes.nvme_size),
           "--log-level", "WARNING"]
    log = open(workdir / "daemon.log", "wb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=_die_with_parent)
    log.close()
    daemon = EmbeddedDaemon(proc, sock, workdir, nvme, sizing)
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


def _room(socket: Path) -> DaemonRoom | None:
    from tierd.client.connection import connect   # the store client imports torch
    client = connect(socket)
    try:
        return DaemonRoom.from_stats(client.stats())
    finally:
        client.close()


def ensure_daemon(socket_path: str | Path | None = None, *, need: StoreNeed | None = None,
                  commits: bool = False) -> Path:
    """The socket of a daemon that answers: the given one, or ``$TIERD_SOCKET``
    (DaemonUnavailable when nothing answers there), or the default one if it
    answers, else this process's embedded daemon, started on first call sized
    for ``need`` (``commits``: a named job, which may commit). A running
    embedded daemon that cannot hold ``need`` and holds nothing is started
    again larger; one that holds something is kept (the caller's
    :func:`room_problem` check then names the sizes that would work)."""
    path = node_socket(socket_path)
    if path is not None:
        return path
    with _EMBEDDED.lock:
        running = _EMBEDDED.running()
        if running is not None:
            if need is None:
                return running.socket
            room = _room(running.socket)
            if room is None or room.holds(need) or not room.idle:
                return running.socket
            _EMBEDDED.stop()   # first, so the machine's RAM and disk are measured without it
        _EMBEDDED.replace(start_daemon(need=need, commits=commits))
        return _EMBEDDED.daemon.socket


def room_problem(client, need: StoreNeed, what: str, *, attaching: bool = True) -> str | None:
    """The CapacityError text when the daemon behind ``client`` cannot hold
    ``need`` (see :func:`tierd.client.capacity.shortfall`), else None."""
    room = DaemonRoom.from_stats(client.stats())
    if room is None:
        return None
    path = getattr(client, "path", None)
    running = _EMBEDDED.running()
    if running is not None and path is not None and Path(path) == running.socket:
        return shortfall(need, room, what=what, daemon="the embedded daemon",
                         sizing=running.sizing, attaching=attaching)
    return shortfall(need, room, what=what, daemon=f"the daemon at {path or 'this store'}")


def is_embedded(socket: str | Path) -> bool:
    """``socket`` is this process's embedded daemon, whose state (commits
    too) is deleted when this process exits."""
    d = _EMBEDDED.running()
    return d is not None and Path(socket) == d.socket
