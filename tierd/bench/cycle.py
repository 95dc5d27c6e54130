"""A working set larger than the pool, touched in the same order every step.

    python -m tierd.bench.cycle --dir /mnt/nvme/bench --out DIR --pool-mib 4096 --ratio 1.5
    python -m tierd.bench.cycle --dir /tmp/x --out DIR --quick      # CPU smoke run
    python -m tierd.bench.cycle --dir D --out DIR --ahead 2         # and prefetching ahead

This is what a training job's streamed optimizer state does once it exceeds
the pool (a 15B-18B model on a 128 GiB machine): each step leases every key
for writing, in the same order, changes it and releases it. Through a real
``tierd serve`` on the file system of ``--dir``, the same steps run twice,
each on a fresh daemon: with least-recently-used eviction alone, and with
each key demoted after its release, as ``tierd.optim`` does ([Note: eviction
by next use] in ``tierd.server.eviction``). Writes ``cycle.json``: per policy
the bytes read from and written to NVMe per step and the seconds per step
(medians after the first step, which fills the pool).

What was predicted before this benchmark first ran, and measured then:
``benchmarks/results/HISTORY.md``, "Demoting (tierd.bench.cycle)".

``--ahead N`` adds a third run, demoted with the next N keys prefetched
before each lease, as a client fetching a bucket ahead would: the victims'
writes and the next keys' reads then overlap the current key's. Whether that
helps depends on the disk's mixed read/write bandwidth (on the development
VM it did not: the same page of HISTORY.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import tierd
from tierd.bench.run import git_commit

MiB = 1 << 20


def run_policy(directory: Path, *, pool: int, keys: int, key_bytes: int, steps: int,
               demote: bool, ahead: int = 0) -> dict:
    """One fresh daemon, ``steps`` passes over ``keys`` keys; figures per step.
    ``ahead``: before each lease, ask the daemon to prefetch the next
    ``ahead`` keys (a hint: their victims' writes and their reads start while
    this key is worked on, as a client fetching a bucket ahead would)."""
    from tierd.client.embedded import start_daemon
    daemon = start_daemon(pool=pool, nvme_size=2 * keys * key_bytes + 256 * MiB,
                          nvme_dir=directory)
    names = [f"state/{i:05d}" for i in range(keys)]
    rows = []
    try:
        with tierd.connect(daemon.socket) as c:
            for k in names:
                c.put(k, torch.zeros(key_bytes // 4))
            for _ in range(steps):
                before, t0 = c.stats(), time.perf_counter()
                for i, k in enumerate(names):
                    if ahead:
                        c.prefetch(names[i + 1:i + 1 + ahead])
                    (leased,) = c.lease([k], write=True)
                    leased.tensor[:1024].add_(1)   # the update: new bytes, a dirty key
                    c.release([k], written=True)
                    if demote:
                        c.demote_async([k])
                c.stats()   # every request answered
                after = c.stats()
                rows.append({"seconds": time.perf_counter() - t0,
                             "read_bytes": after["bytes_to_pool"] - before["bytes_to_pool"],
                             "written_bytes": after["bytes_to_nvme"] - before["bytes_to_nvme"]})
    finally:
        daemon.stop()
    steady = rows[1:] or rows
    med = {f: statistics.median(r[f] for r in steady) for f in rows[0]}
    return {"demote": demote, "ahead": ahead, "steps": rows, **{f"median_{f}": v for f, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the daemons' NVMe files go")
    ap.add_argument("--out", type=Path, required=True, help="where cycle.json goes")
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=1.5, help="working set / pool")
    ap.add_argument("--key-mib", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ahead", type=int, default=0, help="also run demoted with the next N "
                    "keys prefetched before each lease (0: not run)")
    ap.add_argument("--quick", action="store_true", help="64 MiB pool, 1 MiB keys, 3 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.pool_mib, args.key_mib, args.steps = 64, 1, 3
    pool, key_bytes = args.pool_mib * MiB, args.key_mib * MiB
    keys = int(args.ratio * pool) // key_bytes
    args.dir.mkdir(parents=True, exist_ok=True)
    runs = [(False, 0), (True, 0)] + [(True, args.ahead)] * (args.ahead > 0)
    policies = [run_policy(args.dir, pool=pool, keys=keys, key_bytes=key_bytes,
                           steps=args.steps, demote=d, ahead=a) for d, a in runs]
    lru, demoted = policies[:2]
    out = {"commit": git_commit(), "pool_bytes": pool, "working_set_bytes": keys * key_bytes,
           "key_bytes": key_bytes, "cpus": os.cpu_count(), "policies": policies,
           "read_ratio": demoted["median_read_bytes"] / max(1, lru["median_read_bytes"]),
           "time_ratio": demoted["median_seconds"] / lru["median_seconds"]}
    if args.ahead:
        out["ahead_time_ratio"] = policies[2]["median_seconds"] / demoted["median_seconds"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cycle.json").write_text(json.dumps(out, indent=2))
    for p in policies:
        name = (f"demoted, {p['ahead']} ahead" if p["ahead"] else "demoted") if p["demote"] \
            else "LRU"
        print(f"{name:>18}: {p['median_seconds']:.3f} s/step, "
              f"{p['median_read_bytes'] / MiB:.0f} MiB read, "
              f"{p['median_written_bytes'] / MiB:.0f} MiB written per step "
              f"(working set {keys * key_bytes / MiB:.0f} MiB, pool {args.pool_mib} MiB)")
    print(f"demoted / LRU: {out['read_ratio']:.2f} of the bytes read, "
          f"{out['time_ratio']:.2f} of the time")
    if args.ahead:
        print(f"{args.ahead} ahead / demoted: {out['ahead_time_ratio']:.2f} of the time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
