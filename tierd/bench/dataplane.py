"""Section 2, tierd's data plane against section 1's limits, and request latency.

- swap-in: leases batched per 8 keys (``lease_async``, all sent up front),
  each leased pool view copied to the GPU on the client's copy stream
  (``tierd.client.copy_stream``) from the CUDA-registered pool mapping;
- pool <-> GPU both ways at once through the same copy stream;
- pool -> NVMe: one ``evict`` of every key; NVMe -> pool: ``prefetch`` of
  every key, then one ``lease`` of every key (returns once all are in);
- round trips: put, get, lease+release at 1 in flight (blocking client) and 32
  in flight (``lease_async``/``release_async`` Pending objects; AsyncClient).
"""

from __future__ import annotations

import asyncio
import collections
import time

import torch

import tierd
from tierd.bench import limits
from tierd.bench.common import GB, Context, fmt_bytes, median, percentile, row
from tierd.client.copy_stream import CopyStream, register_pool

LEASE_BATCH = 8
REPEATS = 3
SMALL = 4096
IN_FLIGHT = 32


def limit_of(ctx: Context, what: str) -> float | None:
    """A section-1 figure measured earlier in this run (None if not measured)."""
    for r in ctx.results.get("limits", {}).get("rows", []):
        if r["what"] == what and "GBps" in r:
            return r["GBps"]
    return None


def ensure_limits(ctx: Context) -> None:
    if "limits" not in ctx.results:   # --only dataplane: measure the limits here
        ctx.results["limits"] = {"status": "ok", "rows": limits.run(ctx)}


def _ratio(value: float, limit: float | None) -> float | None:
    return None if not limit else value / limit


def fill(client: tierd.Client, keys: list[str], nbytes: int) -> None:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    for i in range(0, len(keys), LEASE_BATCH):
        client.put_many({k: src for k in keys[i:i + LEASE_BATCH]})


def swap_in(client, keys, nbytes, device) -> float:
    """Seconds to lease every key and land it on the GPU (median of REPEATS)."""
    copy = CopyStream(device)
    dst = torch.empty(len(keys) * nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(REPEATS + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        batches = [keys[j:j + LEASE_BATCH] for j in range(0, len(keys), LEASE_BATCH)]
        pending = [client.lease_async(b) for b in batches]
        inflight = []
        for b, p in zip(batches, pending):
            for lease in p.result():
                k = keys.index(lease.key)
                inflight.append(copy.copy_in(dst[k * nbytes:(k + 1) * nbytes],
                                             lease.tensor, (lease.key,)))
        for c in inflight:
            c.synchronize()
        dt = time.perf_counter() - t0
        for b in batches:
            client.release_async(b)
        if i:
            times.append(dt)
    client.release([])   # a no-op round trip: the releases above are served
    return median(times)


def both_ways(client, keys, nbytes, device) -> float:
    """Seconds to copy half the keys in and half out at once on the copy stream."""
    copy = CopyStream(device)
    half = len(keys) // 2
    ins, outs = keys[:half], keys[half:2 * half]
    dst = torch.empty(half * nbytes, dtype=torch.uint8, device=device)
    src = torch.empty(half * nbytes, dtype=torch.uint8, device=device).random_()
    times = []
    for i in range(REPEATS + 1):
        r_in = client.lease(ins)
        r_out = client.lease(outs, write=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        inflight = []
        for j, (a, b) in enumerate(zip(r_in, r_out)):
            piece = slice(j * nbytes, (j + 1) * nbytes)
            inflight.append(copy.copy_in(dst[piece], a.tensor, (a.key,)))
            inflight.append(copy.copy_out(b.tensor, src[piece], (b.key,)))
        for c in inflight:
            c.synchronize()
        dt = time.perf_counter() - t0
        client.release(ins)
        client.release(outs, written=True)
        if i:
            times.append(dt)
    return median(times)


def tier_moves(client, keys) -> tuple[float, float]:
    """(seconds to evict every key to NVMe, seconds to prefetch+lease them back)."""
    t0 = time.perf_counter()
    client.evict(keys)
    t_out = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.prefetch(keys)
    client.lease(keys)
    t_in = time.perf_counter() - t0
    client.release(keys)
    return t_out, t_in


def run(ctx: Context) -> list[dict]:
    ensure_limits(ctx)
    s = ctx.sizes
    daemon = ctx.start_daemon()
    client = tierd.connect(daemon.socket)
    rows = []
    try:
        n = max(2, s.disk_bytes // s.tensor_bytes)
        keys = [f"bench/data/{i}" for i in range(n)]
        fill(client, keys, s.tensor_bytes)
        total = n * s.tensor_bytes
        cfg = f"{n} keys x {fmt_bytes(s.tensor_bytes)}"
        if ctx.cuda:
            device = torch.device("cuda")
            register_pool(client, device)
            t = swap_in(client, keys, s.tensor_bytes, device)
            lim = limit_of(ctx, "pinned host->GPU")
            rows.append(row("tierd pool->GPU swap-in", cfg + f", leases of {LEASE_BATCH} keys "
                            "sent up front, copies on the client's copy stream",
                            GBps=total / t / GB, ratio=_ratio(total / t / GB, lim),
                            limit="pinned host->GPU", target=0.95))
            t = both_ways(client, keys, s.tensor_bytes, device)
            moved = 2 * (n // 2) * s.tensor_bytes
            lim = limit_of(ctx, "pinned both ways at once")
            rows.append(row("tierd pool<->GPU both ways", f"{n // 2} keys in + {n // 2} out, "
                            "interleaved on the client's one copy stream",
                            GBps=moved / t / GB, ratio=_ratio(moved / t / GB, lim),
                            limit="pinned both ways at once", target=0.90))
        else:
            rows.append(row("tierd pool->GPU swap-in", "skipped: no CUDA", skipped="no CUDA"))
        t_out, t_in = tier_moves(client, keys)
        st = client.stats()
        io = f"{cfg}, daemon io_threads as raw, NVMe direct I/O: {st['nvme_direct_io']}"
        rows.append(row("tierd pool->NVMe (evict)", io + ", one evict request",
                        GBps=total / t_out / GB,
                        ratio=_ratio(total / t_out / GB, limit_of(ctx, "raw disk write")),
                        limit="raw disk write", target=0.90))
        rows.append(row("tierd NVMe->pool (prefetch+lease)", io + ", one prefetch + one lease",
                        GBps=total / t_in / GB,
                        ratio=_ratio(total / t_in / GB, limit_of(ctx, "raw disk read")),
                        limit="raw disk read", target=0.90))
        client.delete(keys)
        rows += round_trips(client, s.latency_ops)
        rows += asyncio.run(async_round_trips(daemon.socket, s.latency_ops))
    finally:
        client.close()
    return rows


def _latency_row(what: str, config: str, lat: list[float], elapsed: float,
                 requests: int) -> dict:
    return row(what, config, p50_us=percentile(lat, 50) * 1e6, p99_us=percentile(lat, 99) * 1e6,
               ops_per_s=len(lat) / elapsed, requests_per_s=requests / elapsed)


def round_trips(client: tierd.Client, ops: int) -> list[dict]:
    t = torch.arange(SMALL // 4, dtype=torch.float32)
    keys = [f"bench/small/{i}" for i in range(IN_FLIGHT)]
    client.put_many({k: t for k in keys})
    rows = []
    for what, fn, reqs in (("put", lambda: client.put(keys[0], t), 2),
                           ("get", lambda: client.get(keys[0]), 2),
                           ("lease", lambda: client.lease(keys[:1]), 1),
                           ("release", lambda: client.release(keys[:1]), 1)):
        lat = []
        t0 = time.perf_counter()
        for _ in range(ops):
            a = time.perf_counter()
            fn()
            lat.append(time.perf_counter() - a)
        el = time.perf_counter() - t0
        rows.append(_latency_row(f"{what} round trip, 1 in flight",
                                 f"{SMALL} B tensor, blocking Client, {reqs} request(s) per op",
                                 lat, el, reqs * ops))
    # 32 lanes, each alternating lease and release of its own key
    lat, queue, done = [], collections.deque(), 0
    t0 = time.perf_counter()
    for lane, k in enumerate(keys):
        queue.append((time.perf_counter(), client.lease_async([k]), lane, "lease"))
    while done < 2 * ops:
        sent, pending, lane, kind = queue.popleft()
        pending.result()
        lat.append(time.perf_counter() - sent)
        done += 1
        nxt = ("release", client.release_async) if kind == "lease" else ("lease", client.lease_async)
        queue.append((time.perf_counter(), nxt[1]([keys[lane]]), lane, nxt[0]))
    el = time.perf_counter() - t0
    while queue:
        queue.popleft()[1].result()
    rows.append(_latency_row(f"lease/release, {IN_FLIGHT} in flight",
                             f"{SMALL} B keys, blocking Client lease_async/release_async "
                             f"Pending objects, {IN_FLIGHT} lanes", lat, el, done))
    client.delete(keys)
    return rows


async def async_round_trips(socket, ops: int) -> list[dict]:
    c = await tierd.aconnect(socket)
    t = torch.arange(SMALL // 4, dtype=torch.float32)
    keys = [f"bench/asmall/{i}" for i in range(IN_FLIGHT)]
    rows = []
    try:
        await c.put_many({k: t for k in keys})
        lat = []
        t0 = time.perf_counter()
        for _ in range(ops):
            a = time.perf_counter()
            await c.get(keys[0])
            lat.append(time.perf_counter() - a)
        rows.append(_latency_row("async get round trip, 1 in flight",
                                 f"{SMALL} B tensor, AsyncClient, 2 requests per op",
                                 lat, time.perf_counter() - t0, 2 * ops))
        lat = []

        async def lane(k: str, n: int) -> None:
            for _ in range(n):
                a = time.perf_counter()
                await c.get(k)
                lat.append(time.perf_counter() - a)

        per_lane = max(1, ops // IN_FLIGHT)
        t0 = time.perf_counter()
        await asyncio.gather(*(lane(k, per_lane) for k in keys))
        rows.append(_latency_row(f"async get round trip, {IN_FLIGHT} in flight",
                                 f"{SMALL} B tensors, AsyncClient, {IN_FLIGHT} concurrent "
                                 "tasks, 2 requests per op", lat, time.perf_counter() - t0,
                                 2 * len(lat)))
        await c.delete(keys)
    finally:
        await c.close()
    return rows
