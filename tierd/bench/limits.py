"""Section 1, the limits: pinned host <-> GPU copies and raw O_DIRECT disk I/O.

The disk figures use the daemon's own thread count and chunk size
(``ServeConfig.io_threads``, ``tierd.backends.nvme.CHUNK``) on a preallocated
file in the same directory, so section 2 can compare like with like.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierd.bench.common import GB, IO_CHUNK, IO_THREADS, Context, chunks, fmt_bytes, median, row

REPEATS = 5


def pinned_copies(nbytes: int, device: torch.device) -> dict[str, float]:
    """GB/s of pinned host->GPU, GPU->host, and both at once (two streams)."""
    host_a = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host_b = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def timed(fn) -> float:
        times = []
        for i in range(REPEATS + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            if i:   # the first is warm-up
                times.append(time.perf_counter() - t0)
        return median(times)

    def h2d():
        with torch.cuda.stream(s1):
            dev_a.copy_(host_a, non_blocking=True)

    def d2h():
        with torch.cuda.stream(s2):
            host_b.copy_(dev_b, non_blocking=True)

    def both():
        h2d()
        d2h()

    out = {"h2d_GBps": nbytes / timed(h2d) / GB, "d2h_GBps": nbytes / timed(d2h) / GB,
           "both_GBps": 2 * nbytes / timed(both) / GB}
    del host_a, host_b, dev_a, dev_b
    torch.cuda.empty_cache()
    return out


class AlignedBuffer:
    """Page-aligned anonymous memory (what O_DIRECT needs), filled with random bytes."""

    def __init__(self, nbytes: int) -> None:
        self.mm = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.mm)
        torch.frombuffer(self.mm, dtype=torch.uint8).random_()

    def close(self) -> None:
        self.view.release()
        self.mm.close()


def raw_direct_io(directory: Path, nbytes: int, threads: int = IO_THREADS,
                  chunk: int = IO_CHUNK) -> dict:
    """Write then read ``nbytes`` with O_DIRECT on a preallocated file, ``threads``
    threads each doing one ``chunk`` at a time (like the daemon's executor)."""
    fd_path = Path(tempfile.mkstemp(prefix="raw-", dir=directory)[1])
    direct = True
    try:
        try:
            fd = os.open(fd_path, os.O_RDWR | os.O_DIRECT)
        except OSError:
            fd, direct = os.open(fd_path, os.O_RDWR), False
        os.posix_fallocate(fd, 0, nbytes)
        buf = AlignedBuffer(nbytes)
        pieces = list(chunks(0, nbytes, chunk))

        def write(p):
            off, start, n = p
            done = 0
            while done < n:
                done += os.pwritev(fd, [buf.view[start + done:start + n]], off + done)

        def read(p):
            off, start, n = p
            done = 0
            while done < n:
                done += os.preadv(fd, [buf.view[start + done:start + n]], off + done)

        with ThreadPoolExecutor(threads) as ex:
            t0 = time.perf_counter()
            list(ex.map(write, pieces))
            t_write = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(ex.map(read, pieces))
            t_read = time.perf_counter() - t0
        os.close(fd)
        buf.close()
    finally:
        fd_path.unlink(missing_ok=True)
    return {"write_GBps": nbytes / t_write / GB, "read_GBps": nbytes / t_read / GB,
            "direct_io": direct}


def run(ctx: Context) -> list[dict]:
    s = ctx.sizes
    rows = []
    if ctx.cuda:
        bw = pinned_copies(s.copy_bytes, torch.device("cuda"))
        cfg = f"pin_memory() buffer, one copy of {fmt_bytes(s.copy_bytes)}, median of {REPEATS}"
        rows += [row("pinned host->GPU", cfg, GBps=bw["h2d_GBps"]),
                 row("pinned GPU->host", cfg, GBps=bw["d2h_GBps"]),
                 row("pinned both ways at once", cfg + ", two streams", GBps=bw["both_GBps"])]
    else:
        rows.append(row("pinned copies", "skipped: no CUDA", skipped="no CUDA device"))
    io = raw_direct_io(ctx.nvme_dir, s.disk_bytes)
    cfg = (f"{fmt_bytes(s.disk_bytes)} in {fmt_bytes(IO_CHUNK)} chunks, {IO_THREADS} threads, "
           f"{'O_DIRECT' if io['direct_io'] else 'buffered (O_DIRECT refused)'}, {ctx.nvme_dir}")
    rows += [row("raw disk write", cfg, GBps=io["write_GBps"], direct_io=io["direct_io"]),
             row("raw disk read", cfg, GBps=io["read_GBps"], direct_io=io["direct_io"])]
    return rows
