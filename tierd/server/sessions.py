"""Client sessions on the control socket: handshake, limits, segment hand-over.

Each connection is served by its own task; whatever it sends or whatever goes
wrong while serving it ends only that session. A daemon serving a group first
checks the peer's credentials ([Note: group access] in
:mod:`tierd.server.sockets`). Exhaustion is refused per
connection with a reply that says why: a uid over ``max_sessions_per_uid``,
or the daemon out of file descriptors (answered through a descriptor kept
spare for exactly that).

[Note: default jobs]
A client that names no job gets a job of its own session,
``session-<n>`` (n counts up from 1 in each daemon run and is never reused in
it), which no other session can join: names of that form and the older
``pid-<n>`` form are refused in a hello. So a default job's identity is the
session token the handshake hands out, never a pid: a pid is 0 for a client
outside the daemon's PID namespace (every pod of a DaemonSet without hostPID)
and can be reused by a later process. The peer's pid and uid still come from
the kernel (``SO_PEERCRED``) for ownership checks and logs, and a pidfd taken
when it connected ends the session when the process exits.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
from collections.abc import Callable

from tierd import protocol as P
from tierd.backends.hostpool import HostPool
from tierd.config import ServeConfig
from tierd.errors import AccessDenied, Busy, InternalError, TierdError
from tierd.server import sockets
from tierd.server.catalog import Catalog, Session
from tierd.server.metrics import Metrics

log = logging.getLogger("tierd.daemon")

HELLO_SECONDS = 10.0   # a connection that says nothing this long is closed
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class ControlSessions:
    """The listening control socket and every session on it; ``tokens`` maps a
    ZeroMQ routing id to its session for the request router."""

    def __init__(self, listener: socket.socket, config: ServeConfig, catalog: Catalog,
                 pool: HostPool, metrics: Metrics, spawn: Callable,
                 access: sockets.GroupAccess | None = None) -> None:
        self.listener = listener
        self.access = access   # None: the socket's file modes alone decide
        self.config = config
        self.catalog = catalog
        self.pool = pool
        self.metrics = metrics
        self._spawn = spawn
        self.tokens: dict[bytes, Session] = {}
        self._per_uid: dict[int, int] = {}
        self._next_session = 1
        # Kept free so the accept loop can still answer "out of descriptors".
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self.listener.close()
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    async def accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.listener)
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    log.warning("accepting a control connection failed: %s", exc)
                    continue
                await self._refuse_out_of_fds(exc)
                continue
            self._spawn(self._serve(conn))

    async def _refuse_out_of_fds(self, exc: OSError) -> None:
        """Out of descriptors: answer the waiting client with Busy through the
        spare descriptor, so it learns why instead of hanging in the backlog."""
        message = (f"the daemon is out of file descriptors ({exc.strerror}); retry when other "
                   f"clients have disconnected, or raise the daemon's LimitNOFILE / ulimit -n")
        self.metrics.error(Busy.code)
        conn = None
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            try:
                conn, _ = self.listener.accept()
            except OSError:
                conn = None
        if conn is None:
            await asyncio.sleep(0.1)   # nothing to answer with: let clients leave first
        else:
            log.warning("refused a control connection: %s", message)
            conn.setblocking(False)
            await sockets.refuse(conn, Busy.code, message)
        try:
            self._spare_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._spare_fd = None

    async def _serve(self, conn: socket.socket) -> None:
        """One client session: handshake, segment fds on demand, EOF ends it.
        Whatever happens in it ends only this session."""
        try:
            peer = sockets.peer_of(conn)
        except OSError as exc:
            log.warning("cannot read a control peer's credentials: %s", exc)
            conn.close()
            return
        if self.access is not None:
            try:
                self.access.check(peer)
            except AccessDenied as exc:
                await self._refuse_peer(conn, peer, exc)
                return
        session = token = None
        self._per_uid[peer.uid] = self._per_uid.get(peer.uid, 0) + 1
        if peer.pidfd is not None:
            asyncio.get_running_loop().add_reader(peer.pidfd, _shut, conn)
        try:
            job = P.decode_hello(await asyncio.wait_for(sockets.recv_ctl(conn), HELLO_SECONDS))
            self._check_limit(peer.uid)
            session, token = self._open(job, peer)
            await sockets.send_ctl(conn, {"ok": True, "token": token, "session": session.id,
                                          "job": session.job})
            handed: set[int] = set()   # segments this client has mapped
            while True:
                msg = await sockets.recv_ctl(conn)
                more = None
                if P.is_claim(msg):
                    segs, more = self.pool.claim(session.job, P.MAX_SEGMENTS_PER_MESSAGE)
                else:
                    segs = [self.pool.segments.get(i) for i in P.decode_segments(msg)]
                    segs = [s for s in segs if s is not None and s.job == session.job]
                # dropped since: the client unmaps them, or their memory stays
                # allocated (and page-locked) for as long as it runs
                gone = sorted(i for i in handed if i not in self.pool.segments)
                handed.difference_update(gone)
                handed.update(s.id for s in segs)
                reply = {"ok": True, "gone": gone,
                         "segments": [[s.id, s.size, s.populated] for s in segs]}
                if more is not None:
                    reply["more"] = more
                await sockets.send_ctl(conn, reply, fds=[s.fd for s in segs])
        except (ConnectionError, asyncio.IncompleteReadError, EOFError, asyncio.TimeoutError):
            pass
        except TierdError as exc:
            await self._reply_error(conn, exc)
        except Exception as exc:  # a bug: answer, log, keep serving the others
            log.exception("internal error in the control session of pid %d uid %d",
                          peer.pid, peer.uid)
            await self._reply_error(conn, InternalError(f"internal error in the daemon: {exc!r}"))
        finally:
            self._end(conn, peer, session, token)

    async def _refuse_peer(self, conn: socket.socket, peer: sockets.Peer,
                           exc: AccessDenied) -> None:
        log.warning("refused a control connection of pid %d: %s", peer.pid, exc)
        self.metrics.error(exc.code)
        if peer.pidfd is not None:
            os.close(peer.pidfd)
        await sockets.refuse(conn, exc.code, str(exc))

    def _open(self, job: str | None, peer: sockets.Peer) -> tuple[Session, bytes]:
        sid = self._next_session
        self._next_session += 1
        session = self.catalog.open_session(sid, job, peer.pid, peer.uid)
        # A ZeroMQ routing id may not start with a zero byte.
        token = bytes([1 + secrets.randbelow(255)]) + secrets.token_bytes(15)
        self.tokens[token] = session
        return session, token

    def _check_limit(self, uid: int) -> None:
        limit = self.config.max_sessions_per_uid
        if self._per_uid[uid] > limit:
            raise Busy(f"uid {uid} has {self._per_uid[uid] - 1} sessions open, the most this "
                       f"daemon allows (max_sessions_per_uid = {limit}); close clients or "
                       f"raise it in the daemon's config")

    async def _reply_error(self, conn: socket.socket, exc: TierdError) -> None:
        self.metrics.error(exc.code)
        try:
            await asyncio.wait_for(sockets.send_ctl(
                conn, {"ok": False, "error": [exc.code, str(exc)]}), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass

    def _end(self, conn: socket.socket, peer: sockets.Peer, session: Session | None,
             token: bytes | None) -> None:
        if peer.pidfd is not None:
            asyncio.get_running_loop().remove_reader(peer.pidfd)
            os.close(peer.pidfd)
        conn.close()
        self._per_uid[peer.uid] -= 1
        if not self._per_uid[peer.uid]:
            del self._per_uid[peer.uid]
        if token is not None:
            del self.tokens[token]
        if session is not None:
            self.catalog.close_session(session.id)
            log.debug("session %d (pid %d) ended", session.id, peer.pid)


def _shut(conn: socket.socket) -> None:
    """The client process exited (its pidfd is readable), though a child it
    forked may still hold the socket: shut it down, which ends the session's
    read with EOF."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
