"""Where the daemon's time went, from its timeline ([Note: the daemon's
timeline] in ``tierd.server.trace``).

    TIERD_TRACE=/tmp/trace.jsonl python -m tierd.bench.lora70b --out DIR --case lora-24g
    python -m tierd.bench.trace_report /tmp/trace.jsonl --since 120

Over the traced span (from ``--since`` seconds after its first event) it
splits the wall time by what was in flight: a read, only a write, or no
record at all, and each of those by whether a lease was pending in the
daemon (asked, not yet answered). A disk idle while a lease is pending
waits on the daemon (room, its loop); a disk idle with nothing pending
waits on the client. It also sums the seconds requests answered at once
took from arrival to reply (the loop's time on them), by type.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    """The timeline's events, in file order (a torn last line is skipped);
    a ``.gz`` file is read compressed."""
    events = []
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def split(events: list[dict], since: float = 0.0) -> dict:
    """Seconds of the span by (record in flight, lease pending), the bytes
    each way and the loop's seconds on requests answered at once.

    >>> ev = [{"t": 1.0, "ev": "io", "dir": "read", "key": "a", "bytes": 8, "s": 1.0},
    ...       {"t": 3.0, "ev": "req", "op": "Lease", "s": 1.5, "blocked": True},
    ...       {"t": 4.0, "ev": "req", "op": "UseAt", "s": 0.25, "blocked": False}]
    >>> r = split(ev); r["span_s"], r["read_s"], r["idle_lease_pending_s"], r["idle_nothing_pending_s"]
    (4.0, 1.0, 1.5, 1.5)
    """
    start = min(e["t"] - e.get("s", 0.0) for e in events) + since
    end = max(e["t"] for e in events)
    edges = []   # (time, kind, +1/-1)
    loop_s: dict[str, float] = defaultdict(float)
    moved = {"read": 0, "write": 0}
    for e in events:
        lo, hi = max(e["t"] - e.get("s", 0.0), start), e["t"]
        if e["ev"] == "io":
            kind = e["dir"]
            if hi >= start:
                moved[kind] += e["bytes"]
        elif e["op"] == "Lease":
            kind = "lease"
        else:
            kind = None
        if e["ev"] == "req" and not e.get("blocked") and hi >= start:
            loop_s[e["op"]] += e["s"]
        if kind is not None and hi > lo:
            edges += [(lo, kind, 1), (hi, kind, -1)]
    edges.sort(key=lambda x: (x[0], -x[2]))
    open_ = {"read": 0, "write": 0, "lease": 0}
    spent: dict[str, float] = defaultdict(float)
    at = start
    for t, kind, d in edges + [(end, None, 0)]:
        if t > at:
            disk = "read" if open_["read"] else "write_only" if open_["write"] else "idle"
            pending = "lease_pending" if open_["lease"] else "nothing_pending"
            spent[f"{disk}_{pending}_s"] += t - at
            at = t
        if kind is not None:
            open_[kind] += d
    out = {"span_s": end - start,
           "read_s": spent["read_lease_pending_s"] + spent["read_nothing_pending_s"],
           "write_only_s": spent["write_only_lease_pending_s"]
           + spent["write_only_nothing_pending_s"],
           "idle_lease_pending_s": spent["idle_lease_pending_s"],
           "idle_nothing_pending_s": spent["idle_nothing_pending_s"],
           "lease_pending_s": sum(v for k, v in spent.items() if "lease_pending" in k),
           "read_gb": moved["read"] / 1e9, "written_gb": moved["write"] / 1e9,
           "loop_s": dict(sorted(loop_s.items(), key=lambda kv: -kv[1]))}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="the daemon's timeline (tierd serve --trace)")
    ap.add_argument("--since", type=float, default=0.0,
                    help="leave out this many seconds from the start (attach, first steps)")
    args = ap.parse_args(argv)
    events = load(args.trace)
    if not events:
        raise SystemExit(f"{args.trace}: no events")
    r = split(events, args.since)
    span = r["span_s"] or 1.0
    print(f"{span:.1f} s traced: a read in flight {r['read_s']:.1f} s "
          f"({r['read_gb']:.1f} GB read), only a write {r['write_only_s']:.1f} s, "
          f"the disk idle {r['idle_lease_pending_s']:.1f} s with a lease pending and "
          f"{r['idle_nothing_pending_s']:.1f} s with nothing pending; a lease pending "
          f"{r['lease_pending_s']:.1f} s")
    print("loop seconds on requests answered at once: " + ", ".join(
        f"{op} {s:.2f}" for op, s in r["loop_s"].items()))
    return r


if __name__ == "__main__":
    main()
