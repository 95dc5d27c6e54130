"""The daemon's event loop: control socket, request router, NVMe transfers.

This layer only translates: frames into :class:`~tierd.server.catalog.Catalog`
calls, and the transfers the catalog begins into thread-pool I/O. Every task
it starts is tracked so shutdown can drain it.

[Note: a session's requests keep their order]
A reserve that needs pool segments still being made waits for them off the
loop ([Note: a reserve waits for its segment off the loop] in
tierd.backends.hostpool), so the loop serves the control channel and other
clients meanwhile. The session's own later requests wait behind it, in
arrival order, and are served one by one once it has run: what a client
sends is applied in the order it was sent, as when the loop itself waited.
Letting them pass made the pool's eviction while a job grows depend on
timing (a run past the pool moved 5.2 MB a step through NVMe instead of
under 4.2 on 2 cores). A request blocked on eviction (``Blocked``) is
another matter: it waits for writes to land, and later requests pass it as
before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import zmq
import zmq.asyncio

from tierd import protocol as P
from tierd.backends.hostpool import HostPool
from tierd.backends.manifest import Manifest, ManifestStore
from tierd.backends.memory import host_memory
from tierd.backends.nvme import LOCK_FILE, NvmeStore
from tierd.backends.ownership import Ownership
from tierd.config import ServeConfig, format_size
from tierd.errors import (Busy, CapacityError, DaemonUnavailable, InternalError, ProtocolError,
                          TierdError)
from tierd.server import sockets
from tierd.server.catalog import Blocked, Catalog, Direction, Session, Transfer
from tierd.server.metrics import Metrics, serve_metrics
from tierd.server.sessions import ControlSessions
from tierd.server.sockets import ctl_path
from tierd.server.trace import Trace
from tierd.server.transfers import RecordTransfers, checksum_threads

log = logging.getLogger("tierd.daemon")

MAX_RETRIES = 10_000
DRAIN_SECONDS = 3.0


class Daemon:
    """``tierd serve``: construct, then ``await run()`` until stopped."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.failure: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()
        self._io: dict[Transfer, asyncio.Future] = {}
        self._inflight: dict[int, int] = {}
        #: per session, its requests behind a reserve waiting for its pool
        #: segments, in arrival order ([Note: a session's requests keep their order])
        self._held: dict[int, deque] = {}
        self._commit_locks: dict[str, asyncio.Lock] = {}
        self._inodes: dict[Path, int | None] = {}
        self.metrics = Metrics()

    # ---------------------------------------------------------- lifecycle
    def open(self) -> None:
        """Check the arguments and take the resources; raises TierdError."""
        cfg = self.config
        os.umask(0o077)   # what it makes on disk is its user's: [Note: group access] in sockets
        sockets.set_not_dumpable()
        self.access = sockets.GroupAccess.resolve(cfg.group) if cfg.group is not None else None
        sockets.prepare_socket_dir(cfg.socket, self.access)
        # Owned before anything there is bound or removed: [Note: ownership
        # before binding] in tierd.backends.ownership. Held until the process ends.
        self.owner = Ownership.take(lock_path(cfg.socket), f"--socket {cfg.socket}",
                                    "stop it or pass another --socket")
        nvme_owner, created = self._own_nvme()
        try:
            self._open_resources(nvme_owner)
        except TierdError:
            nvme_owner.release()
            if created:   # leave no directory behind that this start made
                (cfg.nvme / LOCK_FILE).unlink(missing_ok=True)
                try:
                    cfg.nvme.rmdir()
                except OSError:
                    pass  # something else appeared there meanwhile: keep it
            raise
        log.info("tierd serving at %s: pool %s, NVMe %s in %s (%s)", cfg.socket,
                 format_size(self.pool.budget), format_size(self.nvme.size), cfg.nvme,
                 "O_DIRECT" if self.nvme.direct else "buffered I/O")
        if self.access is not None:
            log.info("serving uid %d, root and the members of group %s (gid %d)",
                     self.access.daemon_uid, self.access.name, self.access.gid)

    def _open_resources(self, nvme_owner: Ownership) -> None:
        cfg = self.config
        self.fd_limit = sockets.raise_fd_limit()
        memory = host_memory()   # the check's figure and its source: tierd.backends.memory
        if cfg.pool > memory.available:   # one line: the refusal names the figure's source
            raise CapacityError(f"--pool {format_size(cfg.pool)} exceeds available memory "
                                f"({format_size(memory.available)}, {memory.source}); lower it")
        log.info("available memory %s: %s", format_size(memory.available), memory.source)
        sockets.claim_socket_paths(cfg.socket)
        self.nvme = NvmeStore(cfg.nvme, cfg.nvme_size, owner=nvme_owner)
        self.manifests = ManifestStore(cfg.nvme)
        # A job's memory is never handed to another job while it holds one
        # tensor in the segment, so a segment as large as a small pool would
        # let one tiny job keep every other job out: at most 1/16 of the pool.
        # [Note: segments made ahead] in tierd.backends.hostpool
        ahead = (cfg.pool_threads if cfg.pool_threads is not None
                 else min(8, max(1, (os.cpu_count() or 2) // 2)))
        self.pool = HostPool(cfg.pool, min(cfg.segment_size, max(cfg.pool // 16, 1 << 20)),
                             ahead=ahead)
        self.catalog = Catalog(self.pool, self.nvme, cfg.allow_root_join, cfg.quotas,
                               self.manifests)
        try:
            for line in self.catalog.recover(self.manifests.load_all(self.nvme.size)):
                log.info("%s", line)
        except TierdError:
            self.pool.close()
            self.nvme.close(remove=False)
            raise
        self.executor = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="tierd-io")
        self.checksums = ThreadPoolExecutor(checksum_threads(cfg.io_threads),
                                            thread_name_prefix="tierd-sum")
        self.records = RecordTransfers(self.nvme, self.executor, self.checksums)
        self.catalog_seconds = 0.0   # the loop's time inside the catalog, serving requests
        # [Note: the daemon's timeline] in tierd.server.trace
        self.trace = Trace(cfg.trace) if cfg.trace is not None else None
        self.zctx = zmq.asyncio.Context()
        self.router = self.zctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{cfg.socket}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(ctl_path(cfg.socket)))
        listener.listen(128)
        listener.setblocking(False)
        self._inodes = {p: sockets.inode_of(p) for p in (cfg.socket, ctl_path(cfg.socket))}
        if self.access is not None:   # bound 0700 (the umask): the group gets them only now
            for path in self._inodes:
                sockets.give_to_group(path, self.access, 0o660)
        self.sessions = ControlSessions(listener, cfg, self.catalog, self.pool, self.metrics,
                                        self._spawn, self.access)

    def _own_nvme(self) -> tuple[Ownership, bool]:
        """The NVMe directory, made if missing, and owned (see [Note: ownership
        before binding] in tierd.backends.ownership); whether this call made it."""
        nvme = self.config.nvme
        created = not nvme.exists()
        try:
            nvme.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierdError(f"--nvme {nvme} cannot be created: {exc.strerror}") from None
        if not os.access(nvme, os.W_OK | os.X_OK):
            raise TierdError(f"--nvme {nvme} is not writable by uid {os.getuid()}")
        # Refused (InUse): the directory is another daemon's, even one this
        # call made at the same moment as that daemon: nothing here is removed.
        return Ownership.take(nvme / LOCK_FILE, f"--nvme {nvme}",
                              "give each daemon its own --nvme directory"), created

    async def run(self) -> int:
        """Serve until stopped; 0 after a signal, 1 when an internal error stopped it."""
        self.open()
        from tierd.server import notify  # both sockets listen: tell systemd (Type=notify)
        notify.ready(f"serving at {self.config.socket}")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            self._spawn(self.sessions.accept_loop(), critical=True)
            self._spawn(self._router_loop(), critical=True)
            if self.config.metrics_port is not None:
                self._spawn(serve_metrics(self.config.metrics_host, self.config.metrics_port,
                                          lambda: self.metrics.render(self.stats())),
                            critical=True)
            await self.stopping.wait()
            log.info("tierd stopping")
        finally:
            await self._shutdown()
        return 1 if self.failure is not None else 0

    async def _shutdown(self) -> None:
        io = [f for f in self._io.values() if not f.done()]
        if io:
            await asyncio.wait(io, timeout=DRAIN_SECONDS)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=DRAIN_SECONDS)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.checksums.shutdown(wait=False, cancel_futures=True)
        self.router.close(linger=0)
        self.zctx.term()
        self.sessions.close()
        for path, inode in self._inodes.items():
            sockets.remove_if_ours(path, inode)
        self.pool.close()
        self.nvme.close(remove=not self.manifests.any())
        self.owner.release()
        if self.trace is not None:
            self.trace.close()
        log.info("tierd stopped")

    def _spawn(self, coro, critical: bool = False) -> asyncio.Task:
        """Track a task. A ``critical`` one is a loop the daemon cannot serve
        without: if it dies, the daemon stops (exit status 1). Any other (one
        request, session or transfer) only logs what escaped it."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, critical))
        return task

    def _task_done(self, task: asyncio.Task, critical: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        name = task.get_coro().__qualname__
        if not critical:
            log.error("internal error in %s; serving on", name, exc_info=task.exception())
            return
        log.error("internal error in %s; stopping", name, exc_info=task.exception())
        self.failure = task.exception()
        self.stopping.set()

    # ---------------------------------------------------------- requests
    async def _router_loop(self) -> None:
        for n in itertools.count():
            if n % 32 == 31:
                # With frames always waiting, awaiting recv never yields to the
                # loop: give the control sockets and transfers their turn, or one
                # flooding client would starve everyone's handshakes and I/O.
                await asyncio.sleep(0)
            frames = await self.router.recv_multipart()
            try:
                self._route(frames)
            except Exception as exc:  # a bug: answer, log, keep serving the others
                log.exception("internal error routing a request")
                if len(frames) == 2:
                    self._reply_error(frames[0], P.request_id(frames[1]), InternalError(
                        f"internal error in the daemon: {exc!r}"))

    def _route(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return  # not from a DEALER speaking our protocol
        ident, frame = frames
        session = self.sessions.tokens.get(ident)
        if session is None:
            self._reply_error(ident, P.request_id(frame), DaemonUnavailable(
                "this connection has no session (the daemon restarted?); connect again "
                "with tierd.connect()"))
            return
        try:
            rid, req = P.decode_request(frame)
        except ProtocolError as exc:
            self._reply_error(ident, P.request_id(frame), exc)
            return
        total = sum(self._inflight.values())
        if (self._inflight.get(session.id, 0) >= self.config.max_requests_per_client
                or total >= self.config.max_requests):
            self._reply_error(ident, rid, Busy(
                f"{self._inflight.get(session.id, 0)} requests of this client and {total} "
                f"in all are in flight; wait for replies before sending more"))
            return
        self._serve(ident, session, rid, req)

    def _serve(self, ident: bytes, session: Session, rid: int, req: P.Request) -> None:
        """Serve ``req`` now, or after the session's earlier requests held
        behind a reserve that waits for its pool segments ([Note: a session's
        requests keep their order])."""
        held = self._held.get(session.id)
        making = None if held is not None else self._making(session, req)
        if held is None and making is None:
            self._serve_now(ident, session, rid, req, time.perf_counter(), Trace.clock())
            return
        self._inflight[session.id] = self._inflight.get(session.id, 0) + 1
        if held is not None:
            held.append((ident, rid, req, time.perf_counter(), Trace.clock()))
            return
        self._held[session.id] = deque([(ident, rid, req, time.perf_counter(), Trace.clock())])
        self._spawn(self._serve_held(session, making))

    async def _serve_held(self, session: Session, making: Future) -> None:
        """Serve the session's held requests in order, each reserve once the
        segments it would wait for on the loop are made."""
        held = self._held[session.id]
        try:
            while held:
                while making is not None:   # each wait ends with that segment made
                    try:
                        await asyncio.wrap_future(making)
                    except Exception:   # the reserve makes its own, and says why
                        pass
                    if session.id not in self.catalog.sessions:
                        return   # the client went away meanwhile
                    making = self._making(session, held[0][2])
                ident, rid, req, start, arrived = held.popleft()
                self._done_inflight(session)
                self._serve_now(ident, session, rid, req, start, arrived)
                if held:
                    making = self._making(session, held[0][2])
        finally:
            for _ in held:   # unanswered: their client is gone
                self._done_inflight(session)
            del self._held[session.id]

    def _serve_now(self, ident: bytes, session: Session, rid: int, req: P.Request,
                   start: float, arrived: float) -> None:
        """Answer at once when the catalog can; else finish in a tracked task."""
        if isinstance(req, P.Commit):   # long: fsyncs; always in its own task
            self._inflight[session.id] = self._inflight.get(session.id, 0) + 1
            self._spawn(self._serve_commit(ident, session, rid, req, start))
            return
        try:
            result = self._attempt(session, req)
        except TierdError as exc:
            self._reply_error(ident, rid, exc)
            self.metrics.observe(type(req).__name__.lower(), time.perf_counter() - start)
            return
        except Exception as exc:  # a bug: answer, log, keep serving the others
            log.exception("internal error serving %s", type(req).__name__)
            self._reply_error(ident, rid, InternalError(f"internal error in the daemon: {exc!r}"))
            return
        if isinstance(result, Blocked):
            self._inflight[session.id] = self._inflight.get(session.id, 0) + 1
            self._spawn(self._serve_blocked(ident, session, rid, req, result, start, arrived))
        else:
            self._send(ident, P.encode_reply(rid, result))
            self.metrics.observe(type(req).__name__.lower(), time.perf_counter() - start)
            self._traced(session, req, arrived, blocked=False)

    def _traced(self, session: Session, req: P.Request, arrived: float, blocked: bool) -> None:
        if self.trace is not None:
            self.trace.request(type(req).__name__, session.id, getattr(req, "keys", ()),
                               arrived, blocked, getattr(req, "at", None))

    def _making(self, session: Session, req: P.Request) -> Future | None:
        """The pool segment being made that ``req`` would wait for on the loop
        ([Note: a reserve waits for its segment off the loop] in
        tierd.backends.hostpool)."""
        if not isinstance(req, P.Reserve):
            return None
        return self.pool.making_for(session.job, (spec.nbytes for spec in req.specs))

    async def _serve_blocked(self, ident, session, rid, req, blocked: Blocked,
                             start: float, arrived: float) -> None:
        making = None
        try:
            for _ in range(MAX_RETRIES):
                await self._wait(blocked)
                while making is not None:   # each wait ends with that segment made
                    try:
                        await asyncio.wrap_future(making)
                    except Exception:   # the reserve makes its own, and says why
                        pass
                    making = self._making(session, req)
                if session.id not in self.catalog.sessions:
                    return  # the client went away meanwhile
                result = self._attempt(session, req)
                if not isinstance(result, Blocked):
                    self._send(ident, P.encode_reply(rid, result))
                    self._traced(session, req, arrived, blocked=True)
                    return
                blocked = result
                making = self._making(session, req)
            raise CapacityError(f"no room after {MAX_RETRIES} rounds of eviction")
        except TierdError as exc:
            self._reply_error(ident, rid, exc)
        except Exception as exc:  # a bug: answer, log, keep serving the others
            log.exception("internal error serving %s", type(req).__name__)
            self._reply_error(ident, rid, InternalError(f"internal error in the daemon: {exc!r}"))
        finally:
            self.metrics.observe(type(req).__name__.lower(), time.perf_counter() - start)
            self._done_inflight(session)

    def _done_inflight(self, session: Session) -> None:
        self._inflight[session.id] -= 1
        if not self._inflight[session.id]:
            del self._inflight[session.id]

    async def _serve_commit(self, ident, session: Session, rid: int, req: P.Commit,
                            start: float) -> None:
        try:
            info = await self._commit(session, req.tag)
            self._send(ident, P.encode_reply(rid, P.Committed(info)))
        except TierdError as exc:
            self._reply_error(ident, rid, exc)
        except Exception as exc:  # a bug: answer, log, keep serving the others
            log.exception("internal error committing job %r", session.job)
            self._reply_error(ident, rid, InternalError(f"internal error in the daemon: {exc!r}"))
        finally:
            self.metrics.observe("commit", time.perf_counter() - start)
            self._done_inflight(session)

    async def _commit(self, session: Session, tag: str) -> dict:
        """Write back what changed, then fsync and the manifest (see the Note
        on commits in :mod:`tierd.server.commits`). One commit per job at a time."""
        loop = asyncio.get_running_loop()
        async with self._commit_locks.setdefault(session.job, asyncio.Lock()):
            for _ in range(MAX_RETRIES):
                try:
                    plan = self.catalog.prepare_commit(session, tag)
                finally:
                    self._run_started()
                if not isinstance(plan, Blocked):
                    break
                await self._wait(plan)
            else:
                raise TierdError(f"commit of job {session.job!r} never settled: its tensors "
                                 f"keep changing; commit when writers pause")
            try:
                await loop.run_in_executor(self.executor, self._write_commit, plan.manifest)
            except TierdError as exc:
                self.catalog.finish_commit(plan, exc)
                log.error("commit %r of job %r failed: %s", tag, session.job, exc)
                raise
            self.catalog.finish_commit(plan, None)
        info = plan.summary()
        log.info("committed job %r: %r (#%d), %d tensors, %d B, %d B written", session.job,
                 tag, info["seq"], info["tensors"], info["bytes"], info["written_bytes"])
        return info

    def _write_commit(self, manifest: Manifest) -> None:
        self.nvme.sync()          # the records first ...
        self.manifests.write(manifest)   # ... then the manifest naming them

    def stats(self) -> dict:
        """The catalog's figures, the disk's busy seconds each way and the
        loop's in the catalog ([Note: the catalog's cost on the loop] in
        tierd.server.catalog), and the manifests set aside."""
        return {**self.catalog.stats(), **self.records.busy_seconds(),
                "catalog_s": round(self.catalog_seconds, 3),
                "quarantined": self.manifests.quarantined()}

    def _attempt(self, s: Session, req: P.Request) -> P.Reply | Blocked:
        start = time.perf_counter()
        try:
            return self._attempt_once(s, req)
        finally:
            self.catalog_seconds += time.perf_counter() - start

    def _attempt_once(self, s: Session, req: P.Request) -> P.Reply | Blocked:
        c = self.catalog
        try:
            match req:
                case P.Reserve(specs, zero):
                    r = c.reserve(s, specs, zero)
                case P.Publish(keys):
                    r = c.publish(s, keys)
                case P.Abort(keys):
                    r = c.abort(s, keys)
                case P.Lease(keys, write):
                    r = c.lease(s, keys, write)
                case P.Release(keys, written):
                    r = c.release(s, keys, written)
                case P.Prefetch(keys):
                    r = c.prefetch(s, keys)
                case P.Evict(keys):
                    r = c.evict(s, keys)
                case P.Demote(keys):
                    r = c.demote(s, keys)
                case P.UsePlan(name, positions):
                    r = c.use_plan(s, name, positions)
                case P.UseAt(name, at):
                    r = c.use_at(s, name, at)
                case P.Delete(keys):
                    r = c.delete(s, keys)
                case P.DropJob():
                    r = c.drop_job(s.job)
                case P.Keys(prefix):
                    return P.KeyList(tuple(c.keys(s, prefix)))
                case P.Stats():
                    return P.StatsReply(self.stats())
                case P.Commits():
                    return P.TagList(tuple(c.commit_tags(s)))
                case P.ReportDevice(resident_bytes):
                    s.gpu_resident_bytes = resident_bytes
                    return P.Done()
                case P.Expect(sizes):
                    self.pool.expect(sizes, s.job)
                    return P.Done()

        finally:
            self._run_started()
        if isinstance(r, Blocked):
            return r
        return P.Placed(tuple(r)) if isinstance(r, list) else P.Done()

    async def _wait(self, blocked: Blocked) -> None:
        futures = [self._io[t] for t in blocked.wait if not t.done]
        if futures:
            await asyncio.wait(futures)
        for t in blocked.wait:
            if t.error is not None:
                raise t.error

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            # A client that stops reading fills its own pipe; beyond the high
            # water mark its replies are dropped and nobody else waits.
            self.router.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _reply_error(self, ident: bytes, rid: int, exc: TierdError) -> None:
        self.metrics.error(exc.code)
        self._send(ident, P.encode_error(rid, exc.code, str(exc)))

    # --------------------------------------------------------- transfers
    def _run_started(self) -> None:
        loop = asyncio.get_running_loop()
        for t in self.catalog.take_started():
            self._io[t] = loop.create_future()
            self._spawn(self._transfer(t))

    async def _transfer(self, t: Transfer) -> None:
        view = t.slot.segment.view(t.slot.offset, t.nbytes)
        write = t.direction is Direction.TO_NVME
        io = self.records.write if write else self.records.read
        error, began = None, Trace.clock()
        try:
            await io(t.disk.spans, t.entry.meta(), view)
        except TierdError as exc:
            error = exc
            log.error("%s", exc)
        except Exception as exc:  # a bug: this transfer fails, the others go on
            log.exception("internal error in an NVMe transfer of %r", t.entry.key)
            error = InternalError(f"internal error in the daemon's NVMe transfer: {exc!r}")
        finally:
            view.release()
            if self.trace is not None:
                self.trace.io("write" if write else "read", t.entry.key, t.nbytes, began)
            try:
                self.catalog.finish(t, error)
            finally:   # whatever happened, nobody may wait for this transfer for ever
                self._io.pop(t).set_result(None)
            self._run_started()


def lock_path(sock: Path) -> Path:
    """The lock file beside ``--socket PATH`` whose holder owns both its sockets."""
    return sock.with_name(sock.name + ".lock")


def serve(config: ServeConfig) -> None:
    """Run the daemon in this process until SIGTERM/SIGINT (uvloop when present).

    Raises SystemExit(1) when it stopped for any other reason (an internal
    error, logged), so a supervisor (systemd ``Restart=on-failure``) restarts it."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        code = asyncio.run(Daemon(config).run())
    else:
        code = uvloop.run(Daemon(config).run())
    if code:
        raise SystemExit(code)
