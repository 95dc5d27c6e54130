"""Durability costs: checksum speed, NVMe bandwidth with and without record
checksums (same threads, same pieces), and what a commit costs.

    python -m tierd.bench.durability --dir /mnt/nvme/bench --gib 2

Prints one line per figure; ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierd.backends import recordio
from tierd.backends.nvme import NvmeStore

MiB = 1 << 20


def checksum_speed(threads: int) -> None:
    buf = os.urandom(64 * MiB)
    algos = [("zlib crc32", zlib.crc32)]
    if recordio.DEFAULT_ALGO == recordio.ALGO_CRC32C:
        import crc32c
        algos.insert(0, ("crc32c", crc32c.crc32c))
    view = memoryview(buf)
    pieces = [view[s:s + n] for s, n in recordio.pieces_of(len(buf))]
    for name, fn in algos:
        t = time.perf_counter()
        for _ in range(4):
            fn(buf)
        one = 4 * len(buf) / (time.perf_counter() - t) / 1e9
        with ThreadPoolExecutor(threads) as ex:
            t = time.perf_counter()
            for _ in range(4):
                list(ex.map(fn, pieces))
            many = 4 * len(buf) / (time.perf_counter() - t) / 1e9
        print(f"checksum {name:<10} {one:6.2f} GB/s one thread, {many:6.2f} GB/s {threads} threads")


def nvme_bandwidth(directory: Path, nbytes: int, threads: int) -> None:
    store = NvmeStore(directory, nbytes + 64 * MiB)
    data = mmap.mmap(-1, nbytes)
    data.write(os.urandom(MiB) * (nbytes // MiB))
    view = memoryview(data)
    pieces = recordio.pieces_of(nbytes)
    meta = recordio.RecordMeta("bench", "bench", "uint8", (nbytes,), nbytes, 1)
    hlen = meta.header_len()
    ex = ThreadPoolExecutor(threads)

    def timed(label: str, calls) -> float:
        store.sync()
        t = time.perf_counter()
        list(ex.map(lambda c: c[0](*c[1:]), calls))
        store.sync()
        rate = nbytes / (time.perf_counter() - t) / 1e9
        print(f"{label:<44} {rate:6.2f} GB/s")
        return rate

    raw_w = timed("write raw O_DIRECT pieces (before)",
                  [(store.write_from, s, [view[s:s + n]]) for s, n in pieces])
    sum_w = timed("write pieces + checksum in I/O threads (after)",
                  [(store.sum_and_write, hlen + s, view[s:s + n]) for s, n in pieces])
    raw_r = timed("read raw O_DIRECT pieces (before)",
                  [(store.read_into, s, [view[s:s + n]]) for s, n in pieces])
    sum_r = timed("read pieces + checksum in I/O threads (after)",
                  [(store.read_and_sum, hlen + s, [view[s:s + n]]) for s, n in pieces])
    print(f"checksummed / raw: write {sum_w / raw_w:.2f}, read {sum_r / raw_r:.2f} "
          f"({'O_DIRECT' if store.direct else 'buffered'}, {threads} threads, "
          f"{nbytes >> 20} MiB)")
    ex.shutdown()
    view.release()
    data.close()
    store.close()


def commit_cost(directory: Path, nbytes: int) -> None:
    import torch

    from tests.faults import harness
    n = 16
    d = harness.start(directory / "daemon", pool=f"{2 * nbytes >> 20}MiB",
                      nvme_size=f"{4 * nbytes >> 20}MiB")
    try:
        with d.connect(job="bench") as c:
            tensors = {f"w{i}": torch.rand(nbytes // n // 4) for i in range(n)}
            c.put_many(tensors)
            for label, changed in (("first commit (all bytes new)", n), ("commit, 1/4 changed", n // 4),
                                   ("commit, nothing changed", 0)):
                for i in range(changed):
                    c.put(f"w{i}", tensors[f"w{i}"] + 1)
                t = time.perf_counter()
                info = c.commit(label)
                dt = time.perf_counter() - t
                print(f"{label:<32} {dt * 1e3:8.1f} ms, {info['written_bytes'] >> 20} MiB written "
                      f"of {info['bytes'] >> 20} MiB, {info['written_bytes'] / dt / 1e9 if dt else 0:.2f} GB/s")
            c.put_many({k: t + 2 for k, t in tensors.items()})
            t = time.perf_counter()
            c.evict(list(tensors))
            dt = time.perf_counter() - t
            print(f"{'evict of the same bytes (no fsync)':<32} {dt * 1e3:8.1f} ms, "
                  f"{nbytes / dt / 1e9:.2f} GB/s")
    finally:
        d.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=None, help="NVMe directory to test in")
    p.add_argument("--gib", type=float, default=1.0, help="bytes to move per figure")
    p.add_argument("--threads", type=int, default=8)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tierd-dur-", dir=args.dir))
    nbytes = int(args.gib * 1024) * MiB
    try:
        checksum_speed(args.threads)
        (root / "raw").mkdir()
        nvme_bandwidth(root / "raw", nbytes, args.threads)
        commit_cost(root, nbytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
