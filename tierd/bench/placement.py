"""Placement on the GPU: tierd with default arguments vs the same model all on the GPU.

    python -m tierd.bench.placement --out DIR        # the cases below (H200: ~6 min, 8B not yet timed)
    python -m tierd.bench.placement --out DIR --tiny # CPU smoke run of the same code

Each case runs the all-on-GPU reference (fp32 weights, fused torch AdamW,
bf16 autocast) and tierd (``attach(model, compute_dtype="bf16")`` with
``tierd.optim.AdamW``; the first steps measure and place) in one process,
and writes ``placement.json``: ``{"commit", "device", "rows": [{"case",
"allgpu_s", "tierd_s", "floor_s", "tierd_peak_gb", "allgpu_peak_gb",
"pcie_in_gb", "pcie_out_gb", "error", "tierd_run_s", "allgpu_run_s",
"tierd_diag", "allgpu_diag"}]}``. ``*_s`` is the median of synchronized
steps; ``*_run_s`` the mean of as many steps back to back, synchronized
only at the end, as a training loop runs them (a capped case's copies out
may then overlap the next step's forward). Each
``*_diag`` (CUDA only) splits one more step into forward, backward and
``step()`` seconds, and one profiled step into compute-stream busy time and
the idle time beside copies or beside nothing (``attach_step.profile``);
tierd's also has its hooks' host seconds per step. A capped case's ``floor_s`` is the
larger of the all-GPU step (its compute) and the PCIe time of the bytes the
plan streams, at the both-ways bandwidth measured in the same run.

What was predicted before this benchmark first ran, and measured then:
``benchmarks/results/HISTORY.md``, "Placement (tierd.bench.placement)".
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import tierd
import tierd.optim
from tierd.bench.bigmodel_models import checkpointed
from tierd.client.attach import attach, detach, session_of
from tierd.client.embedded import start_daemon

GB = 1e9
#: model shape -> GPT-2 layers, width (and activation checkpointing, vocabulary)
SHAPES = {"1.3B": dict(layers=24, d=2048), "5B": dict(layers=24, d=4096),
          "8B": dict(layers=40, d=4096, checkpointing=True),
          "tiny": dict(layers=2, d=128, vocab=1000),
          "tiny-ckpt": dict(layers=2, d=128, vocab=1000, checkpointing=True)}
#: (case name, model shape, batch, train?, attach arguments besides the
#: defaults: a cap, and where the planner may also choose CPU updates)
CASES = [("1.3B B=8 train", "1.3B", 8, True, {}),
         ("1.3B B=16 train", "1.3B", 16, True, {}),
         ("1.3B B=8 forward", "1.3B", 8, False, {}),
         ("1.3B B=8 train, cap 48 GB", "1.3B", 8, True, {"gpu_memory_bytes": int(48 * GB)}),
         ("1.3B B=8 train, cap 48 GB, optimizer_placement=auto", "1.3B", 8, True,
          {"gpu_memory_bytes": int(48 * GB), "optimizer_placement": "auto"}),
         ("5B B=2 train", "5B", 2, True, {}),
         ("8B B=4 train, checkpointing, cap 100 GB", "8B", 4, True,
          {"gpu_memory_bytes": int(100 * GB)})]
TINY = [("tiny B=2 train", "tiny", 2, True, {}), ("tiny B=2 forward", "tiny", 2, False, {}),
        ("tiny B=2 train, cap 2 MB", "tiny", 2, True, {"gpu_memory_bytes": int(2e6)}),
        ("tiny B=2 train, checkpointing, cap 2 MB", "tiny-ckpt", 2, True,
         {"gpu_memory_bytes": int(2e6)})]
UNRUN = {"5B B=2 train, cap 40 GB":
         "not run: streaming 5B needs its 65 GiB of weights and state in the pinned pool, "
         "and this host page-locks at most ~70 GiB (cudaHostRegister fails past 279 "
         "segments of 256 MiB); with a 60 GiB pool the streamed state swaps through NVMe "
         "every step. The capped case was run on 1.3B instead"}


def build(shape: str, seq: int, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    s = SHAPES[shape]
    cfg = GPT2Config(n_layer=s["layers"], n_embd=s["d"], n_head=max(1, s["d"] // 128),
                     n_positions=seq, vocab_size=s.get("vocab", 50257),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg).train()
    return checkpointed(model) if s.get("checkpointing") else model


class Clock:
    """Synchronized step timing and peak memory on CUDA; plain timing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median(self, fn, steps: int, warmup: int) -> float:
        out = []
        for i in range(warmup + steps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def back_to_back(self, fn, steps: int) -> float:
        """Mean seconds of ``steps`` calls with no synchronization between
        them (as a training loop runs: one step's copies may overlap the next)."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / steps

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / GB if self.cuda else 0.0

    def allocator(self) -> dict:
        """The caching allocator since :meth:`reset_peak`: its reserved peak,
        and the times it ran out of cached blocks and freed them all (each a
        device-wide synchronization) or called cudaMalloc / cudaFree."""
        if not self.cuda:
            return {}
        stats = torch.cuda.memory_stats(self.device)
        return {"reserved_peak_gb": torch.cuda.max_memory_reserved(self.device) / GB,
                **{k: stats.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams",
                                                "num_device_alloc", "num_device_free")}}


def step_fn(model, opt, ids, train: bool, device: torch.device):
    kind = "cuda" if device.type == "cuda" else "cpu"

    def step():
        if not train:
            with torch.no_grad(), torch.autocast(kind, dtype=torch.bfloat16):
                model(input_ids=ids)
            return
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def both_ways_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of pinned host<->device copies running both ways at once."""
    if device.type != "cuda":
        return 10 * GB
    host_in = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host_out = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    best = 0.0
    for _ in range(6):   # the best of several: single runs varied from 83 to 101 GB/s
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(s2):
            host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize(device)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def diagnose(fn, model, opt, ids, train: bool, trace: Path | None = None) -> dict | None:
    """Where one step's time goes (CUDA only): phases, then the streams of a
    profiled step (its trace written to ``trace``, if given)."""
    if ids.device.type != "cuda":
        return None
    from tierd.bench.attach_step import phases, profile
    out = phases(model, opt, ids) if train else {}
    out.update(profile(fn, trace))
    return out


def run_reference(shape: str, cases: list, args, clock: Clock, device) -> dict:
    out, held = {}, []
    try:
        held.append(build(shape, args.seq, str(device)))
        model = held[0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        held.append(opt)
        for name, _, batch, train, _options in cases:
            ids = torch.randint(0, model.config.vocab_size, (batch, args.seq), device=device)
            clock.reset_peak()
            fn = step_fn(model, opt, ids, train, device)
            secs = clock.median(fn, args.steps, args.warmup)
            peak = clock.peak_gb()
            run = clock.back_to_back(fn, args.steps)
            out[name] = (secs, peak, None, diagnose(fn, model, opt, ids, train), run)
    except torch.OutOfMemoryError as exc:
        for name, *_ in cases:
            out.setdefault(name, (None, None, f"all on GPU: out of memory ({exc})"[:300], None,
                                  None))
    held.clear()   # the model and its state leave the GPU before tierd's run measures it
    model = opt = fn = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_tierd(cpu_model, name: str, batch: int, train: bool, options: dict, args, clock,
              device, daemon) -> dict:
    model = attach(cpu_model, client=tierd.connect(daemon.socket), compute_dtype="bf16",
                   device=device, **options)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    ids = torch.randint(0, cpu_model.config.vocab_size, (batch, args.seq), device=device)
    fn = step_fn(model, opt, ids, train, device)
    session = session_of(model)
    for _ in range(args.warmup):   # measure, place, settle in
        fn()
    clock.sync()
    before = session.stats()
    clock.reset_peak()
    allocator = clock.allocator()
    secs = clock.median(fn, args.steps, 0)
    peak, after = clock.peak_gb(), session.stats()
    allocator = {k: v if k == "reserved_peak_gb" else v - allocator[k]
                 for k, v in clock.allocator().items()}
    run = clock.back_to_back(fn, args.steps)
    trace = args.out / (re.sub(r"[^A-Za-z0-9.]+", "-", name) + ".trace.json.gz") \
        if args.trace else None
    diag = diagnose(fn, model, opt, ids, train, trace)
    if diag is not None:
        diag.update({k: (after[k] - before[k]) / args.steps
                     for k in ("hook_seconds", "optimizer_seconds", "wait_seconds",
                               "lease_wait_seconds")})
        diag["allocator"] = allocator   # over the timed steps
    row = {"tierd_diag": diag, "tierd_s": secs, "tierd_run_s": run, "tierd_peak_gb": peak,
           "pcie_in_gb": (after["h2d_bytes"] - before["h2d_bytes"]) / args.steps / GB,
           "pcie_out_gb": (after["d2h_bytes"] - before["d2h_bytes"]) / args.steps / GB,
           "planned_pcie_gb": (after["planned_pcie_bytes"] or 0) / GB,
           "resident_gb": after["resident_bytes"] / GB, "placement": after["placement"]}
    detach(model)   # the CPU model gets its trained values back: reused by the next case
    return row


def floor(row: dict, bandwidth: float) -> float | None:
    """A capped case's floor: the larger of its compute (the all-GPU step;
    where that ran out of memory, tierd's compute-stream busy time) and the
    planned PCIe bytes at ``bandwidth``."""
    compute = row["allgpu_s"]
    if compute is None:
        compute = (row.get("tierd_diag") or {}).get("compute_busy_s")
    if compute is None:
        return None
    return max(compute, (row["planned_pcie_gb"] or 0) * GB / bandwidth)


def measure(args, cases: list, device: torch.device) -> tuple[list[dict], float]:
    """Every case of ``cases`` in this process (one model shape at a time)."""
    clock = Clock(device)
    bandwidth = both_ways_bandwidth(device)
    daemon = start_daemon(pool=args.pool_gib << 30, nvme_size=args.nvme_gib << 30)
    rows = []
    try:
        for shape in dict.fromkeys(c[1] for c in cases):
            mine = [c for c in cases if c[1] == shape]
            ref = run_reference(shape, mine, args, clock, device)
            cpu_model = build(shape, args.seq, str(device)).to("cpu") if not args.tiny \
                else build(shape, args.seq, "cpu")
            for name, _, batch, train, options in mine:
                allgpu_s, allgpu_peak, error, allgpu_diag, allgpu_run = ref[name]
                row = {"case": name, "allgpu_s": allgpu_s, "allgpu_run_s": allgpu_run,
                       "allgpu_peak_gb": allgpu_peak,
                       "floor_s": None, "error": error, "allgpu_diag": allgpu_diag}
                row.update(run_tierd(cpu_model, name, batch, train, options, args, clock,
                                     device, daemon))
                if "gpu_memory_bytes" in options:
                    row["floor_s"] = floor(row, bandwidth)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del cpu_model
            gc.collect()
    finally:
        daemon.stop()
    return rows, bandwidth


def measure_apart(args, shapes: list[str]) -> tuple[list[dict], float]:
    """Each model shape in a process of its own: a process keeps the pool
    segments it page-locked, and the host page-locks only so much (~70 GiB on
    the H200 host), so 5B's pool cannot follow 1.3B's in one process."""
    rows, bandwidth = [], 0.0
    for shape in shapes:
        out = args.out / shape
        cmd = [sys.executable, "-m", "tierd.bench.placement", "--out", str(out), "--only", shape,
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--pool-gib", str(args.pool_gib), "--nvme-gib", str(args.nvme_gib),
               "--case", args.case] + ["--trace"] * args.trace
        if subprocess.run(cmd).returncode != 0:
            rows.append({"case": f"{shape} (every case)", "error": "its process failed; see "
                         "its output above", **{k: None for k in ROW_FIELDS}})
            continue
        got = json.loads((out / "placement.json").read_text())
        rows += got["rows"]
        bandwidth = max(bandwidth, got["both_ways_bandwidth_gbps"] * GB)
    return rows, bandwidth


ROW_FIELDS = ("allgpu_s", "tierd_s", "floor_s", "tierd_peak_gb", "allgpu_peak_gb",
              "pcie_in_gb", "pcie_out_gb", "planned_pcie_gb", "tierd_run_s", "allgpu_run_s",
              "tierd_diag", "allgpu_diag")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pool-gib", type=int, default=60,
                    help="host pool (5B: 70 GB of weights and state and the first step's "
                         "20 GB of fp32 gradients; what does not fit spills to NVMe; the "
                         "H200 host page-locks at most ~70 GiB)")
    ap.add_argument("--nvme-gib", type=int, default=48)
    ap.add_argument("--case", default="", help="only the cases whose name contains this "
                    "(e.g. 'cap 48 GB': a quick re-run of one case, not the README table)")
    ap.add_argument("--only", default="", help="comma-separated model shapes (1.3B,5B), "
                    "run in this process")
    ap.add_argument("--trace", action="store_true", help="write each tierd case's profiled "
                    "step (host and device) as CASE.trace.json.gz")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny model")
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    args = ap.parse_args(argv)
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("tierd.placement").setLevel(logging.DEBUG)   # each plan, to stderr
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.seq, args.steps, args.warmup, args.pool_gib, args.nvme_gib = 16, 2, 3, 1, 1
        rows, bandwidth = measure(args, [c for c in TINY if args.case in c[0]], device)
    elif args.only:
        rows, bandwidth = measure(args, [c for c in CASES if c[1] in args.only.split(",")
                                         and args.case in c[0]], device)
    else:
        rows, bandwidth = measure_apart(args, list(dict.fromkeys(
            c[1] for c in CASES if args.case in c[0])))
        rows += [{"case": c, "error": why, **{k: None for k in ROW_FIELDS}}
                 for c, why in UNRUN.items()]
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    result = {"commit": commit, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "both_ways_bandwidth_gbps": bandwidth / GB,
              "rows": rows}
    (args.out / "placement.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'case':40} {'all-GPU s':>9} {'tierd s':>8} {'ratio':>6} {'floor s':>8} "
          f"{'run ratio':>9} {'peak GB':>8} {'in GB':>6} {'out GB':>6}")
    for r in rows:
        def ratio(a, b):
            return r.get(a) / r.get(b) if r.get(a) and r.get(b) else None
        fmt = lambda v, f: "-" if v is None else format(v, f)   # noqa: E731
        print(f"{r['case']:40} {fmt(r['allgpu_s'], '9.4f')} {fmt(r['tierd_s'], '8.4f')} "
              f"{fmt(ratio('tierd_s', 'allgpu_s'), '6.2f')} {fmt(r['floor_s'], '8.4f')} "
              f"{fmt(ratio('tierd_run_s', 'allgpu_run_s'), '9.2f')} "
              f"{fmt(r['tierd_peak_gb'], '8.1f')} "
              f"{fmt(r['pcie_in_gb'], '6.2f')} {fmt(r['pcie_out_gb'], '6.2f')}")

if __name__ == "__main__":
    main()
