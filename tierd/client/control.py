"""A client's control channel to the daemon: handshake, pool mappings, liveness.

The control socket (see :mod:`tierd.protocol`) is opened first: it proves who
we are to the daemon and returns the token the request socket then uses as its
ZeroMQ routing id. Pool segments are mapped lazily, the first time a reply
names one, with the memfd the daemon passes over the same socket. The socket
also tells us when the daemon dies: it becomes readable with EOF.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from tierd import protocol as P
from tierd.backends.hostpool import populate_pages
from tierd.errors import AccessDenied, DaemonUnavailable, ProtocolError, TierdError, from_wire

CONNECT_TIMEOUT = 2.0
#: seconds between claims while the daemon is still making what was expected
CLAIM_POLL = 0.02

#: [Note: mapping a segment with its page tables]
#: A segment's pages exist before a client maps it, but a plain mapping has no
#: page table entries, so the client's first write to each 4 KiB page faults,
#: and those faults, not the copies, bound an attach. Where the daemon also zeroed the
#: pages (``Segment.populated``: [Note: segments made ahead] in
#: ``tierd.backends.hostpool``), the page tables are filled right after the
#: mmap call (MADV_POPULATE_READ, as ``MAP_POPULATE`` would but without the
#: GIL, so a thread mapping segments ahead does not stall the copies: read
#: faults of a shared mapping, each mapping the 16 pages around it that are
#: ready): an attach then faults once per 16 pages.
#: Where it did not (fewer than
#: ``POPULATE_THREADS`` cores to spare), populating would zero every page in
#: that one call, on the thread that maps, instead of in the copy threads'
#: faults, slower than faulting; those segments are mapped plainly (figures:
#: ``benchmarks/results/HISTORY.md``, "Figures behind the Notes").

if TYPE_CHECKING:
    import torch


@cache
def torch_dtypes() -> dict[str, "torch.dtype"]:
    """Wire dtype name -> torch dtype; imports torch on first use only, so the
    probes (``tierd status``/``health``) never pay for it."""
    import torch
    return {name: getattr(torch, name) for name in P.DTYPES if hasattr(torch, name)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in torch_dtypes():
        raise TierdError(f"dtype {dtype} cannot be stored; supported: "
                         f"{', '.join(torch_dtypes())}")
    return name


def no_daemon(path: Path, why: str) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"no tierd daemon at {path} ({why}); start one with `tierd serve --nvme DIR "
        f"--socket {path}`, or point TIERD_SOCKET at a running one")


def not_tierd(path: Path, why: str) -> DaemonUnavailable:
    return DaemonUnavailable(f"{path} is not a tierd daemon's socket ({why}); point --socket "
                             f"or TIERD_SOCKET at tierd's")


def data_socket_problem(path: Path) -> str | None:
    """What is wrong with the data (ZeroMQ) socket at ``path``, in words, or
    None when something listens there. A bare connect, closed at once: the
    daemon's ZeroMQ drops it as a peer that never spoke."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"its data socket {path} is gone (removed while the daemon runs)"
    except OSError as exc:
        return f"its data socket {path} cannot be checked ({exc.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return f"its data socket {path} was replaced by a file that is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(CONNECT_TIMEOUT)
    try:
        probe.connect(str(path))
    except OSError as exc:
        return (f"nobody listens on its data socket {path} ({exc.strerror or exc}: a "
                f"stale socket file replaced the daemon's)")
    finally:
        probe.close()
    return None


def check_sockets(path: Path) -> None:
    """Raise DaemonUnavailable naming the socket that fails, for probes such
    as ``tierd health``: the control socket (``PATH.ctl``: no daemon, or it
    does not answer) or the data socket (``PATH``: gone, or nobody listens).

    >>> check_sockets(Path("/run/tierd/tierd.sock"))   # doctest: +SKIP
    """
    channel = ControlChannel(Path(path), None)
    try:
        lost = channel.lost()
    finally:
        channel.close()
    if lost is not None:
        raise DaemonUnavailable(f"the tierd daemon at {path}: {lost}; restart it")


class ControlChannel:
    """The control socket and the pool segments mapped through it."""

    def __init__(self, path: Path, job: str | None) -> None:
        self.path = Path(path)
        self.ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.ctl.settimeout(CONNECT_TIMEOUT)
        try:
            self.ctl.connect(str(self.path.with_name(self.path.name + ".ctl")))
            self._send({"v": P.VERSION, "op": "hello", "job": job})
            reply, _ = self._recv()
        except FileNotFoundError:
            self.ctl.close()
            raise no_daemon(self.path, "socket file missing") from None
        except PermissionError:   # the file modes: [Note: group access] in tierd.server.sockets
            self.ctl.close()
            raise AccessDenied(
                f"permission denied at {self.path}.ctl for uid {os.getuid()}: the tierd daemon "
                f"there serves its own user, root and, when started with --group, that group's "
                f"members; ask its operator to add this user to the group (then log in again), "
                f"or run the job as the daemon's user") from None
        except (OSError, EOFError) as exc:
            self.ctl.close()
            raise no_daemon(self.path, str(exc) or type(exc).__name__) from None
        except ProtocolError as exc:   # something else listens there
            self.ctl.close()
            raise not_tierd(self.path, str(exc)) from None
        if reply.get("ok") and not (isinstance(reply.get("token"), bytes)
                                    and isinstance(reply.get("job"), str)):
            self.ctl.close()
            raise not_tierd(self.path, "its reply has no session token")
        if not reply.get("ok"):
            self.ctl.close()
            raise from_wire(*reply.get("error", ["tierd", "handshake refused"]))
        #: seconds a segment reply may take: the daemon answers the control
        #: socket between requests, and a reserve making a large segment
        #: holds it (the client sets its request timeout here)
        self.reply_timeout = CONNECT_TIMEOUT
        self.token: bytes = reply["token"]
        self.job: str = reply["job"]
        self.lock = threading.Lock()  # guards the control socket and the maps
        self.mmaps: dict[int, mmap.mmap] = {}
        self.views: dict[int, torch.Tensor] = {}
        self._listeners: list[Callable[[int, torch.Tensor], None]] = []
        self._unmap_listeners: list[Callable[[int, torch.Tensor], None]] = []
        self.dead = False
        #: seconds spent making new segments usable here (page tables, and the
        #: listeners: ``cudaHostRegister``), and their bytes, since connecting,
        #: on the thread that needed them: a caller waiting on a lease waits
        #: for this too
        self.map_seconds = 0.0
        self.mapped_bytes = 0
        #: the same for segments mapped ahead ([Note: segments mapped ahead]
        #: in tierd.backends.hostpool), before they were needed
        self.ahead_seconds = 0.0
        self.ahead_bytes = 0

    # -------------------------------------------------------- control I/O
    def _send(self, msg: dict) -> None:
        self.ctl.sendall(P.encode_ctl(msg))

    def _recv(self) -> tuple[dict, list[int]]:
        data, fds, _flags, _addr = socket.recv_fds(self.ctl, 1 << 16, 256)
        if not data:
            raise EOFError("daemon closed the control socket")
        while len(data) < P.CTL_HEADER.size:
            data += self.ctl.recv(P.CTL_HEADER.size - len(data))
        (n,) = P.CTL_HEADER.unpack(data[:P.CTL_HEADER.size])
        while len(data) < P.CTL_HEADER.size + n:
            more = self.ctl.recv(P.CTL_HEADER.size + n - len(data))
            if not more:
                raise EOFError("daemon closed the control socket")
            data += more
        return P.decode_ctl(data[P.CTL_HEADER.size:]), fds

    def lost(self) -> str | None:
        """What of the daemon is lost, in words, or None while it answers on its
        control socket and someone listens on its data socket. Makes one round
        trip on the control socket: for when a reply is overdue, not hot paths."""
        if not self.alive():
            return "the daemon went away (its control socket closed)"
        try:
            self.map([], ask=True, timeout=CONNECT_TIMEOUT)
        except TierdError as exc:
            return f"the daemon does not answer on its control socket ({exc})"
        return data_socket_problem(self.path)

    def alive(self) -> bool:
        """False once the daemon has gone (its end of the control socket closed)."""
        if self.dead:
            return False
        with self.lock:
            readable, _, _ = select.select([self.ctl], [], [], 0)
            if readable:
                try:
                    self.dead = self.ctl.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    self.dead = True
        return not self.dead

    # ------------------------------------------------------------ segments
    def on_segment_mapped(self, callback: Callable[[int, torch.Tensor], None],
                          unmapped: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Call ``callback(segment_id, uint8_view)`` for every segment, now and
        later, and ``unmapped(segment_id, uint8_view)`` before one is unmapped."""
        with self.lock:
            self._listeners.append(callback)
            if unmapped is not None:
                self._unmap_listeners.append(unmapped)
            current = list(self.views.items())
        for sid, view in current:
            callback(sid, view)

    def tensor(self, p: P.Placement) -> torch.Tensor:
        """A tensor of the placement's dtype and shape over its pool bytes."""
        if p.segment not in self.views:
            self.map([p.segment])
        raw = self.views[p.segment][p.offset:p.offset + p.nbytes]
        return raw.view(torch_dtypes()[p.dtype]).view(p.shape)

    def map(self, ids: list[int], ask: bool = False, timeout: float | None = None) -> None:
        """Map the segments ``ids`` not mapped yet; with ``ask``, ask the daemon
        even when that is none (a round trip that shows it answers). A reply
        not here within ``timeout`` (default ``reply_timeout``, at least
        CONNECT_TIMEOUT) seconds loses the channel (DaemonUnavailable)."""
        new, gone = [], []
        with self.lock:
            want = list(dict.fromkeys(i for i in ids if i not in self.views))
            batches = [want[start:start + P.MAX_SEGMENTS_PER_MESSAGE]
                       for start in range(0, len(want), P.MAX_SEGMENTS_PER_MESSAGE)]
            for batch in batches or ([[]] if ask else []):
                got, dropped, _ = self._map_batch({"segments": batch},
                                                  timeout or self.reply_timeout)
                for sid, view, _mm in got:
                    self.views[sid] = view
                new += got
                gone += [(sid, self.views.pop(sid)) for sid in dropped if sid in self.views]
            missing = set(want) - self.views.keys()
            listeners, unmap = list(self._listeners), list(self._unmap_listeners)
        for sid, view in gone:
            self._unmap(sid, view, unmap)
        # outside the lock: several threads may map segments at once
        t0 = time.perf_counter()
        for sid, view, mm in new:
            self._make_usable(sid, view, mm, listeners)
            self.mapped_bytes += view.numel()
        if new:
            self.map_seconds += time.perf_counter() - t0
        if missing:
            raise TierdError(f"the daemon did not hand over pool segments {sorted(missing)}")

    @staticmethod
    def _make_usable(sid: int, view: torch.Tensor, mm: mmap.mmap | None, listeners) -> None:
        """Page tables (of a segment the daemon populated), then the listeners
        (``cudaHostRegister``)."""
        if mm is not None:
            with contextlib.suppress(OSError):   # before Linux 5.14: faults instead
                populate_pages(mm, len(mm), write=False)
        for cb in listeners:
            cb(sid, view)

    def map_ahead(self) -> None:
        """Claim the segments the daemon makes for what this job told it to
        expect, and make them usable here as they come, until it makes no
        more ([Note: segments mapped ahead] in tierd.backends.hostpool):
        before the first step, where registering them costs least. Gives up
        when none arrives for ``reply_timeout`` seconds."""
        quiet_since = time.monotonic()
        while not self.dead:
            with self.lock:
                try:
                    got, dropped, more = self._map_batch({"claim": True}, self.reply_timeout)
                except TierdError:
                    return   # the next request reports a lost daemon
                for sid, view, _mm in got:   # as map() does: another thread may lease
                    self.views[sid] = view
                gone = [(sid, self.views.pop(sid)) for sid in dropped if sid in self.views]
                listeners, unmap = list(self._listeners), list(self._unmap_listeners)
            for sid, view in gone:
                self._unmap(sid, view, unmap)
            t0 = time.perf_counter()
            for sid, view, mm in got:
                self._make_usable(sid, view, mm, listeners)
                self.ahead_bytes += view.numel()
            self.ahead_seconds += time.perf_counter() - t0
            if got:
                quiet_since = time.monotonic()
            elif not more or time.monotonic() - quiet_since > self.reply_timeout:
                return
            else:
                time.sleep(CLAIM_POLL)

    def _unmap(self, sid: int, view, listeners) -> None:
        """A segment the daemon dropped: nothing of this client is in it (the
        daemon drops only empty segments), so its pages go with the mapping."""
        for unmapped in listeners:
            unmapped(sid, view)
        del view
        mm = self.mmaps.pop(sid, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a stale tensor still uses it; see [Note: mapping lifetime]

    def _map_batch(self, ask: dict, timeout: float
                   ) -> tuple[list[tuple[int, torch.Tensor, mmap.mmap | None]], list[int], int]:
        """Map the segments the daemon hands over for ``ask`` (at most
        MAX_SEGMENTS_PER_MESSAGE ids, the kernel's limit of descriptors in one
        message, or a claim), not yet published in ``views``; called with the
        lock held. Also returns the ids of segments mapped earlier that the
        daemon has dropped since, and (for a claim) how many more it makes."""
        try:
            # at least CONNECT_TIMEOUT: a request_timeout is when a reply is
            # checked on ([Note: overdue replies] in tierd.client.connection),
            # never a bound that fails a control round trip on a busy machine
            self.ctl.settimeout(max(timeout, CONNECT_TIMEOUT))
            self._send(ask)
            reply, fds = self._recv()
        except (OSError, EOFError) as exc:
            self.dead = True
            raise DaemonUnavailable(f"lost the tierd daemon at {self.path}: {exc}") from None
        new = []
        try:
            if not reply.get("ok", True):
                raise from_wire(*reply.get("error", ["tierd", "segments refused"]))
            for (sid, size, populated), fd in zip(reply.get("segments", []), fds):
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                self.mmaps[sid] = mm
                # [Note: mapping lifetime]
                # The tensor holds a memoryview of the
                # mapping, an export that keeps ``mm.close()`` from unmapping it:
                # a view of a lease taken from it stays valid after close()
                # while anything references it (no segfault), and the pages go
                # when the last tensor over them does.
                import torch
                view = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
                new.append((sid, view, mm if populated else None))
        finally:
            for fd in fds:
                os.close(fd)
        more = reply.get("more", 0)
        return new, list(reply.get("gone", [])), more if type(more) is int else 0

    def close(self) -> None:
        for sid, view in self.views.items():
            for unmapped in self._unmap_listeners:
                unmapped(sid, view)
        self.views.clear()
        for mm in self.mmaps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a tensor still uses it; see [Note: mapping lifetime]
        self.mmaps.clear()
        self.ctl.close()
        self.dead = True
