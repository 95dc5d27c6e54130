"""The session's leases on its own keys: counted, shared, and held when they fit.

[Note: one lease per key per session]
Parameter movement, gradient buckets and the optimizer all touch the same
keys (with fp32 compute the parameter key *is* the master weight). The
daemon grants a write lease only to a key nobody else pins, so two parts of
one session leasing the same key on their own would refuse each other. The
:class:`LeaseTable` takes one daemon lease per key (always ``write=True``:
the keys are private to this attach) and counts references; the daemon lease
is released when the last reference goes, as written if any holder wrote.

[Note: held leases]
When the keys fit comfortably in the pool, the session *holds* them: one
reference each that is kept across steps, so acquiring and releasing in the
hot path are dictionary updates and no request reaches the daemon (a
round trip per key per use would cost more than the copy). A held key cannot be evicted to NVMe, which
is why only a fraction of the pool is ever held; bytes written while held are
reported as written when the hold ends (:meth:`LeaseTable.unhold_all`).

Under torch.distributed some keys are *shared* by the ranks of a node
([Note: shared and private keys] in ``tierd.client.distributed``): those are
leased read-only, never reported as written, and changed only by publishing
a new version (:meth:`LeaseTable.publish_async`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from tierd.errors import CapacityError
from tierd.client.keys import key_kind


class LeaseBatch:
    """One ``lease_async`` request whose reply is read once, when first needed.

    Example:
        >>> from tierd.client.store import LocalStore
        >>> s = LocalStore(); s.put_many({"a": torch.ones(1)})
        >>> LeaseBatch(s.lease_async(["a"])).views()["a"].tolist()
        [1.0]
    """

    def __init__(self, pending) -> None:
        self._pending = pending
        self._views: dict[str, torch.Tensor] | None = None
        self._error: Exception | None = None
        self.failed = False
        self.why = ""   # the daemon's words when it had no room

    def views(self) -> dict[str, torch.Tensor] | None:
        """The leased views, or None if the daemon had no room. Any other
        error of the request is raised again at every call (a reply is read
        only once: reading it again would wait for ever)."""
        if self._error is not None:
            raise self._error
        if self._views is None and not self.failed:
            try:
                self._views = {lease.key: lease.tensor for lease in self._pending.result()}
            except CapacityError as exc:
                self.failed = True
                self.why = str(exc)
            except Exception as exc:
                self._error = exc
                raise
        return self._views


class LeaseTable:
    """Reference-counted write leases of one session (see the Notes above).

    Example:
        >>> table = LeaseTable(client, stats)           # doctest: +SKIP
        >>> table.acquire(["k"]); v = table.view("k")    # doctest: +SKIP
        >>> table.release(["k"], written=True)           # doctest: +SKIP
    """

    def __init__(self, client, stats) -> None:
        self._client = client
        self._stats = stats
        self._refs: dict[str, int] = {}
        self._batch: dict[str, LeaseBatch] = {}
        self._written: set[str] = set()
        self._held: set[str] = set()
        #: keys other ranks read too: leased read-only (see the module docstring)
        self.shared: set[str] = set()
        self._publishing: list = []   # publish requests whose reply is not read yet
        self._republish: set[str] = set()   # shared keys whose hold a publish ended

    def acquire(self, keys: Iterable[str]) -> None:
        """One more reference on each (deduplicated) key; keys not leased yet
        are asked for in one request whose reply is read on first :meth:`view`."""
        keys = list(dict.fromkeys(keys))
        new = [k for k in keys if k not in self._refs or self._batch[k].failed]
        for k in keys:
            self._refs[k] = self._refs.get(k, 0) + 1
        for write in (True, False):
            ks = [k for k in new if (k not in self.shared) == write]
            if ks:
                batch = LeaseBatch(self._client.lease_async(ks, write=write))
                self._stats.requests += 1
                for k in ks:
                    self._batch[k] = batch

    def view(self, key: str) -> torch.Tensor | None:
        """The pool view of an acquired key, or None if the daemon had no room."""
        batch = self._batch[key]
        if batch._views is not None:   # the reply was read
            return batch._views[key]
        t0 = time.perf_counter()
        views = batch.views()   # waits for the reply
        waited = time.perf_counter() - t0
        self._stats.wait_seconds += waited
        self._stats.lease_wait_seconds += waited
        kind = key_kind(key)   # the wait is the request's: named for the key that met it
        if kind is not None:
            name = f"lease_wait_{kind}_s"
            setattr(self._stats, name, getattr(self._stats, name) + waited)
        return None if views is None else views[key]

    def views(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Views of acquired keys; raises CapacityError if the pool had no room."""
        out = {}
        for k in keys:
            v = self.view(k)
            if v is None:
                raise CapacityError(f"the pool has no room to lease {k!r} "
                                    f"({self._batch[k].why}); give the daemon a larger "
                                    "pool or lower the attach budgets")
            out[k] = v
        return out

    def is_held(self, key: str) -> bool:
        return key in self._held

    def demote(self, keys: Iterable[str]) -> None:
        """Ask the daemon to evict these keys first ([Note: eviction by next use]
        in tierd.server.eviction); held keys are never evicted, and a shared
        key's next version is published later, as a new entry: not asked."""
        keys = [k for k in keys if k not in self._held and k not in self.shared]
        if keys:
            self._client.demote_async(keys)
            self._stats.requests += 1

    def release(self, keys: Iterable[str], *, written: bool = False) -> None:
        """Drop one reference per (deduplicated) key; the last one releases the
        daemon lease, in one request per ``written`` flag."""
        out: dict[bool, list[str]] = {False: [], True: []}
        for k in dict.fromkeys(keys):
            if written and k not in self.shared:
                self._written.add(k)
            left = self._refs[k] - 1
            if left > 0:
                self._refs[k] = left
                continue
            del self._refs[k]
            batch = self._batch.pop(k)
            was_written = k in self._written
            self._written.discard(k)
            if batch.views() is not None:   # waits for the grant, never releases early
                out[was_written].append(k)
        for w, ks in out.items():
            if ks:
                self._client.release_async(ks, written=w)
                self._stats.requests += 1

    def release_async(self, keys: Iterable[str], written: bool = False) -> None:
        """:class:`tierd.client.releases.PendingReleases` calls this name."""
        self.release(keys, written=written)

    def publish_async(self, keys: Iterable[str]) -> None:
        """Publish reserved new versions of shared keys, and end this
        session's hold on their old versions (which the daemon then frees
        once no rank leases them); :meth:`confirm_publishes` reads the replies."""
        keys = list(keys)
        self._publishing.append(self._client.publish_async(keys))
        self._stats.requests += 1
        old = [k for k in keys if k in self._held]
        self._held.difference_update(old)
        self._republish.update(old)
        if old:
            self.release(old)

    def confirm_publishes(self) -> None:
        """Wait until the daemon has taken every publish sent (raises its error)."""
        pending, self._publishing = self._publishing, []
        t0 = time.perf_counter()
        for p in pending:
            p.result()
        self._stats.wait_seconds += time.perf_counter() - t0

    def renew_shared(self) -> bool:
        """Hold every shared key this session held on its current version:
        holds on older versions are dropped first (one release, one lease)."""
        keys = sorted((self._held & self.shared) | self._republish)
        self._republish.clear()
        stale = [k for k in keys if k in self._held]
        self._held.difference_update(stale)
        if stale:
            self.release(stale)
        return self.hold(keys)

    def hold(self, keys: Iterable[str]) -> bool:
        """Take a lasting reference on each key; False (and nothing held) if the
        pool had no room for them."""
        keys = [k for k in dict.fromkeys(keys) if k not in self._held]
        if not keys:
            return True
        self.acquire(keys)
        if any(self.view(k) is None for k in keys):
            self.release(keys)
            return False
        self._held.update(keys)
        return True

    def unhold(self, keys: Iterable[str]) -> list[str]:
        """End the holds on those of ``keys`` that are held; returns them."""
        held = [k for k in dict.fromkeys(keys) if k in self._held]
        self._held.difference_update(held)
        if held:
            self.release(held)
        return held

    def unhold_all(self) -> None:
        """End every hold (e.g. before detach deletes the keys)."""
        self.end_holds()

    def end_holds(self) -> list[str]:
        """End every hold, reporting written bytes (a commit refuses write
        leases); returns the keys, to :meth:`hold` again after."""
        held, self._held = list(self._held), set()
        if held:
            self.release(held)
        return held
