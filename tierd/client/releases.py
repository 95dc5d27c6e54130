"""Pool leases that may be released only once a copy that touches them is done.

[Note: release after the event]
A leased pool slot may be overwritten or evicted by the daemon as soon as the
lease is released. A copy queued on the copy stream still reads (H2D) or
writes (D2H) the slot until its event completes, so the release waits for the
event. Releases are batched: one request per drain, never one per tensor.
A new version of a shared key (``publish``) waits for its copy the same way.
"""

from __future__ import annotations

import enum

from tierd.client.copy_stream import InflightCopy


class ReleaseKind(enum.Enum):
    """What happens to a copy's keys once it has landed.

    READ: release the leases (the copy read the pool).
    WRITTEN: release the leases as written (the copy wrote new bytes into them).
    PUBLISH: publish the reserved new versions the copy filled.
    """

    READ = "read"
    WRITTEN = "written"
    PUBLISH = "publish"


class PendingReleases:
    """Copies whose pool leases are still held, grouped by ``written``.

    Example:
        >>> import torch
        >>> from tierd.client.copy_stream import InflightCopy
        >>> class Client:
        ...     def release_async(self, keys, written=False): print(sorted(keys), written)
        >>> r = PendingReleases(Client())
        >>> r.add(InflightCopy(torch.ones(1), torch.ones(1), ("a",), None), written=False)
        >>> r.drain()
        ['a'] False
    """

    def __init__(self, client) -> None:
        self._client = client
        self._copies: list[tuple[InflightCopy, ReleaseKind]] = []

    def __len__(self) -> int:
        return len(self._copies)

    def add(self, copy: InflightCopy, *, written: bool) -> None:
        """Release ``copy.keys`` (as written or not) once the copy has landed."""
        self._copies.append((copy, ReleaseKind.WRITTEN if written else ReleaseKind.READ))

    def add_publish(self, copy: InflightCopy) -> None:
        """Publish the reserved ``copy.keys`` once the copy into them has landed."""
        self._copies.append((copy, ReleaseKind.PUBLISH))

    def drain(self, *, block: bool = False) -> None:
        """Release (or publish) the keys of every finished copy (of all if ``block``)."""
        done: dict[ReleaseKind, list[str]] = {kind: [] for kind in ReleaseKind}
        n = 0
        for copy, kind in self._copies:
            if block:
                copy.synchronize()
            elif not copy.done():
                break   # copies finish about in order: stop at the first pending one
            done[kind].extend(copy.keys)
            n += 1
        del self._copies[:n]
        if done[ReleaseKind.PUBLISH]:
            self._client.publish_async(done[ReleaseKind.PUBLISH])
        for kind in (ReleaseKind.READ, ReleaseKind.WRITTEN):
            if done[kind]:
                self._client.release_async(done[kind], written=kind is ReleaseKind.WRITTEN)
