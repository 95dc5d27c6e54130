"""The daemon's edge with the operating system: socket paths, the control
socket's framing, who a peer is and whether it may connect, and keeping the
process's memory private.

[Note: socket path safety]
``--socket PATH`` names two files, ``PATH`` (the
ZeroMQ request socket) and ``PATH.ctl``. The daemon replaces one only when it
is a socket that nobody listens on (left by a daemon that died); a regular
file, a directory or a live socket there is refused. The parent directory gets
mode 0700 only when the daemon created it: an existing directory (``/tmp``,
``/run/tierd`` made by systemd) keeps its mode. An existing directory that
another user owns, or that others may write without the sticky bit, is
refused: whoever can write it can replace the socket and impersonate the
daemon to its clients. With ``--group`` the directory the daemon creates is
0750 instead, and an existing one must let the group search it: [Note: group
access].

[Note: group access]
Without ``--group`` the daemon serves its own user and root: the socket
directory it creates is 0700 and nothing else is checked. With ``--group G``
the members of G may use it too, so jobs run as their own users:

- The socket directory it creates is 0750 and G's; the two sockets are 0660
  and G's. Not 0770: connecting needs only search on the directory and write
  on the socket, and a member who could write the directory could replace the
  sockets and impersonate the daemon. An existing directory (and every one
  above it) must let G search it (group G with g+x, or o+x, or an ACL), else
  the daemon refuses to start and names the directory, rather than serve a
  socket the members cannot reach. So does a daemon whose user is not in G
  (it could not give its files to G); simplest, G is its own group, and what
  it makes is G's with no chown.
- The file modes are the first gate; each control connection is also checked
  (:meth:`GroupAccess.admits`, plain code over a uid and its groups): the
  daemon's uid, root, or a process in G. The groups are the peer's when it
  connected, from the kernel (``SO_PEERGROUPS``, as ``SO_PEERCRED`` gives its
  uid): the credentials the file modes were checked against, and what a pod
  has (``securityContext.supplementalGroups``) although its uid is in no
  group database on the node. Only where the kernel lacks ``SO_PEERGROUPS``
  (before Linux 4.13) does the group database answer (``getgrouplist``). A
  refused peer gets ``AccessDenied`` naming its uid and groups and the fix.
  The request (ZeroMQ) socket needs no check of its own: a request counts
  only with a session token, which only the control socket hands out.
- What a member may do inside the daemon is the jobs' business: a named job
  belongs to the uid that created it, and only that uid (or root, with
  ``allow_root_join``) joins it (``Catalog.open_session``); a job's pool
  segments go only to its sessions.
- Everything the daemon makes on disk is its user's alone (it runs with
  umask 077): the NVMe directory it creates, the data file and the manifests
  (0600; a data file found wider is narrowed), the lock files. Pool segments
  (memfds, which have no path and ignore the umask) are made 0600, so a
  descriptor of one reached through ``/proc/PID/fd`` opens for the daemon's
  user only.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import grp
import logging
import os
import pwd
import resource
import socket
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from tierd import protocol as P
from tierd.errors import AccessDenied, ProtocolError, TierdError

log = logging.getLogger("tierd.daemon")

PR_SET_DUMPABLE = 4
# SO_PEERPIDFD (Linux 6.5): a pidfd of the peer taken when it connected, so the
# process watched is the one that connected even if its pid is reused since.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
# SO_PEERGROUPS (Linux 4.13): the peer's supplementary groups when it connected.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def ctl_path(sock: Path) -> Path:
    return sock.with_name(sock.name + ".ctl")


# ---------------------------------------------------------------- access
@dataclass(frozen=True)
class GroupAccess:
    """Who may use a daemon started with ``--group``: its own uid, root, and
    the processes in group ``gid``. See [Note: group access].

    >>> access = GroupAccess("tierd", 2000, daemon_uid=999)
    >>> access.admits(1001, {1001, 2000}), access.admits(1002, {1002})
    (True, False)
    """

    name: str
    gid: int
    daemon_uid: int

    @classmethod
    def resolve(cls, group: str) -> GroupAccess:
        """The group ``group`` names (a name, or a gid: a pod's group need not be
        in the container's group database); TierdError if there is none."""
        try:
            return cls(group, grp.getgrnam(group).gr_gid, os.getuid())
        except KeyError:
            pass
        if not group.isdigit():
            raise TierdError(f"--group {group}: no such group on this host (getent group "
                             f"{group}); give an existing group's name or its gid")
        gid = int(group)
        try:
            name = grp.getgrgid(gid).gr_name
        except KeyError:
            name = group
        return cls(name, gid, os.getuid())

    def admits(self, uid: int, gids: Collection[int]) -> bool:
        """Whether a peer with ``uid``, in groups ``gids`` (primary and
        supplementary), may use the daemon."""
        return uid in (self.daemon_uid, 0) or self.gid in gids

    def check(self, peer: Peer) -> None:
        """Raise AccessDenied, naming the fix, unless ``peer`` is admitted."""
        gids = peer_gids(peer)
        if self.admits(peer.uid, gids):
            return
        raise AccessDenied(
            f"uid {peer.uid} (groups {', '.join(map(str, sorted(gids))) or 'none'}) may not use "
            f"this tierd daemon: it serves uid {self.daemon_uid}, root and the members of group "
            f"{self.name} (gid {self.gid}); add the user to {self.name} (usermod -aG "
            f"{self.name} USER, then log in again) or, in a pod, add {self.gid} to "
            f"securityContext.supplementalGroups")


def check_member(access: GroupAccess) -> None:
    """Refuse to start unless the daemon may give its files to the group (it
    is root, or the group is one of its own), before it makes any."""
    if os.geteuid() == 0 or access.gid in (os.getegid(), *os.getgroups()):
        return
    raise TierdError(
        f"--group {access.name}: the daemon's user (uid {os.getuid()}) is not in group "
        f"{access.name} (gid {access.gid}), so it cannot give the socket to it; make it the "
        f"daemon's group (systemd Group=, a pod's runAsGroup) or add the user to it (usermod "
        f"-aG {access.name} USER)")


def give_to_group(path: Path, access: GroupAccess, mode: int) -> None:
    """Make ``path`` (the daemon's) group ``access.gid``'s with ``mode``."""
    if os.stat(path).st_gid != access.gid:
        try:
            os.chown(path, -1, access.gid)
        except OSError as exc:
            raise TierdError(
                f"--group {access.name}: cannot give {path} to group {access.name} (gid "
                f"{access.gid}): {exc.strerror}; make it the daemon's group (systemd Group=, a "
                f"pod's runAsGroup), which needs no chown") from None
    os.chmod(path, mode)


def check_reachable(sock: Path, access: GroupAccess) -> None:
    """Refuse to serve ``sock`` where a member of the group could not reach
    it: every directory above it must let the group search it."""
    for d in (sock.parent, *sock.parent.parents):
        st = os.stat(d)
        if st.st_mode & 0o001 or (st.st_gid == access.gid and st.st_mode & 0o010):
            continue
        if _has_acl(d):
            continue   # the ACL decides; the mode bits do not say
        raise TierdError(
            f"--group {access.name}: its members cannot reach {sock}: {d} (mode "
            f"{stat.S_IMODE(st.st_mode):o}, gid {st.st_gid}) lets neither group {access.name} "
            f"nor others search it; chgrp {access.name} {d} && chmod g+x {d}, or put the socket "
            f"where they can reach it (--socket /run/tierd/tierd.sock)")


def _has_acl(path: Path) -> bool:
    try:
        os.getxattr(path, "system.posix_acl_access")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- paths
def prepare_socket_dir(sock: Path, access: GroupAccess | None = None) -> None:
    """Create the socket's directory (0700, or 0750 of the group with
    ``access``) or check an existing one; see [Note: socket path safety]."""
    if access is not None:
        check_member(access)
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
        if access is None:
            os.chmod(created, 0o700)   # mkdir's mode went through the umask
        else:
            give_to_group(created, access, 0o750)
    if not missing:
        _check_existing_dir(sock, parent)
    if access is not None:
        check_reachable(sock, access)


def _check_existing_dir(sock: Path, parent: Path) -> None:
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
    None) lets the daemon notice the process's exit; ``groups`` are its
    supplementary groups when it connected (None where the kernel does not
    say)."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None
    groups: tuple[int, ...] | None = None


def peer_of(conn: socket.socket) -> Peer:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    groups = peer_groups(conn)
    pidfd = None
    try:
        pidfd = conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        if pid > 0:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = None   # gone already, or no pidfd: the socket's EOF ends it
    return Peer(pid, uid, gid, pidfd, groups)


def peer_groups(conn: socket.socket) -> tuple[int, ...] | None:
    """The peer's supplementary groups when it connected (``SO_PEERGROUPS``),
    or None on a kernel without it. Through libc: Python's getsockopt reads at
    most 1024 bytes, 256 groups."""
    libc = ctypes.CDLL(None, use_errno=True)
    count = 64
    while True:
        buf = (ctypes.c_uint32 * count)()
        size = ctypes.c_uint32(ctypes.sizeof(buf))
        if libc.getsockopt(conn.fileno(), socket.SOL_SOCKET, SO_PEERGROUPS, buf,
                           ctypes.byref(size)) == 0:
            return tuple(buf[:size.value // ctypes.sizeof(ctypes.c_uint32)])
        err = ctypes.get_errno()
        if err == errno.ERANGE and size.value > ctypes.sizeof(buf):
            count = size.value // ctypes.sizeof(ctypes.c_uint32)   # the size it needs
            continue
        if err in (errno.ENOPROTOOPT, errno.EINVAL):
            return None
        raise OSError(err, os.strerror(err))


def peer_gids(peer: Peer) -> frozenset[int]:
    """The peer's primary and supplementary groups: the kernel's, else (an old
    kernel) the group database's for its uid."""
    if peer.groups is not None:
        return frozenset((peer.gid, *peer.groups))
    try:
        return frozenset(os.getgrouplist(pwd.getpwuid(peer.uid).pw_name, peer.gid))
    except KeyError:   # a uid the database does not know (a pod's)
        return frozenset((peer.gid,))


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
