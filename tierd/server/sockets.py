"""The daemon's edge with the operating system: socket paths, the control
socket's framing, who a peer is, and keeping the process's memory private.

[Note: socket path safety]
``--socket PATH`` names two files, ``PATH`` (the
ZeroMQ request socket) and ``PATH.ctl``. The daemon replaces one only when it
is a socket that nobody listens on (left by a daemon that died); a regular
file, a directory or a live socket there is refused. The parent directory gets
mode 0700 only when the daemon created it: an existing directory (``/tmp``,
``/run/tierd`` made by systemd) keeps its mode. An existing directory that
another user owns, or that others may write without the sticky bit, is
refused: whoever can write it can replace the socket and impersonate the
daemon to its clients.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import resource
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from tierd import protocol as P
from tierd.errors import ProtocolError, TierdError

log = logging.getLogger("tierd.daemon")

PR_SET_DUMPABLE = 4
# SO_PEERPIDFD (Linux 6.5): a pidfd of the peer taken when it connected, so the
# process watched is the one that connected even if its pid is reused since.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def ctl_path(sock: Path) -> Path:
    return sock.with_name(sock.name + ".ctl")


# ---------------------------------------------------------------- paths
def prepare_socket_dir(sock: Path) -> None:
    """Create the socket's directory (0700) or check an existing one; see
    [Note: socket path safety]."""
    parent = sock.parent
    missing = []
    p = parent
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise TierdError(f"--socket {sock}: cannot create {parent}: {exc.strerror}") from None
    for created in missing:
        os.chmod(created, 0o700)   # mkdir's mode went through the umask
    if missing:
        return
    st = os.stat(parent)
    if not stat.S_ISDIR(st.st_mode):
        raise TierdError(f"--socket {sock}: {parent} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise TierdError(f"--socket {sock}: {parent} belongs to uid {st.st_uid}, who could "
                         f"replace the daemon's socket; use a directory of uid {os.getuid()} "
                         f"(or let the daemon create one)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise TierdError(f"--socket {sock}: {parent} is writable by other users without the "
                         f"sticky bit (mode {stat.S_IMODE(st.st_mode):o}), so they could replace "
                         f"the socket; use a directory only uid {os.getuid()} may write")


def claim_socket_paths(sock: Path) -> None:
    """Remove stale sockets at the two paths; refuse anything else there."""
    for path in (ctl_path(sock), sock):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(st.st_mode):
            raise TierdError(f"--socket {sock}: {path} exists and is not a socket; tierd "
                             f"replaces only a stale socket: move it or pick another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            os.unlink(path)   # stale: nobody listens on it
            continue
        except OSError as exc:
            raise TierdError(f"--socket {sock}: cannot check whether {path} is in use "
                             f"({exc.strerror}); remove it if no daemon runs") from None
        finally:
            probe.close()
        raise TierdError(f"socket {path} is in use by a live daemon; stop it or pass "
                         f"another --socket")


def remove_if_ours(path: Path, inode: int | None) -> None:
    """Unlink a socket file at shutdown unless another daemon has replaced it."""
    try:
        if inode is not None and os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def inode_of(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


# -------------------------------------------------------------- process
def set_not_dumpable() -> None:
    """``PR_SET_DUMPABLE`` 0: other processes of our uid can neither ptrace the
    daemon nor open its memfds through ``/proc/<pid>/fd`` (and no core dump
    writes the pool to disk)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise TierdError(f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(err)}")


def raise_fd_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard one (each client costs a few
    descriptors, each pool segment one; the usual soft 1024 runs out long
    before memory does); the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft


# ----------------------------------------------------------------- peers
@dataclass(frozen=True)
class Peer:
    """Who is at the other end of a control socket, as the kernel says.

    ``pid`` is 0 when the peer's process is outside the daemon's PID namespace
    (a container without hostPID), so it never names a job; ``pidfd`` (or
    None) lets the daemon notice the process's exit."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    pidfd = None
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        if pid > 0:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = None   # gone already, or no pidfd: the socket's EOF ends it
    return Peer(pid, uid, gid, pidfd)


# ------------------------------------------------------ control framing
async def _recv_exact(conn: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(conn, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def recv_ctl(conn: socket.socket) -> dict:
    (n,) = P.CTL_HEADER.unpack(await _recv_exact(conn, P.CTL_HEADER.size))
    if n > P.MAX_CTL_BYTES:
        raise ProtocolError(f"control message of {n} B is too large (at most "
                            f"{P.MAX_CTL_BYTES} B)")
    return P.decode_ctl(await _recv_exact(conn, n))


async def send_ctl(conn: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = P.encode_ctl(msg)
    if not fds:
        await asyncio.get_running_loop().sock_sendall(conn, data)
        return
    while True:
        try:
            sent = socket.send_fds(conn, [data], list(fds))
            break
        except BlockingIOError:
            await asyncio.sleep(0.001)
    if sent < len(data):
        await asyncio.get_running_loop().sock_sendall(conn, data[sent:])


async def refuse(conn: socket.socket, code: str, message: str, wait: float = 1.0) -> None:
    """Answer a connection the daemon will not serve: read its hello (so the
    close resets nothing unread), reply with the error, close."""
    try:
        await asyncio.wait_for(recv_ctl(conn), wait)
    except (Exception, asyncio.TimeoutError):
        pass   # whatever it sent, the answer is the same
    try:
        await asyncio.wait_for(send_ctl(conn, {"ok": False, "error": [code, message]}), wait)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        conn.close()
