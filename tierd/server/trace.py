"""A timeline of the daemon's work: one JSON line per request served and per
NVMe record moved, when ``tierd serve --trace FILE`` (or ``TIERD_TRACE``) asks.

[Note: the daemon's timeline]
Counters say how much a step read and how long the disk was busy, not when:
a disk idle 6 s of a 31 s step (the 70B LoRA at 24 GB on the H200, at
75c2e4d) could be idle while a lease waits in the daemon (for room, or for
the loop), or while no request is pending at all (the client is late to
ask). The timeline tells them apart. Each line is an object with ``t``
(``time.monotonic()`` seconds, the loop's clock) and ``ev``:

- ``"req"``: a request served, with ``op`` (its type), ``sid``, ``n`` (its
  keys), ``key`` (the first), ``at`` (a ``UseAt``'s position), ``s`` (seconds
  from its arrival to its reply: longer than the catalog's time only when it
  was blocked) and ``blocked`` (it waited for transfers);
- ``"io"``: a record moved, with ``dir`` (``read`` / ``write``), ``key``,
  ``bytes`` and ``s`` (from its start, ``t - s``, to its end, ``t``).

``python -m tierd.bench.trace_report FILE`` reads it back. Writing a line
costs the loop a few microseconds; lines are buffered and flushed when the
daemon stops, so a killed daemon may lose the last ones.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


class Trace:
    """Appends the daemon's events to a file (see [Note: the daemon's timeline]).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "trace.jsonl"
    >>> trace = Trace(path)
    >>> trace.io("read", "w", 4096, since=trace.clock() - 0.5)
    >>> trace.close()
    >>> line = json.loads(path.read_text()); line["ev"], line["dir"], line["s"] >= 0.5
    ('io', 'read', True)
    """

    clock = staticmethod(time.monotonic)

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", buffering=1 << 20)

    def _write(self, **event) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def request(self, op: str, sid: int, keys: tuple[str, ...], since: float,
                blocked: bool, at: int | None = None) -> None:
        now = self.clock()
        self._write(t=round(now, 6), ev="req", op=op, sid=sid, n=len(keys),
                    key=keys[0] if keys else None, at=at, s=round(now - since, 6),
                    blocked=blocked)

    def io(self, direction: str, key: str, nbytes: int, since: float) -> None:
        now = self.clock()
        self._write(t=round(now, 6), ev="io", dir=direction, key=key, bytes=nbytes,
                    s=round(now - since, 6))

    def close(self) -> None:
        self._file.close()
