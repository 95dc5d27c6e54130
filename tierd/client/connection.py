"""The store client: ``tierd.connect()`` and its asyncio twin ``tierd.aconnect()``.

Every store call is written once, in :class:`_StoreCalls`, as a generator that
yields requests and receives replies; each client runs those generators its
own way (:meth:`Client._run` blocks and returns the value, :meth:`AsyncClient._run`
returns a coroutine), so the two clients differ only in how they wait.

Tensor bytes never travel over the socket: ``put`` reserves pool slots, copies
into the shared mapping and publishes; ``get`` leases, copies out, releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from tierd import protocol as P
from tierd.client.control import ControlChannel, dtype_name
from tierd.client.store import Leased, check_dense
from tierd.config import check_request_timeout, default_request_timeout, default_socket_path
from tierd.errors import DaemonUnavailable, TierdError, from_wire

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierd.client")

POLL_MS = 10
#: a CUDA value stored in another dtype is converted on its GPU this many
#: bytes (of the stored dtype) at a time: the GPU memory it takes meanwhile
COPY_PIECE = 256 << 20
#: [Note: one read of a shared source]
#: A CPU source stored under several keys (an fp32 parameter stored as its
#: fp32 master and its bf16 compute copy) is copied into all of them a piece
#: at a time, so the second copy reads the piece from the cache the first
#: left it in, not from memory: an fp32 model's attach reads its 4 B/param
#: once instead of twice (the copies are memory-bound on many threads). A
#: piece is split across torch's threads; this size keeps each thread's part
#: and its two destinations within a core's L2 (about 2 MiB).
SHARED_SOURCE_PIECE = 8 << 20
#: [Note: pipelined puts]
#: ``put_batches`` keeps reservations this many bytes ahead of the batch it
#: copies, so the daemon makes (and zeroes) the pool segments of the next
#: batches, and ``MAP_THREADS`` helper threads map them here (page tables,
#: ``cudaHostRegister``, both without the GIL), while this thread copies
#: into the current one: a put of one batch does those in series, and an
#: attach of many small batches (one per module) waited on each. The daemon
#: answers requests in order, so a segment it makes in a reserve (a tensor
#: larger than the standard segment: an embedding) is made while the copies
#: of the batches before it go on, if reserved far enough ahead. Requests
#: and replies stay on the calling thread; the helpers only map. Reserved
#: batches' sources are only referenced, not copied: the lookahead costs
#: pool slots reserved early and the sources freed later (a CPU model's
#: parameters are emptied once their batch is published), those of at most
#: this many stored bytes, and of at most a quarter of the pool: a reserved
#: slot cannot leave it, so a model larger than the pool is stored only if
#: the published batches can be evicted to NVMe to take the next ones (with
#: every batch reserved ahead, a 30 MB model did not go into a 16 MiB pool).
PUT_AHEAD = 4 << 30
MAP_THREADS = 4
#: requests of one ``put_batches`` in flight at most (the daemon answers a
#: client's 257th with Busy), however small its batches
PUT_REQUESTS = 64


def _keys(keys: str | Iterable[str]) -> tuple[str, ...]:
    return (keys,) if isinstance(keys, str) else tuple(keys)


def _specs(like: Mapping[str, torch.Tensor],
           dtypes: Mapping[str, torch.dtype] | None = None) -> tuple[P.TensorSpec, ...]:
    """Reserve specs for tensors shaped like the values of ``like``, in
    ``dtypes[key]`` where given (else the value's dtype)."""
    check_dense(like, values=False)
    specs = []
    for k, t in like.items():
        dtype = t.dtype if dtypes is None else dtypes.get(k, t.dtype)
        specs.append(P.TensorSpec(k, dtype_name(dtype), tuple(t.shape),
                                  t.numel() * dtype.itemsize))
    return tuple(specs)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (any device and dtype, ``dst``'s shape) into the pool view
    ``dst``, converted on the way.

    A CPU source converts in the copy itself (torch's threads, no temporary).
    A CUDA source in another dtype is converted on its GPU in pieces of
    ``COPY_PIECE`` bytes, each then copied device -> page-locked pool: a
    blocking cross-device ``copy_`` that converts would do it on the CPU,
    through a pageable temporary (and a pageable device-to-host copy)."""
    if src.device.type == "cpu" or src.dtype == dst.dtype:
        dst.copy_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)
    step = max(1, COPY_PIECE // dst.element_size())
    for at in range(0, flat_dst.numel(), step):
        flat_dst[at:at + step].copy_(flat_src[at:at + step].to(dst.dtype))


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``copy_in(dst, src)`` for each pair, reading a CPU source that several
    pool views take (a parameter's fp32 master and its bf16 compute copy)
    once from memory: [Note: one read of a shared source]."""
    by_source: dict[int, list[int]] = {}
    for i, src in enumerate(srcs):
        by_source.setdefault(id(src), []).append(i)
    for group in by_source.values():
        src = srcs[group[0]]
        if len(group) == 1 or src.device.type != "cpu" or not src.is_contiguous():
            for i in group:
                copy_in(dsts[i], srcs[i])
            continue
        flat_src = src.view(-1)
        flats = [dsts[i].view(-1) for i in group]
        step = max(1, SHARED_SOURCE_PIECE // src.element_size())
        for at in range(0, flat_src.numel(), step):
            piece = flat_src[at:at + step]
            for flat in flats:
                flat[at:at + step].copy_(piece)


def _decode(frame: bytes) -> tuple[int, Any]:
    """(request id, reply); an unreadable reply becomes its waiter's ProtocolError."""
    try:
        return P.decode_reply(frame)
    except TierdError as exc:
        return P.request_id(frame), (exc.code, str(exc))


def _check(reply: Any) -> Any:
    if isinstance(reply, tuple):
        raise from_wire(*reply)
    return reply


def _one(req: P.Request, convert=lambda reply: reply) -> Generator:
    """A single request; its reply (converted) is the result."""
    return convert((yield req))


class _StoreCalls:
    """The store API, written once for both clients; ``_run`` is theirs."""

    control: ControlChannel

    def _run(self, proc: Generator) -> Any:
        raise NotImplementedError

    def _views(self, reply: P.Placed) -> list[torch.Tensor]:
        """Views of the placements' pool bytes, the segments not mapped yet
        mapped in one control round trip."""
        self.control.map([p.segment for p in reply.placements])
        return [self.control.tensor(p) for p in reply.placements]

    def _leased(self, reply: P.Placed) -> list[Leased]:
        return [Leased(p.key, view, p.version)
                for p, view in zip(reply.placements, self._views(reply))]

    def _put(self, items: Mapping[str, torch.Tensor],
             dtypes: Mapping[str, torch.dtype] | None = None) -> Generator:
        check_dense(items)
        tensors = [t.detach() for t in items.values()]
        placed = yield P.Reserve(_specs(items, dtypes))
        try:
            copy_all(self._views(placed), tensors)
        except BaseException:
            yield P.Abort(tuple(items))
            raise
        yield P.Publish(tuple(items))

    def _put_zeros(self, like: Mapping[str, torch.Tensor]) -> Generator:
        yield P.Reserve(_specs(like), zero=True)
        yield P.Publish(tuple(like))

    def _get(self, keys: tuple[str, ...]) -> Generator:
        placed = yield P.Lease(keys)
        try:
            out = {p.key: self.control.tensor(p).clone() for p in placed.placements}
        except BaseException:
            yield P.Release(keys)
            raise
        yield P.Release(keys)
        return out

    def put(self, key: str, tensor: torch.Tensor):
        """Store a copy of ``tensor`` under ``key`` (replacing any older version)."""
        return self._run(self._put({key: tensor}))

    def put_many(self, items: Mapping[str, torch.Tensor],
                 dtypes: Mapping[str, torch.dtype] | None = None):
        """Store a copy of each tensor under its key, all in one reserve and
        one publish. ``dtypes[key]``, where given, is the dtype stored for
        that key: the value is converted while it is copied into the pool, with
        no converted copy made first. Values may be on any device: a CUDA
        tensor is copied straight into the (page-locked) pool, converted on
        the GPU.

        >>> c.put_many({"p/w": w32}, dtypes={"p/w": torch.bfloat16})   # doctest: +SKIP
        """
        return self._run(self._put(dict(items), dtypes))

    def put_zeros(self, like: Mapping[str, torch.Tensor]):
        """Store zero tensors shaped like the values of ``like`` (only shape
        and dtype are read: meta tensors do). Nothing is copied: the daemon
        hands out slots that read zero, most of them fresh pool pages that
        need no write at all (see [Note: zero slots] in
        ``tierd.backends.hostpool``).

        >>> c.put_zeros({"opt/0.m": torch.empty(4096, 4096, device="meta")})   # doctest: +SKIP
        """
        return self._run(self._put_zeros(dict(like)))

    def get(self, key: str):
        """A new CPU tensor with the stored bytes; ``KeyError`` if there is none."""
        return self._run(_one_of(self._get((key,)), key))

    def get_many(self, keys: Iterable[str]):
        return self._run(self._get(_keys(keys)))

    def prefetch(self, keys: str | Iterable[str]):
        """Start bringing keys into the pool; returns once the daemon accepted it."""
        return self._run(_one(P.Prefetch(_keys(keys)), _nothing))

    def evict(self, keys: str | Iterable[str]):
        """Write keys to NVMe and free their pool slots; returns when done."""
        return self._run(_one(P.Evict(_keys(keys)), _nothing))

    def delete(self, keys: str | Iterable[str]):
        return self._run(_one(P.Delete(_keys(keys)), _nothing))

    def keys(self, prefix: str = ""):
        return self._run(_one(P.Keys(prefix), lambda r: list(r.keys)))

    def drop_job(self):
        """Delete every tensor of this client's job (other clients of it stay)."""
        return self._run(_one(P.DropJob(), _nothing))

    def stats(self):
        """Pool and NVMe sizes and use, tensor count, traffic counters, jobs."""
        return self._run(_one(P.Stats(), lambda r: r.stats))

    def commit(self, tag: str):
        """Make every tensor of this client's job durable as one version tagged
        ``tag``; after a daemon crash and restart the job holds exactly this
        version. Returns ``{"tag", "seq", "tensors", "bytes", "written_bytes"}``.
        Only named jobs commit (``connect(job="name")``).

        >>> c = tierd.connect(job="run1"); c.put("w", w)     # doctest: +SKIP
        >>> c.commit("step-100")["written_bytes"]             # doctest: +SKIP
        4096
        """
        return self._run(_one(P.Commit(tag), lambda r: dict(r.info)))

    def commits(self):
        """Tags of this job's commits, oldest first; the last is what a restart restores."""
        return self._run(_one(P.Commits(), lambda r: list(r.tags)))

    def lease(self, keys: Iterable[str], write: bool = False):
        """Pin keys in the pool (swapping in from NVMe) and return views of them."""
        return self._run(_one(P.Lease(_keys(keys), write), self._leased))

    def release(self, keys: Iterable[str], written: bool = False):
        """Release leases; with ``written`` the write-leased bytes become the new version."""
        return self._run(_one(P.Release(_keys(keys), written), _nothing))

    def report_device(self, resident_bytes: int):
        """Tell the daemon how many bytes of this job's tensors this client keeps
        on its GPU between steps (``tierd status`` shows them per job)."""
        return self._run(_one(P.ReportDevice(int(resident_bytes)), _nothing))

    def expect(self, sizes: Iterable[int]):
        """Tell the daemon this job will store tensors of ``sizes`` bytes soon,
        so it makes their pool segments ahead ([Note: growth told ahead] in
        tierd.backends.hostpool); at most ``MAX_KEYS_PER_REQUEST`` are sent,
        the largest first."""
        sizes = sorted((int(n) for n in sizes), reverse=True)[:P.MAX_KEYS_PER_REQUEST]
        if sizes and sizes[-1] < 0:
            raise ValueError(f"expect: a tensor size of {sizes[-1]} B; sizes are >= 0")
        return self._run(_one(P.Expect(tuple(sizes)), _nothing))

    def abort(self, keys: Iterable[str]):
        """Give back reserved, unpublished keys."""
        return self._run(_one(P.Abort(_keys(keys)), _nothing))


def _nothing(reply: Any) -> None:
    return None


def _one_of(proc: Generator, key: str) -> Generator:
    return (yield from proc)[key]


def _bound(request_timeout: float | None) -> float:
    if request_timeout is None:
        return default_request_timeout()
    return check_request_timeout(request_timeout, "request_timeout", request_timeout)


def _overdue(control: ControlChannel, path: Path, waited: float) -> None:
    """A reply is ``waited`` seconds overdue: raise DaemonUnavailable naming
    what was lost, or log and return while the daemon and its sockets are there
    (the request is slow, not lost: a commit, an eviction)."""
    lost = control.lost()
    if lost is not None:
        raise DaemonUnavailable(
            f"no reply from the tierd daemon at {path} within {waited:.3g} s: {lost}; "
            f"restart the daemon and connect again")
    log.warning("no reply from the tierd daemon at %s for %.3g s; it answers and both its "
                "sockets are in place: still waiting", path, waited)


def _shut(sock, zctx, control) -> None:
    sock.close(linger=0)
    zctx.term()
    control.close()


class Pending:
    """A request on its way; :meth:`result` waits for and returns its reply."""

    def __init__(self, client: "Client", rid: int, convert) -> None:
        self._client, self._rid, self._convert = client, rid, convert
        self._finalizer = weakref.finalize(self, client._forget, rid)

    def result(self, timeout: float | None = None) -> Any:
        self._finalizer.detach()
        return self._convert(_check(self._client._wait(self._rid, timeout)))

    def done(self) -> bool:
        """Whether the reply is here (reads the replies waiting, never blocks)."""
        return self._client._arrived(self._rid)


@dataclass(eq=False)
class _Reserved:
    """A batch of :meth:`Client.put_batches` whose reserve is sent; ``views``,
    once its reply is here, gives its pool views with its segments mapped."""

    index: int
    keys: tuple[str, ...]
    sources: list[torch.Tensor]
    nbytes: int
    reply: Pending
    views: Future | None = None


def _confirm(sent: tuple[int, tuple[str, ...], Pending],
             published: Callable[[int], None] | None) -> None:
    index, _, pending = sent
    pending.result()
    if published is not None:
        published(index)


class Client(_StoreCalls):
    """Blocking client; safe to share between threads.

    >>> c = tierd.connect()                      # doctest: +SKIP
    >>> c.put("opt/0.m", torch.zeros(4))         # doctest: +SKIP
    >>> c.get("opt/0.m")                         # doctest: +SKIP
    tensor([0., 0., 0., 0.])
    """

    def __init__(self, socket_path: str | Path | None = None, job: str | None = None,
                 request_timeout: float | None = None) -> None:
        self.path = Path(socket_path) if socket_path else default_socket_path()
        #: seconds a reply may take before the daemon is checked ([Note: overdue replies])
        self.request_timeout = _bound(request_timeout)
        self.control = ControlChannel(self.path, job)
        self.control.reply_timeout = self.request_timeout
        self.job = self.control.job
        self._zctx = zmq.Context()
        self._sock = self._zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, self.control.token)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{self.path}")
        self._ids = itertools.count(1)
        self._lock = threading.Lock()   # one thread at a time on the socket
        self._replies: dict[int, Any] = {}
        self._discard: set[int] = set()
        self._closed = False
        self._lost: DaemonUnavailable | None = None   # set once: every later request fails
        # run by close(), or when a client never closed is collected (a model
        # dropped without detach): its socket goes before the context, whose
        # collection would otherwise wait for the socket forever
        self._shut = weakref.finalize(self, _shut, self._sock, self._zctx, self.control)

    # ------------------------------------------------------------ transport
    def _submit(self, req: P.Request, convert=lambda r: r) -> Pending:
        if self._closed:
            raise TierdError("this client is closed")
        if self._lost is not None:
            raise self._lost
        with self._lock:
            rid = next(self._ids)
            self._sock.send(P.encode_request(rid, req))
        return Pending(self, rid, convert)

    def _wait(self, rid: int, timeout: float | None) -> Any:
        # [Note: overdue replies]
        # A reply that does not come within
        # request_timeout is not waited for blindly: the client asks the daemon
        # over the control socket and checks the data socket, and raises
        # DaemonUnavailable if either is lost (a data socket removed while the
        # daemon runs takes every request sent to it, with no error). The clock
        # is read only on the poll's idle turns, so a request answered within
        # POLL_MS costs nothing more.
        deadline = None if timeout is None else time.monotonic() + timeout
        quiet_since = None
        while True:
            with self._lock:
                if rid in self._replies:
                    return self._replies.pop(rid)
                if self._sock.poll(POLL_MS):
                    self._drain()
                    continue
            if not self.control.alive():
                raise DaemonUnavailable(f"the tierd daemon at {self.path} went away")
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(f"no reply from tierd within {timeout} s")
            if quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= self.request_timeout:
                try:
                    _overdue(self.control, self.path, now - quiet_since)
                except DaemonUnavailable as exc:
                    self._lost = exc
                    self._forget(rid)
                    raise
                quiet_since = time.monotonic()

    def _drain(self) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            rid, reply = _decode(frame)
            if rid in self._discard:
                self._discard.discard(rid)
            else:
                self._replies[rid] = reply

    def _arrived(self, rid: int) -> bool:
        with self._lock:
            self._drain()
            return rid in self._replies

    def _forget(self, rid: int) -> None:
        # Runs from a finalizer: no locks, only GIL-atomic dict/set operations.
        self._discard.add(rid)
        if self._replies.pop(rid, None) is not None:
            self._discard.discard(rid)

    def _run(self, proc: Generator) -> Any:
        try:
            req = next(proc)
            while True:
                try:
                    reply = self._submit(req).result()
                except TierdError as exc:
                    req = proc.throw(exc)
                else:
                    req = proc.send(reply)
        except StopIteration as stop:
            return stop.value

    def check_alive(self) -> None:
        """Raise DaemonUnavailable if the daemon has gone; sends no request (one
        non-blocking poll of the control socket), so hot paths may call it."""
        if not self.control.alive():
            raise DaemonUnavailable(f"the tierd daemon at {self.path} went away")

    # ------------------------------------------------ requests left in flight
    def lease_async(self, keys: Iterable[str], write: bool = False) -> Pending:
        return self._submit(P.Lease(_keys(keys), write), self._leased)

    def demote_async(self, keys: Iterable[str]) -> Pending:
        """These keys are used again only after this job's others: the pool
        evicts them first ([Note: eviction by next use] in tierd.server.eviction).
        Nobody waits for its reply: the replies already here are read now, so
        a loop that sends nothing else cannot fill the socket's queue."""
        with self._lock:
            self._drain()
        return self._submit(P.Demote(_keys(keys)))

    def use_plan_async(self, name: str, positions: Iterable[Iterable[str]]) -> Pending:
        """Access plan ``name`` of this job: the keys it uses at each position
        of its step, in order ([Note: the job's access plan] in
        tierd.server.readahead); empty: forget it. Nobody waits for its reply
        (as :meth:`demote_async`)."""
        with self._lock:
            self._drain()
        return self._submit(P.UsePlan(name, tuple(_keys(keys) for keys in positions)))

    def use_at_async(self, name: str, at: int) -> Pending:
        """This job uses position ``at`` of plan ``name`` now (the daemon reads ahead)."""
        with self._lock:
            self._drain()
        return self._submit(P.UseAt(name, int(at)))

    def release_async(self, keys: Iterable[str], written: bool = False) -> Pending:
        """Release leases; with ``written`` the write-leased bytes become the new version."""
        return self._submit(P.Release(_keys(keys), written))

    def reserve_async(self, like: Mapping[str, torch.Tensor]) -> Pending:
        """Reserve a new version of each key, shaped like the given tensor;
        the result is :class:`Leased` views to write into. Readers keep seeing
        the old version (if any) until :meth:`publish_async` of the keys;
        :meth:`abort` gives the slots back. ``put`` is reserve, copy, publish."""
        return self._submit(P.Reserve(_specs(like)), self._leased)

    def publish_async(self, keys: Iterable[str]) -> Pending:
        """Make reserved keys the current versions (older ones are freed once
        nobody leases them)."""
        return self._submit(P.Publish(_keys(keys)))

    def put_batches(self, batches: Iterable[tuple[Mapping[str, torch.Tensor],
                                                  Mapping[str, torch.dtype] | None]],
                    published: Callable[[int], None] | None = None) -> None:
        """Store each ``(items, dtypes)`` batch as :meth:`put_many` would,
        reserving up to ``PUT_AHEAD`` bytes ahead of the copies ([Note:
        pipelined puts]); ``batches`` is read lazily, so a caller may make each batch
        only when it is asked for. ``published(i)`` is called once batch
        ``i`` (from 0) is the keys' current version, after which its sources
        are no longer read. On an error each batch is either reported (and
        stays stored) or given back, and the error is raised.

        >>> c.put_batches(((m, None) for m in modules), published=print)   # doctest: +SKIP
        """
        source = iter(enumerate(batches))
        most_ahead = min(PUT_AHEAD, int(self.stats()["pool_bytes"]) // 4)
        ahead: deque[_Reserved] = deque()     # reserve sent, not copied
        unconfirmed: deque[tuple[int, tuple[str, ...], Pending]] = deque()   # publish sent
        # maps segments only: every request and reply stays on this thread
        mapper = ThreadPoolExecutor(MAP_THREADS, thread_name_prefix="tierd-map")
        try:
            while True:
                # reserved beyond the batch copied next
                while len(ahead) < 2 or (
                        sum(r.nbytes for r in ahead) - ahead[0].nbytes < most_ahead
                        and len(ahead) + len(unconfirmed) < PUT_REQUESTS):
                    item = next(source, None)
                    if item is None:
                        break
                    ahead.append(self._reserve_ahead(*item))
                if not ahead:
                    break
                for r in ahead:   # replies here: their segments are mapped while we copy
                    if r.views is None and (r is ahead[0] or r.reply.done()):
                        r.views = mapper.submit(self._views, r.reply.result())
                copy_all(ahead[0].views.result(), ahead[0].sources)
                done = ahead.popleft()
                unconfirmed.append((done.index, done.keys, self.publish_async(done.keys)))
                while unconfirmed and (unconfirmed[0][2].done()
                                       or len(ahead) + len(unconfirmed) >= PUT_REQUESTS):
                    _confirm(unconfirmed.popleft(), published)
            while unconfirmed:
                _confirm(unconfirmed.popleft(), published)
        except BaseException:
            mapper.shutdown(wait=True)   # no mapping goes on while slots are given back
            self._settle(ahead, unconfirmed, published)
            raise
        finally:
            mapper.shutdown(wait=True)

    def _reserve_ahead(self, index: int, batch: tuple[Mapping[str, torch.Tensor],
                                                      Mapping[str, torch.dtype] | None]
                       ) -> "_Reserved":
        items, dtypes = batch
        check_dense(items)
        specs = _specs(items, dtypes)
        return _Reserved(index, tuple(items), [t.detach() for t in items.values()],
                         sum(s.nbytes for s in specs), self._submit(P.Reserve(specs)))

    def _settle(self, ahead: deque["_Reserved"],
                unconfirmed: deque[tuple[int, tuple[str, ...], Pending]],
                published: Callable[[int], None] | None) -> None:
        """After an error in :meth:`put_batches`, leave every batch sent either
        reported or given back: a publish sent is waited for and, if it
        worked, reported; every batch reserved and not copied is aborted (the
        daemon answers in order, so a reserve still on its way is given back
        too; a failed one has nothing to give back)."""
        for index, keys, pending in unconfirmed:
            try:
                pending.result()
            except TierdError:
                with contextlib.suppress(TierdError):
                    self.abort(keys)
            else:
                if published is not None:
                    published(index)
        for reserved in ahead:
            with contextlib.suppress(TierdError):
                self.abort(reserved.keys)

    def expect(self, sizes: Iterable[int]) -> None:
        """As :meth:`_StoreCalls.expect`; then this client claims the segments
        the daemon makes for them and maps them now, ahead of the leases that
        fill them ([Note: segments mapped ahead] in tierd.backends.hostpool)."""
        super().expect(sizes)
        self.control.map_ahead()

    def segment_views(self) -> dict[int, torch.Tensor]:
        return dict(self.control.views)

    def on_segment_mapped(self, callback, unmapped=None) -> None:
        self.control.on_segment_mapped(callback, unmapped)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Disconnect; the daemon releases this client's leases."""
        self._closed = True
        self._shut()   # once

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_StoreCalls):
    """The asyncio flavour: the same calls (those of :class:`_StoreCalls`), awaitable.

    >>> c = await tierd.aconnect()               # doctest: +SKIP
    >>> await c.put("kv/0", torch.ones(2))       # doctest: +SKIP
    """

    def __init__(self, control: ControlChannel, request_timeout: float | None = None) -> None:
        self.control = control
        self.path = control.path
        #: seconds a reply may take before the daemon is checked ([Note: overdue replies])
        self.request_timeout = _bound(request_timeout)
        control.reply_timeout = self.request_timeout
        self.job = control.job
        self._zctx = zmq.asyncio.Context()
        self._sock = self._zctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, control.token)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{self.path}")
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future] = {}
        self._lost: DaemonUnavailable | None = None   # set once: every later request fails
        self._loop = asyncio.get_running_loop()
        self._reader = self._loop.create_task(self._read_replies())
        self._reader.add_done_callback(self._reader_done)
        self._loop.add_reader(control.ctl.fileno(), self._check_daemon)

    @classmethod
    async def connect(cls, socket_path: str | Path | None = None, job: str | None = None,
                      request_timeout: float | None = None) -> "AsyncClient":
        path = Path(socket_path) if socket_path else default_socket_path()
        bound = _bound(request_timeout)   # a bad value fails before connecting
        return cls(await asyncio.to_thread(ControlChannel, path, job), bound)

    async def _read_replies(self) -> None:
        while True:
            rid, reply = _decode(await self._sock.recv())
            fut = self._futures.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def _reader_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._fail_all(DaemonUnavailable(f"reading replies failed: {task.exception()!r}"))

    def _check_daemon(self) -> None:
        if not self.control.alive():
            self._loop.remove_reader(self.control.ctl.fileno())
            self._fail_all(DaemonUnavailable(f"the tierd daemon at {self.path} went away"))

    def _fail_all(self, exc: Exception) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(exc)
        self._futures.clear()

    async def _call(self, req: P.Request) -> Any:
        if self.control.dead:
            raise DaemonUnavailable(f"the tierd daemon at {self.path} went away")
        if self._lost is not None:
            raise self._lost
        rid = next(self._ids)
        fut = self._futures[rid] = self._loop.create_future()
        await self._sock.send(P.encode_request(rid, req))
        waited = 0.0
        while True:   # [Note: overdue replies]
            done, _ = await asyncio.wait((fut,), timeout=self.request_timeout)
            if done:
                return _check(fut.result())
            waited += self.request_timeout
            try:
                await asyncio.to_thread(_overdue, self.control, self.path, waited)
            except DaemonUnavailable as exc:
                self._lost = exc
                self._futures.pop(rid, None)
                fut.cancel()
                self._fail_all(exc)
                raise

    async def _run(self, proc: Generator) -> Any:
        try:
            req = next(proc)
            while True:
                try:
                    reply = await self._call(req)
                except TierdError as exc:
                    req = proc.throw(exc)
                else:
                    req = proc.send(reply)
        except StopIteration as stop:
            return stop.value

    async def close(self) -> None:
        self._reader.cancel()
        try:
            self._loop.remove_reader(self.control.ctl.fileno())
        except (ValueError, OSError):
            pass
        self._sock.close(linger=0)
        self._zctx.term()
        self.control.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def connect(socket_path: str | Path | None = None, job: str | None = None,
            request_timeout: float | None = None) -> Client:
    """Connect to the node's daemon (``$TIERD_SOCKET`` or the default path).

    ``request_timeout``: seconds a reply may take before the client checks
    the daemon and raises DaemonUnavailable if it or its data socket was lost
    (default ``$TIERD_REQUEST_TIMEOUT``, else 60; see
    :func:`tierd.config.default_request_timeout`).

    >>> c = tierd.connect()        # doctest: +SKIP
    """
    return Client(socket_path, job, request_timeout)


async def aconnect(socket_path: str | Path | None = None, job: str | None = None,
                   request_timeout: float | None = None) -> AsyncClient:
    """The asyncio :func:`connect`."""
    return await AsyncClient.connect(socket_path, job, request_timeout)
