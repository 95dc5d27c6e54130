"""Exclusive ownership of a path for a daemon's life: an ``flock`` on a lock file.

[Note: ownership before binding]
A daemon owns two places: its socket path
(``PATH`` and ``PATH.ctl``) and its NVMe directory. It takes each by an
``flock`` on a lock file there (``PATH.lock`` beside the socket,
``tierd.lock`` in the directory), held until the process ends, *before* it
binds, removes or writes anything there. Binding alone cannot decide between
two daemons starting at once: ZeroMQ unlinks whatever file is at an ``ipc://``
path when it binds, so the loser of a race used to take the winner's data
socket with it and leave a daemon that answered on its control socket and
never on its data socket. The kernel drops an ``flock`` when its holder dies,
however it dies, so a stale lock file needs no cleaning and is never removed
(removing a lock file lets two daemons each hold a lock on a different file).
The holder writes its pid into the file, so whoever is refused can say who
owns the place.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from tierd.errors import TierdError

#: how long a refused daemon waits for the holder to write its pid (it takes
#: the lock, then writes: the two are not one step)
PID_WAIT = 0.5


class InUse(TierdError):
    """Another live process owns the place (its pid is in the message). Whoever
    gets this must change nothing there: the place is the other's."""


class Ownership:
    """An exclusive ``flock`` on ``path``, held until :meth:`release` or exit.

    >>> own = Ownership.take(Path("/run/t.sock.lock"), "--socket /run/t.sock",
    ...                      "pass another --socket")                  # doctest: +SKIP
    >>> own.release()                                                  # doctest: +SKIP
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path, what: str, fix: str) -> "Ownership":
        """Lock ``path`` (created 0600 if missing) and write this pid into it.

        When another process holds it: :class:`InUse` ``"<what> is in use by a
        live daemon (tierd pid N, holding <path>); <fix>"``, with nothing
        changed (the file, if this call created it, is left: see [Note:
        ownership before binding])."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierdError(f"{what}: cannot open the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder_pid(fd)
            os.close(fd)
            who = f"tierd pid {pid}" if pid else "another tierd"
            raise InUse(f"{what} is in use by a live daemon ({who}, holding {path}); "
                        f"{fix}") from None
        except OSError as exc:
            os.close(fd)
            raise TierdError(f"{what}: cannot lock {path}: {exc.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Give the place up: the pid is cleared (no stale pid is left to name,
        and the file takes no disk block), then closing the file drops the
        lock; once."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass   # a read-only or full filesystem: the stale pid is harmless
            os.close(self._fd)
            self._fd = None


def _holder_pid(fd: int) -> int | None:
    """The pid the holder wrote, once that process exists; None if none appears
    within PID_WAIT (a holder in another pid namespace, or one just starting)."""
    deadline = time.monotonic() + PID_WAIT
    pid = None
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        pid = int(text) if text.isdigit() and int(text) > 0 else pid
        if pid is not None and _exists(pid):
            return pid
        if time.monotonic() > deadline:
            return pid   # as recorded; it may live in another pid namespace
        time.sleep(0.01)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # someone else's process: alive
    return True
