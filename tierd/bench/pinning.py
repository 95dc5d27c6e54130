"""What making a pool segment usable in a client costs, per GiB.

A client maps each pool segment the daemon made (and zeroed) and, on CUDA,
page-locks it: page tables (MADV_POPULATE_READ), then ``cudaHostRegister``.
This measures both on memfd segments populated through another mapping (as
the daemon's), registering on one thread and on several, with the GPU idle
and while another thread keeps it busy (matrix products and pinned copies,
synchronized per round, as a training step's launches are), and that work's
rate meanwhile. The figures behind [Note: segments mapped ahead] in
tierd.backends.hostpool come from it::

    python -m tierd.bench.pinning --out DIR            # on the GPU machine
    python -m tierd.bench.pinning --out DIR --gib 0.25 # CPU: page tables only

Writes ``DIR/pinning-<device>.json``: ``populate_read_s_per_gib``, and per
case (``idle``/``busy`` x threads) ``register_s_per_gib`` (wall) and
``register_summed_s_per_gib`` (summed over the threads: equal to the wall
time times the threads where the driver registers one range at a time), and
for ``busy`` the work's rounds a second against ``work_alone_per_s``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierd.backends.hostpool import populate_pages

SEGMENT = 256 << 20


def segments(n: int, size: int) -> list[tuple[int, mmap.mmap, mmap.mmap]]:
    """``n`` memfds of ``size`` bytes zeroed through one mapping (the
    daemon's), each with a second, unpopulated mapping (the client's)."""
    out = []
    for _ in range(n):
        fd = os.memfd_create("tierd-bench-pinning", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        daemon = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        populate_pages(daemon, size)
        out.append((fd, daemon, mmap.mmap(fd, size, mmap.MAP_SHARED,
                                          mmap.PROT_READ | mmap.PROT_WRITE)))
    return out


def close(segs) -> None:
    for fd, daemon, client in segs:
        client.close()
        daemon.close()
        os.close(fd)


def populate_read(segs, size: int) -> float:
    t0 = time.perf_counter()
    for _, _, client in segs:
        populate_pages(client, size, write=False)
    return time.perf_counter() - t0


def register(segs, size: int, threads: int) -> tuple[float, float]:
    """Wall and summed seconds of ``cudaHostRegister`` of every client mapping."""
    cudart = torch.cuda.cudart()
    views = [torch.frombuffer(memoryview(client), dtype=torch.uint8) for _, _, client in segs]

    def one(view) -> float:
        t = time.perf_counter()
        err = int(cudart.cudaHostRegister(view.data_ptr(), size, 0))
        if err:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {err}")
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        each = list(pool.map(one, views))
    wall = time.perf_counter() - t0
    for view in views:
        cudart.cudaHostUnregister(view.data_ptr())
    del views
    return wall, sum(each)


class Work:
    """Matrix products and a pinned 1 GiB copy on another stream, a round at a
    time, on a thread of its own, until stopped: the rounds a second."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        self.host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        self.dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        self.copies = torch.cuda.Stream(device)
        self.device = device

    def run(self, stop: threading.Event, out: dict) -> None:
        torch.cuda.set_device(self.device)
        rounds, t0 = 0, time.perf_counter()
        while not stop.is_set():
            for _ in range(10):
                self.a @ self.a
            with torch.cuda.stream(self.copies):
                self.dev.copy_(self.host, non_blocking=True)
            torch.cuda.synchronize(self.device)
            rounds += 1
        out["per_s"] = rounds / (time.perf_counter() - t0)

    def rate_beside(self, fn) -> tuple[object, float]:
        stop, out = threading.Event(), {}
        thread = threading.Thread(target=self.run, args=(stop, out))
        thread.start()
        time.sleep(0.5)
        try:
            result = fn()
        finally:
            stop.set()
            thread.join()
        return result, out["per_s"]


def measure(gib: float, thread_counts: list[int]) -> dict:
    n = max(1, round(gib * (1 << 30) / SEGMENT))
    size_gib = n * SEGMENT / (1 << 30)
    segs = segments(n, SEGMENT)
    try:
        out = {"segment_bytes": SEGMENT, "segments": n,
               "populate_read_s_per_gib": populate_read(segs, SEGMENT) / size_gib}
    finally:
        close(segs)
    if not torch.cuda.is_available():
        return out
    device = torch.device("cuda", torch.cuda.current_device())
    work = Work(device)
    _, out["work_alone_per_s"] = work.rate_beside(lambda: time.sleep(2))
    for busy in (False, True):
        for threads in thread_counts:
            segs = segments(n, SEGMENT)
            try:
                populate_read(segs, SEGMENT)
                if busy:
                    (wall, summed), rate = work.rate_beside(
                        lambda: register(segs, SEGMENT, threads))
                else:
                    (wall, summed), rate = register(segs, SEGMENT, threads), None
            finally:
                close(segs)
            out[f"{'busy' if busy else 'idle'}_{threads}"] = {
                "register_s_per_gib": wall / size_gib,
                "register_summed_s_per_gib": summed / size_gib, "work_per_s": rate}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=4.0, help="GiB of segments a case")
    ap.add_argument("--threads", default="1,4", help="registering threads, comma-separated")
    args = ap.parse_args(argv)
    result = measure(args.gib, [int(t) for t in args.threads.split(",")])
    result["device"] = (torch.cuda.get_device_name().lower().replace(" ", "-")
                        if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"pinning-{result['device']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
