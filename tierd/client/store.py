"""The store the client's parts talk to: one typed protocol, two implementations.

:class:`Store` is every call an attached model, ``tierd.optim`` and activation
tiering make: the socket client (:class:`tierd.client.connection.Client`,
talking to a daemon) implements it, and so does :class:`LocalStore`, which
keeps tensors in this process with the same lease rules, so each client part
can be unit-tested alone (no daemon, no sockets) and a failing test names the
part that broke.

The rules both follow (the daemon's catalog is the reference):
- ``lease`` pins keys and returns views to read (or, ``write=True``, to write
  in place); a key leased for writing has no other lease, and a key leased
  for reading takes no write lease. ``release(written=True)`` makes written
  bytes the new version.
- ``reserve`` gives a new slot per key that readers do not see until
  ``publish``; ``abort`` gives it back. ``put`` is reserve, copy, publish.
- Requests ending in ``_async`` return a :class:`Pending`; its ``result()``
  returns the reply or raises the request's error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tierd.client.keys import random_name
from tierd.errors import CapacityError, DaemonUnavailable, StateError, TierdError, UnknownKey

if TYPE_CHECKING:   # the socket client imports Leased from here; `tierd status` needs no torch
    import torch


@dataclass(frozen=True)
class Leased:
    """A key pinned in the pool. ``tensor`` is a view of the pool: read it (or,
    for a write lease, write it) with no further request. Valid until the key
    is released."""

    key: str
    tensor: torch.Tensor
    version: int


class Pending(Protocol):
    """A request on its way."""

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the reply; return it or raise the request's error."""


@runtime_checkable
class Store(Protocol):
    """What the client's parts need from a store (see the module docstring)."""

    job: str

    def put_many(self, items: Mapping[str, torch.Tensor],
                 dtypes: Mapping[str, torch.dtype] | None = None) -> None: ...
    def put_batches(self, batches: Iterable[tuple[Mapping[str, torch.Tensor],
                                                  Mapping[str, torch.dtype] | None]],
                    published: Callable[[int], None] | None = None) -> None: ...
    def put_zeros(self, like: Mapping[str, torch.Tensor]) -> None: ...
    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]: ...
    def get(self, key: str) -> torch.Tensor: ...
    def lease_async(self, keys: Iterable[str], write: bool = False) -> Pending: ...
    def release_async(self, keys: Iterable[str], written: bool = False) -> Pending: ...
    def release(self, keys: Iterable[str], written: bool = False) -> None: ...
    def reserve_async(self, like: Mapping[str, torch.Tensor]) -> Pending: ...
    def publish_async(self, keys: Iterable[str]) -> Pending: ...
    def abort(self, keys: Iterable[str]) -> None: ...
    def delete(self, keys: str | Iterable[str]) -> None: ...
    def keys(self, prefix: str = "") -> list[str]: ...
    def stats(self) -> dict: ...
    def commit(self, tag: str) -> dict: ...
    def commits(self) -> list[str]: ...
    def report_device(self, resident_bytes: int) -> None: ...
    def expect(self, sizes: Iterable[int]) -> None: ...
    def demote_async(self, keys: Iterable[str]) -> Pending: ...
    def use_plan_async(self, name: str, positions: Iterable[Iterable[str]]) -> Pending: ...
    def use_at_async(self, name: str, at: int) -> Pending: ...
    def check_alive(self) -> None: ...
    def on_segment_mapped(self, callback: Callable[[int, torch.Tensor], None],
                          unmapped: Callable[[int, torch.Tensor], None] | None = None) -> None: ...
    def close(self) -> None: ...


class Done:
    """A :class:`Pending` whose reply (or error) is already known."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    @classmethod
    def of(cls, call: Callable[[], Any]) -> "Done":
        """Run ``call`` now; its value or tierd error becomes the reply."""
        try:
            return cls(call())
        except TierdError as exc:
            return cls(error=exc)


@dataclass
class _Entry:
    value: torch.Tensor        # the current version's bytes
    version: int = 1
    readers: int = 0
    writer: bool = False
    reserved: torch.Tensor | None = None


class _Table:
    """The lease rules over a LocalStore's entries (the daemon catalog's, in small)."""

    def __init__(self, job: str, pool_bytes: int) -> None:
        self.job = job
        self.pool_bytes = pool_bytes
        self.entries: dict[str, _Entry] = {}

    def entry(self, key: str) -> _Entry:
        e = self.entries.get(key)
        if e is None or not e.version:
            raise UnknownKey(f"no tensor under key {key!r} in job {self.job!r}")
        return e

    @property
    def used_bytes(self) -> int:
        return sum(_nbytes(e.value) + (_nbytes(e.reserved) if e.reserved is not None else 0)
                   for e in self.entries.values())

    def lease(self, keys: tuple[str, ...], write: bool) -> list[Leased]:
        if write and len(set(keys)) != len(keys):
            raise StateError("a key appears twice in one write lease")
        entries = [self.entry(k) for k in keys]
        for e, k in zip(entries, keys):
            if e.writer or (write and e.readers):
                raise StateError(f"{k}: leased for {'writing' if e.writer else 'reading'} "
                                 "by another client; release it first")
        for e in entries:
            if write:
                e.writer = True
            else:
                e.readers += 1
        return [Leased(k, e.value, e.version) for k, e in zip(keys, entries)]

    def release(self, keys: tuple[str, ...], written: bool) -> None:
        entries = {k: self.entries.get(k) for k in keys}
        not_held = [k for k, e in entries.items() if e is None or not (e.writer or e.readers)]
        if not_held:
            raise StateError(f"release of keys this client does not lease: {not_held[:5]}")
        if written and any(not e.writer for e in entries.values()):
            raise StateError("released as written, but these leases are read-only: "
                             f"{[k for k, e in entries.items() if not e.writer][:5]}")
        for e in entries.values():
            if e.writer:
                e.writer = False
                e.version += written
            else:
                e.readers -= 1

    def reserve(self, like: dict[str, torch.Tensor]) -> list[Leased]:
        check_dense(like, values=False)
        need = sum(_nbytes(t) for t in like.values())
        if self.used_bytes + need > self.pool_bytes:
            raise CapacityError(f"the local store holds {self.used_bytes} of "
                                f"{self.pool_bytes} bytes; {need} more do not fit")
        import torch
        out = []
        for k, t in like.items():
            e = self.entries.get(k)
            if e is not None and e.reserved is not None:
                raise StateError(f"{k}: already reserved by this client; publish or abort it")
            slot = torch.empty(t.shape, dtype=t.dtype)
            if e is None:   # a key first seen here exists once published
                e = self.entries[k] = _Entry(value=torch.empty(0, dtype=t.dtype), version=0)
            e.reserved = slot
            out.append(Leased(k, slot, e.version + 1))
        return out

    def publish(self, keys: tuple[str, ...]) -> None:
        missing = [k for k in keys if k not in self.entries or self.entries[k].reserved is None]
        if missing:
            raise StateError(f"publish of keys this client has not reserved: {missing[:5]}")
        for k in keys:
            e = self.entries[k]
            e.value, e.reserved, e.version = e.reserved, None, e.version + 1

    def delete(self, keys: tuple[str, ...]) -> None:
        entries = [self.entry(k) for k in keys]   # all of them, or none deleted
        for k, e in zip(keys, entries):
            if e.writer:
                raise StateError(f"{k}: cannot delete while write-leased")
        for k in keys:
            self.entries.pop(k, None)

    def abort(self, keys: Iterable[str]) -> None:
        for k in keys:
            e = self.entries.get(k)
            if e is not None and e.reserved is not None:
                e.reserved = None
                if e.version == 0:
                    del self.entries[k]


@dataclass
class LocalStore:
    """An in-process :class:`Store`: tensors in this process's memory, the
    daemon's lease rules, a byte capacity. For unit tests of client parts.

    ``restart()`` drops everything but the last commit, as a daemon restart
    does for a named job.

    Example:
        >>> import torch
        >>> s = LocalStore(job="run1")
        >>> s.put_many({"a": torch.ones(2)})
        >>> [l.tensor.tolist() for l in s.lease_async(["a"]).result()]
        [[1.0, 1.0]]
        >>> s.release(["a"]); s.get("a").tolist()
        [1.0, 1.0]
    """

    job: str | None = None
    pool_bytes: int = 1 << 30
    requests: int = 0   # calls made, as the daemon would count requests
    gpu_resident_bytes: int = 0   # as reported (report_device)
    demoted: list = field(default_factory=list)   # keys demoted, in order (demote_async)
    plans: list = field(default_factory=list)     # access plans sent (use_plan_async)
    uses: list = field(default_factory=list)      # positions told (use_at_async)

    def __post_init__(self) -> None:
        self.ephemeral = self.job is None
        if self.job is None:
            self.job = f"local-{random_name()}"
        self._table = _Table(self.job, self.pool_bytes)
        self._commits: list[tuple[str, dict[str, torch.Tensor]]] = []
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._table.used_bytes

    def _call(self, fn: Callable, *args: Any) -> Done:
        """One request: counted, refused once closed, its error kept for ``result()``."""
        self.requests += 1
        if self._closed:
            return Done(error=DaemonUnavailable("this local store is closed"))
        return Done.of(lambda: fn(*args))

    def lease_async(self, keys: Iterable[str], write: bool = False) -> Done:
        return self._call(self._table.lease, tuple(keys), write)

    def release_async(self, keys: Iterable[str], written: bool = False) -> Done:
        return self._call(self._table.release, tuple(keys), written)

    def release(self, keys: Iterable[str], written: bool = False) -> None:
        self.release_async(keys, written).result()

    def reserve_async(self, like: Mapping[str, torch.Tensor]) -> Done:
        return self._call(self._table.reserve, dict(like))

    def publish_async(self, keys: Iterable[str]) -> Done:
        return self._call(self._table.publish, tuple(keys))

    def abort(self, keys: Iterable[str]) -> None:
        self._call(self._table.abort, tuple(keys)).result()

    # ------------------------------------------------------------ store API
    def put_many(self, items: Mapping[str, torch.Tensor],
                 dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        import torch
        check_dense(items)
        dtypes = dtypes or {}
        like = {k: torch.empty(t.shape, dtype=dtypes[k], device="meta") if k in dtypes else t
                for k, t in items.items()}
        placed = self.reserve_async(like).result()
        for lease, t in zip(placed, items.values()):
            lease.tensor.copy_(t.detach())
        self.publish_async(items.keys()).result()

    def put_batches(self, batches: Iterable[tuple[Mapping[str, torch.Tensor],
                                                  Mapping[str, torch.dtype] | None]],
                    published: Callable[[int], None] | None = None) -> None:
        """``put_many`` of each batch in turn, ``published(i)`` after each: the
        socket client's contract (:meth:`tierd.client.connection.Client.put_batches`)
        with nothing to overlap."""
        for i, (items, dtypes) in enumerate(batches):
            self.put_many(items, dtypes=dtypes)
            if published is not None:
                published(i)

    def put(self, key: str, tensor: torch.Tensor) -> None:
        self.put_many({key: tensor})

    def put_zeros(self, like: Mapping[str, torch.Tensor]) -> None:
        import torch
        check_dense(like, values=False)
        self.put_many({k: torch.zeros(t.shape, dtype=t.dtype) for k, t in like.items()})

    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = tuple(keys)
        leased = self.lease_async(keys).result()
        out = {lease.key: lease.tensor.clone() for lease in leased}
        self.release(keys)
        return out

    def get(self, key: str) -> torch.Tensor:
        return self.get_many((key,))[key]

    def delete(self, keys: str | Iterable[str]) -> None:
        self._call(self._table.delete, (keys,) if isinstance(keys, str) else tuple(keys)).result()

    def keys(self, prefix: str = "") -> list[str]:
        entries = self._table.entries
        return self._call(lambda: sorted(k for k, e in entries.items()
                                         if k.startswith(prefix) and e.version)).result()

    def stats(self) -> dict:
        return self._call(lambda: {
            "pool_bytes": self.pool_bytes, "pool_used": self.used_bytes,
            "tensors": len(self._table.entries),
            "jobs": {self.job: {"ephemeral": self.ephemeral,
                                "gpu_resident_bytes": self.gpu_resident_bytes}}}).result()

    def commit(self, tag: str) -> dict:
        def take() -> dict:
            if self.ephemeral:
                raise StateError(f"job {self.job!r} is a default job, which is never committed")
            entries = self._table.entries
            leased = [k for k, e in entries.items() if e.writer]
            if leased:
                raise StateError(f"cannot commit while keys are write-leased: {leased[:5]}")
            snapshot = {k: e.value.clone() for k, e in entries.items() if e.version}
            self._commits.append((tag, snapshot))
            return {"tag": tag, "seq": len(self._commits), "tensors": len(snapshot),
                    "bytes": sum(_nbytes(t) for t in snapshot.values())}
        return self._call(take).result()

    def commits(self) -> list[str]:
        return self._call(lambda: [tag for tag, _ in self._commits]).result()

    def report_device(self, resident_bytes: int) -> None:
        self._call(lambda: setattr(self, "gpu_resident_bytes", int(resident_bytes))).result()

    def expect(self, sizes: Iterable[int]) -> None:
        """Nothing to make ahead: this store allocates each tensor as it comes."""

    def demote_async(self, keys: Iterable[str]) -> Done:
        """Nothing is evicted here (no tiers): the keys are checked and kept,
        in order, in ``demoted`` for tests of who demotes what."""
        keys = tuple(keys)
        return self._call(lambda: self.demoted.extend(e and k for k, e in
                                                      [(k, self._table.entry(k)) for k in keys]))

    def use_plan_async(self, name: str, positions: Iterable[Iterable[str]]) -> Done:
        """Nothing to read ahead here (no tiers): ``(name, plan)`` is kept, in
        ``plans``, for tests of what a client plans."""
        plan = [tuple(keys) for keys in positions]
        return self._call(lambda: self.plans.append((name, plan)))

    def use_at_async(self, name: str, at: int) -> Done:
        """Kept in ``uses`` for tests (nothing to read ahead here)."""
        return self._call(lambda: self.uses.append(int(at)))

    def restart(self) -> None:
        """What a daemon restart leaves: the last commit, no leases, no reservations."""
        last = self._commits[-1][1] if self._commits else {}
        self._table.entries = {k: _Entry(value=v.clone()) for k, v in last.items()}

    def check_alive(self) -> None:
        if self._closed:
            raise DaemonUnavailable("this local store is closed")

    def on_segment_mapped(self, callback, unmapped=None) -> None:
        """No shared segments here: tensors are ordinary process memory."""

    def close(self) -> None:
        self._closed = True


def check_dense(items: Mapping[str, torch.Tensor], values: bool = True) -> None:
    """Refuse what a store cannot hold, before anything is reserved: a store
    keeps a key's bytes as one dense (strided) buffer, so a sparse, nested or
    otherwise laid-out tensor has no such bytes; with ``values`` (put, not
    put_zeros or reserve, which read only shape and dtype) a meta tensor,
    which has no data, is refused too. TierdError naming the key and the fix.

    >>> import torch
    >>> check_dense({"w": torch.ones(2, 2).to_sparse()})
    Traceback (most recent call last):
    ...
    tierd.errors.TierdError: 'w': a sparse_coo tensor cannot be stored: dense tensors only; store t.to_dense() (or its indices and values as two tensors)
    """
    import torch
    for key, t in items.items():
        if t.is_nested:
            raise TierdError(f"{key!r}: a nested tensor cannot be stored: dense tensors only; "
                             f"store each of t.unbind() under its own key")
        if t.layout is not torch.strided:
            layout = str(t.layout).removeprefix("torch.")
            raise TierdError(f"{key!r}: a {layout} tensor cannot be stored: dense tensors only; "
                             f"store t.to_dense() (or its indices and values as two tensors)")
        if values and t.is_meta:
            raise TierdError(f"{key!r}: a meta tensor has no values to store: dense tensors "
                             f"only; give a tensor with data, or put_zeros() for its shape")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
