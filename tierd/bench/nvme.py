"""The NVMe tier against the disk it runs on: raw O_DIRECT vs tierd, one run.

    python -m tierd.bench.nvme --dir /mnt/nvme/bench --out DIR --gib 4
    python -m tierd.bench.nvme --dir /tmp/x --out DIR --quick      # CPU smoke test

Measures, on the file system of ``--dir``:

1. the disk's raw O_DIRECT sequential write and read bandwidth: a sweep of
   request sizes and queue depths (threads, each with one request in flight)
   on a sample of a preallocated file, then the best of each way over the
   whole size, in rounds;
2. tierd's NVMe tier through a real ``tierd serve`` with record checksums on
   (crc32c when installed, as deployed): one ``evict`` of every key (pool ->
   NVMe, "spill") and one ``prefetch`` + ``lease`` of every key (NVMe -> pool,
   "fetch").

[Note: raw memory]
The same O_DIRECT calls can run at different speeds from two buffers of the
same size (on a virtual machine, by where the guest's pages happen to lie:
figures in ``benchmarks/results/HISTORY.md``, "The NVMe bench's method"), so
a raw figure from a buffer of the bench's own is partly luck. Each round's raw figures therefore move the very pool
pages that hold the keys (leased by the bench: key i at offset i x key size
of a file of its own): same memory, same file system, no tierd in between.
The sweep only picks the request size and depth.

[Note: first touch and steady state]
The daemon preallocates its file, so a first spill writes into unwritten
extents and the file system converts them as each write completes, which
costs write bandwidth (on ext4: the same page of HISTORY.md), in raw writes
as much as in tierd's. A daemon that has run a while writes
over blocks written before. So the first round runs on fresh files (raw and
tierd alike, 8 MiB x 8 raw) and is reported apart; then ``--rounds`` rounds
over written blocks, each raw write, spill, fetch and raw read back to back.
The ratios are medians of tierd over medians of raw.

Writes ``nvme.json`` into ``--out``: commit, device, disk, the sweep, the raw
and tierd figures and their ratios (target: >= 0.90 each way).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
TARGET = 0.90
#: raw request sizes and queue depths tried in the sweep
REQUEST_SIZES = (1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)
DEPTHS = (1, 2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one run moves.

    >>> BenchConfig(nbytes=256 * MiB, tensor_bytes=16 * MiB, sample_bytes=64 * MiB, rounds=1)
    ... # doctest: +ELLIPSIS
    BenchConfig(nbytes=268435456, ...)
    """

    nbytes: int          # bytes per figure (raw and tierd alike)
    tensor_bytes: int    # one key's size in the tierd rounds
    sample_bytes: int    # bytes per sweep point
    rounds: int          # timed rounds after the first-touch one
    request_sizes: tuple[int, ...] = REQUEST_SIZES
    depths: tuple[int, ...] = DEPTHS

    def __post_init__(self) -> None:
        if self.tensor_bytes <= 0 or self.tensor_bytes % 4096:
            raise ValueError(f"tensor_bytes={self.tensor_bytes}: must be a positive multiple "
                             f"of 4096; pass --tensor-mib as a whole number of MiB")
        if self.nbytes < 2 * self.tensor_bytes:
            raise ValueError(f"nbytes={self.nbytes} holds fewer than 2 keys of "
                             f"{self.tensor_bytes} B; raise --gib or lower --tensor-mib")
        if self.sample_bytes < max(self.request_sizes) or self.sample_bytes > self.nbytes:
            raise ValueError(f"sample_bytes={self.sample_bytes} must lie between the largest "
                             f"request ({max(self.request_sizes)} B) and nbytes ({self.nbytes})")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds}: at least 1; pass --rounds 1 or more")

    @property
    def keys(self) -> int:
        return self.nbytes // self.tensor_bytes

    @property
    def moved(self) -> int:
        """Bytes tierd moves each way (whole keys)."""
        return self.keys * self.tensor_bytes


# ------------------------------------------------------------------ raw
class RawFile:
    """A preallocated file opened O_DIRECT (buffered where refused, and said so)."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        fd, name = tempfile.mkstemp(prefix="raw-", dir=directory)
        os.close(fd)
        self.path = Path(name)
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            self.direct = True
        except OSError:
            self.fd, self.direct = os.open(self.path, os.O_RDWR), False
        os.posix_fallocate(self.fd, 0, nbytes)

    def run(self, write: bool, pieces: list[tuple[int, memoryview]], depth: int) -> float:
        """GB/s of moving every (file offset, buffer) piece, ``depth`` calls at a time."""
        call = os.pwritev if write else os.preadv

        def one(piece: tuple[int, memoryview]) -> None:
            offset, buf = piece
            done = 0
            while done < len(buf):
                got = call(self.fd, [buf[done:]], offset + done)
                if got <= 0:
                    raise OSError(f"raw {'write' if write else 'read'} at {offset + done} "
                                  f"returned {got}")
                done += got

        with ThreadPoolExecutor(depth) as ex:
            t0 = time.perf_counter()
            list(ex.map(one, pieces))
            elapsed = time.perf_counter() - t0
        return sum(len(b) for _, b in pieces) / elapsed / GB

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def split(views: list[tuple[int, memoryview]], request: int) -> list[tuple[int, memoryview]]:
    """(file offset, buffer) pieces of at most ``request`` bytes, in file order."""
    return [(offset + s, view[s:s + request])
            for offset, view in views for s in range(0, len(view), request)]


class SweepBuffer:
    """Random bytes in a shared memfd mapping, as the pool's segments are made."""

    def __init__(self, nbytes: int) -> None:
        fd = os.memfd_create("tierd-bench-sweep", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        for off in range(0, nbytes, MiB):
            self.mm[off:off + MiB] = os.urandom(MiB)
        self.view = memoryview(self.mm)

    def close(self) -> None:
        self.view.release()
        self.mm.close()


def sweep(raw: RawFile, cfg: BenchConfig) -> list[dict]:
    """Every (request size, depth) over the first ``sample_bytes`` of the file
    (written before), write then read, from a buffer of the bench's own."""
    buf = SweepBuffer(cfg.sample_bytes)
    points = []
    try:
        for request in cfg.request_sizes:
            pieces = split([(0, buf.view)], request)
            for depth in cfg.depths:
                points.append({"request_bytes": request, "depth": depth,
                               "write_GBps": raw.run(True, pieces, depth),
                               "read_GBps": raw.run(False, pieces, depth)})
            for _, view in pieces:
                view.release()
    finally:
        buf.close()
    return points


def best(points: list[dict], way: str) -> dict:
    return max(points, key=lambda p: p[f"{way}_GBps"])


def mixed_probe(directory: Path, nbytes: int, request: int = 8 * MiB, depth: int = 8) -> dict:
    """The disk under ``directory`` read and written at once: what NVMe costs
    a training step whose pool spills (reads of the next units while the last
    ones are written; [Note: a row's floor] in tierd.bench.bigmodel_floor).

    On a file of ``2 * nbytes`` (O_DIRECT, ``request``-sized calls,
    ``depth`` at a time each way): a sequential write of all of it (so the
    later writes go over written blocks, as a running daemon's do), a read of
    the first half, then a read of the first half and a write of the second
    at once. ``mixed_each_way_GBps``: ``nbytes`` / the seconds until both
    ended. Bytes come from and go to two 256 MiB buffers of the probe's own,
    reused along the file.

    >>> mixed_probe(Path("/tmp"), 64 * MiB)["direct_io"]       # doctest: +SKIP
    True
    """
    if nbytes < request or nbytes % request:
        raise ValueError(f"nbytes={nbytes} must be a whole number of {request} B requests")
    span = min(nbytes, 256 * MiB)
    raw = RawFile(directory, 2 * nbytes)
    bufs = [SweepBuffer(span), SweepBuffer(span)]
    first, second = [], []

    def pieces(start: int, buf: SweepBuffer) -> list[tuple[int, memoryview]]:
        return split([(start + off, buf.view[:min(span, nbytes - off)])
                      for off in range(0, nbytes, span)], request)

    try:
        first, second = pieces(0, bufs[0]), pieces(nbytes, bufs[1])
        write = (raw.run(True, first, depth) + raw.run(True, second, depth)) / 2
        read = raw.run(False, first, depth)
        with ThreadPoolExecutor(2) as both:
            t0 = time.perf_counter()
            jobs = [both.submit(raw.run, False, first, depth),
                    both.submit(raw.run, True, second, depth)]
            mixed_read, mixed_write = (j.result() for j in jobs)
            seconds = time.perf_counter() - t0
    finally:
        for _, view in first + second:
            view.release()
        for b in bufs:
            b.close()
        raw.close()
    return {"dir": str(directory), "direct_io": raw.direct, "bytes": nbytes,
            "request_bytes": request, "depth": depth, "write_GBps": write, "read_GBps": read,
            "mixed_read_GBps": mixed_read, "mixed_write_GBps": mixed_write,
            "mixed_each_way_GBps": nbytes / seconds / GB}


# ---------------------------------------------------------------- tierd
class TierdRun:
    """A real daemon with room for every key in its pool and its NVMe file."""

    def __init__(self, directory: Path, cfg: BenchConfig) -> None:
        import torch

        import tierd
        from tierd.backends.memory import available_memory
        from tierd.client.embedded import start_daemon
        self.cfg = cfg
        pool = cfg.moved + 8 * cfg.tensor_bytes + 64 * MiB
        if pool > available_memory() * 0.8:
            raise SystemExit(f"--gib {cfg.nbytes / GiB:g} needs a {pool >> 20} MiB pool, more "
                             f"than this machine has free ({available_memory() >> 20} MiB); "
                             f"lower --gib")
        nvme_size = cfg.moved + cfg.keys * 64 * 1024 + 256 * MiB
        self.daemon = start_daemon(pool=pool, nvme_size=nvme_size, nvme_dir=directory)
        self.client = tierd.connect(self.daemon.socket)
        self.keys = [f"bench/nvme/{i}" for i in range(cfg.keys)]
        self.src = torch.empty(cfg.tensor_bytes, dtype=torch.uint8).random_()
        self.stored = False

    def fill(self) -> None:
        """Every key new in the pool (dirty): the next evict writes them all."""
        if self.stored:
            self.client.delete(self.keys)
        self.stored = True
        for i in range(0, len(self.keys), 8):
            self.client.put_many({k: self.src for k in self.keys[i:i + 8]})

    def spill(self) -> float:
        """GB/s of one evict of every key (all new since :meth:`fill`)."""
        t0 = time.perf_counter()
        self.client.evict(self.keys)
        return self.cfg.moved / (time.perf_counter() - t0) / GB

    def fetch(self) -> float:
        """GB/s of one prefetch of every key and one lease of them all."""
        t0 = time.perf_counter()
        self.client.prefetch(self.keys)
        self.client.lease(self.keys)
        rate = self.cfg.moved / (time.perf_counter() - t0) / GB
        self.client.release(self.keys)
        return rate

    def raw(self, raw: RawFile, write: bool, request: int, depth: int) -> float:
        """GB/s of raw O_DIRECT between ``raw`` and the pool pages that hold the
        keys now (key i at offset i x tensor_bytes): see [Note: raw memory]."""
        leases = self.client.lease(self.keys, write=not write)
        views = [(i * self.cfg.tensor_bytes, memoryview(lease.tensor.numpy()))
                 for i, lease in enumerate(leases)]
        try:
            return raw.run(write, split(views, request), depth)
        finally:
            for _, view in views:
                view.release()
            del views, leases
            self.client.release(self.keys, written=not write)

    def verify(self) -> None:
        """Every key reads back what was put (the round trips kept the bytes)."""
        import torch
        for key in self.keys:
            if not torch.equal(self.client.get(key), self.src):
                raise SystemExit(f"{key} read back different bytes after the NVMe round trips")

    def close(self) -> None:
        try:
            if self.stored:
                self.client.delete(self.keys)
            self.client.close()
        finally:
            self.daemon.stop()


# ---------------------------------------------------------------- run
def one_round(t: TierdRun, raw: RawFile, write: tuple[int, int], read: tuple[int, int]) -> dict:
    """Raw write, tierd spill, tierd fetch, raw read of the same bytes, back to
    back, so a neighbour's load falls on both sides alike."""
    t.fill()
    r = {"raw_write_GBps": t.raw(raw, True, *write), "spill_GBps": t.spill(),
         "fetch_GBps": t.fetch()}
    r["raw_read_GBps"] = t.raw(raw, False, *read)
    return r


def measure(directory: Path, cfg: BenchConfig, log=print) -> dict:
    """First touch, the sweep, then the rounds (see the Notes); figures in GB/s."""
    raw = RawFile(directory, cfg.nbytes)
    t = None
    try:
        t = TierdRun(directory, cfg)
        first = one_round(t, raw, (8 * MiB, 8), (8 * MiB, 8))
        log(f"first touch: raw write {first['raw_write_GBps']:.2f}, tierd spill "
            f"{first['spill_GBps']:.2f}, tierd fetch {first['fetch_GBps']:.2f}, raw read "
            f"{first['raw_read_GBps']:.2f} GB/s")
        points = sweep(raw, cfg)
        bw, br = best(points, "write"), best(points, "read")
        log(f"sweep on {cfg.sample_bytes >> 20} MiB: best write {bw['write_GBps']:.2f} GB/s "
            f"({bw['request_bytes'] >> 20} MiB x {bw['depth']}), best read "
            f"{br['read_GBps']:.2f} GB/s ({br['request_bytes'] >> 20} MiB x {br['depth']})")
        rounds = []
        for i in range(cfg.rounds):
            r = one_round(t, raw, (bw["request_bytes"], bw["depth"]),
                          (br["request_bytes"], br["depth"]))
            rounds.append(r)
            log(f"round {i + 1}: raw write {r['raw_write_GBps']:.2f}, tierd spill "
                f"{r['spill_GBps']:.2f}, tierd fetch {r['fetch_GBps']:.2f}, raw read "
                f"{r['raw_read_GBps']:.2f} GB/s")
        t.verify()
        direct = raw.direct and bool(t.client.stats().get("nvme_direct_io", True))
    finally:
        if t is not None:
            t.close()
        raw.close()
    return summarize(cfg, direct, first, points, rounds, bw, br)


def summarize(cfg, direct, first, points, rounds, bw, br) -> dict:
    def med(name: str) -> float:
        return statistics.median(r[name] for r in rounds)

    raw_w, raw_r = med("raw_write_GBps"), med("raw_read_GBps")
    spill, fetch = med("spill_GBps"), med("fetch_GBps")
    from tierd.backends import recordio
    return {
        "direct_io": direct, "checksum": recordio.ALGO_NAMES[recordio.DEFAULT_ALGO],
        "bytes": cfg.moved, "tensor_bytes": cfg.tensor_bytes, "keys": cfg.keys,
        "raw": {"sweep_bytes": cfg.sample_bytes, "sweep": points,
                "write": {"request_bytes": bw["request_bytes"], "depth": bw["depth"],
                          "GBps": raw_w},
                "read": {"request_bytes": br["request_bytes"], "depth": br["depth"],
                         "GBps": raw_r}},
        "tierd": {"spill_GBps": spill, "fetch_GBps": fetch},
        "first_touch": first, "rounds": rounds,
        "ratios": {"spill": spill / raw_w, "fetch": fetch / raw_r,
                   "first_touch_spill": first["spill_GBps"] / first["raw_write_GBps"],
                   "first_touch_fetch": first["fetch_GBps"] / first["raw_read_GBps"]},
        "target": TARGET,
    }


def disk_of(directory: Path) -> str:
    """The block device under ``directory`` and its model, as sysfs names them."""
    dev = os.stat(directory).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    try:
        name = sys_dev.resolve().name
        model = sys_dev / "device" / "model"
        if not model.exists():
            model = sys_dev / ".." / "device" / "model"
        return f"{name} ({model.read_text().strip()})" if model.exists() else name
    except OSError:
        return f"device {os.major(dev)}:{os.minor(dev)}"


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def table(result: dict) -> str:
    raw, t, ratio = result["raw"], result["tierd"], result["ratios"]

    def verdict(x: float) -> str:
        return f"{x:.0%} ({'ok' if x >= TARGET else 'miss'})"

    return "\n".join([
        f"NVMe tier on {result['disk']} ({result['checksum']} records, "
        f"{'O_DIRECT' if result['direct_io'] else 'buffered'}), "
        f"{result['bytes'] / GiB:g} GiB, median of {len(result['rounds'])} rounds:",
        f"  spill (pool->NVMe)  tierd {t['spill_GBps']:.2f} GB/s  raw write "
        f"{raw['write']['GBps']:.2f} GB/s ({raw['write']['request_bytes'] >> 20} MiB x "
        f"{raw['write']['depth']})  {verdict(ratio['spill'])}",
        f"  fetch (NVMe->pool)  tierd {t['fetch_GBps']:.2f} GB/s  raw read  "
        f"{raw['read']['GBps']:.2f} GB/s ({raw['read']['request_bytes'] >> 20} MiB x "
        f"{raw['read']['depth']})  {verdict(ratio['fetch'])}",
        f"  first touch (fresh file): spill {ratio['first_touch_spill']:.0%} of raw write, "
        f"fetch {ratio['first_touch_fetch']:.0%} of raw read"])


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tierd.bench.nvme",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True,
                   help="a directory on the disk to measure (the daemon's --nvme disk)")
    p.add_argument("--out", type=Path, required=True, help="where nvme.json goes")
    p.add_argument("--gib", type=float, default=None, help="GiB per figure (default 4; 0.25 quick)")
    p.add_argument("--tensor-mib", type=int, default=None,
                   help="one key's size (default 64 MiB; 16 quick)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; 1 quick)")
    p.add_argument("--quick", action="store_true", help="small sizes: a CPU smoke test")
    return p.parse_args(argv)


def config_of(args: argparse.Namespace) -> BenchConfig:
    gib = args.gib if args.gib is not None else (0.25 if args.quick else 4.0)
    tensor = (args.tensor_mib or (16 if args.quick else 64)) * MiB
    nbytes = int(gib * GiB) // tensor * tensor if tensor > 0 else 0   # whole keys, both sides
    kw = {"request_sizes": (1 * MiB, 8 * MiB), "depths": (1, 8)} if args.quick else {}
    return BenchConfig(nbytes=nbytes, tensor_bytes=tensor,
                       sample_bytes=min(nbytes, (64 if args.quick else 1024) * MiB),
                       rounds=args.rounds if args.rounds is not None else (1 if args.quick else 3),
                       **kw)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        cfg = config_of(args)
    except ValueError as exc:
        print(f"python -m tierd.bench.nvme: {exc}", file=sys.stderr)
        return 2
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tierd-nvme-bench-", dir=args.dir))
    try:
        result = measure(work, cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from tierd.bench.run import git_commit
    result = {"commit": git_commit(), "device": device_name(), "disk": disk_of(args.dir),
              "dir": str(args.dir), "command": " ".join(["python -m tierd.bench.nvme",
                                                         *(argv or sys.argv[1:])]),
              **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "nvme.json").write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
