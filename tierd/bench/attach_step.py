"""tierd.attach vs all-on-GPU: train step and forward of GPT-2 1.3B, side by side.

    python -m tierd.bench.attach_step                 # 24 layers, d=2048, T=1024, B=8 and 16
    python -m tierd.bench.attach_step --layers 4      # smaller, same shape per layer

Both runs use bf16 autocast; the reference keeps fp32 params, grads and a
fused torch AdamW on the GPU; tierd keeps everything in its pool (bf16
compute copies, fp32 masters and moments) with a GPU budget of a few blocks.
Prints per-step seconds, ratios, bytes each way per step and the share of the
step spent in tierd's hooks and requests (``session.stats()``).

What was predicted before this benchmark first ran, and measured then:
``benchmarks/results/HISTORY.md``, "The PCIe floor (tierd.bench.attach_step)".
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.embedded import start_daemon


def build(layers: int, d: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=d // 128, n_positions=seq,
                     vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).train()


def timed(fn, steps: int, warmup: int) -> list[float]:
    out = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def train_step(model, opt, ids):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def forward(model, ids):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(input_ids=ids)


def back_to_back(fn, steps: int) -> float:
    """Mean seconds per step over ``steps`` run with no synchronize between
    them, as a training loop runs (copies still landing overlap the next step)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of spans."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_slices(spans: list[tuple[float, float]], start: float, end: float,
                n: int) -> list[float]:
    """The fraction of each of ``n`` equal slices of [start, end) that a
    union of ``spans`` covers.

    >>> busy_slices([(0.0, 1.0), (3.0, 3.5)], 0.0, 4.0, 4)
    [1.0, 0.0, 0.0, 0.5]
    """
    width = (end - start) / n
    return [round(_overlap(spans, [(start + i * width, start + (i + 1) * width)]) / width, 2)
            for i in range(n)]


def stream_summary(trace: dict, slices: int = 20) -> dict:
    """Where the compute stream's time went in a profiled step (seconds).

    The compute stream is the one with the most kernel time. Its idle time
    inside its first-to-last kernel is split by what PCIe was doing then:
    ``idle_h2d``: a copy in was running (the step waited for bytes);
    ``idle_d2h``: only a copy out was running; ``idle_none``: no copy either
    (the GPU waited for the host: hooks, requests, launches).
    ``timeline``: that window cut in ``slices`` equal parts, each
    ``[compute, h2d, d2h]``, the fraction of it each was busy: when in the
    step a copy engine idles (a forward starved of bytes, copies out left
    for the end of backward). ``backward_at``: where in that window the
    backward began (its first loss-gradient kernel), as a fraction, or None.
    """
    by_stream: dict[int, list] = {}
    h2d, d2h = [], []
    backward = float("inf")
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)
        if "nll_loss_backward" in e["name"]:
            backward = min(backward, span[0])
        if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]:
            h2d.append(span)
        elif e["cat"] == "gpu_memcpy" and "DtoH" in e["name"]:
            d2h.append(span)
        else:
            by_stream.setdefault(e.get("args", {}).get("stream", -1), []).append(span)
    stream = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))
    busy = _union(by_stream[stream])
    start, end = busy[0][0], busy[-1][1]
    idle = [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] > a[1]]
    h2d, d2h = _union(h2d), _union(d2h)
    idle_h2d = _overlap(idle, h2d)
    idle_any = _overlap(idle, _union(h2d + d2h))
    return {"window_s": end - start,
            "compute_busy_s": sum(b - a for a, b in busy),
            "idle_h2d_s": idle_h2d,
            "idle_d2h_s": idle_any - idle_h2d,
            "idle_none_s": sum(b - a for a, b in idle) - idle_any,
            "h2d_busy_s": sum(b - a for a, b in h2d),
            "d2h_busy_s": sum(b - a for a, b in d2h),
            "timeline": [list(x) for x in zip(*(busy_slices(spans, start, end, slices)
                                                for spans in (busy, h2d, d2h)))],
            "backward_at": (round((backward - start) / (end - start), 3)
                            if start <= backward < end else None)}


def profile(fn, keep: Path | None = None, steps: int = 1) -> dict:
    """Run ``fn`` ``steps`` times back to back under the CUDA profiler (one
    synchronize, at the end); :func:`stream_summary` of it, per step.
    ``keep``: also profile the host's ops and write the trace there, gzipped."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if keep else [])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    if keep is not None:
        with gzip.open(keep, "wt") as out:
            json.dump(trace, out)
    return {k: v if k in ("timeline", "backward_at") or v is None else v / steps
            for k, v in stream_summary(trace).items()}


def phases(model, opt, ids) -> dict:
    """Seconds of forward, backward and step() each, synchronized between."""
    out = {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    torch.cuda.synchronize()
    out["forward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss.backward()
    torch.cuda.synchronize()
    out["backward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    out["step_s"] = time.perf_counter() - t0
    return out


def run_reference(cpu_model, batches, seq, steps, warmup) -> dict:
    model = copy.deepcopy(cpu_model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    out = {}
    for b in batches:
        ids = torch.randint(0, 50257, (b, seq), device="cuda")
        out[("step", b)] = statistics.median(timed(lambda: train_step(model, opt, ids),
                                                   steps, warmup))
        out[("run", b)] = back_to_back(lambda: train_step(model, opt, ids), steps)
        out[("phases", b)] = phases(model, opt, ids)
    ids = torch.randint(0, 50257, (min(batches), seq), device="cuda")
    out[("fwd", min(batches))] = statistics.median(timed(lambda: forward(model, ids),
                                                         steps, warmup))
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_tierd(cpu_model, batches, seq, steps, warmup, args) -> dict:
    daemon = start_daemon(pool=args.pool_gib << 30, nvme_size=args.nvme_gib << 30)
    try:
        t0 = time.perf_counter()
        block = sum(p.numel() for p in cpu_model.transformer.h[0].parameters()) * 2
        model = attach(copy.deepcopy(cpu_model), client=tierd.connect(daemon.socket),
                       compute_dtype="bf16", gpu_budget_bytes=args.budget_blocks * block,
                       prefetch_bytes=args.budget_blocks * block,
                       gpu_memory_bytes=0)   # the streaming path: nothing placed on the GPU
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-4,
                                prefetch_bytes=args.state_blocks * block * 6)
        session = session_of(model)
        print(f"attach + optimizer setup {time.perf_counter() - t0:.1f} s; held "
              f"{session.stats()['held_bytes'] / 1e9:.1f} GB; budget {args.budget_blocks} "
              f"blocks = {args.budget_blocks * block / 1e9:.2f} GB", flush=True)
        out = {}
        for b in batches:
            ids = torch.randint(0, 50257, (b, seq), device="cuda")
            before = session.stats()
            times = timed(lambda: train_step(model, opt, ids), steps, warmup)
            after = session.stats()
            n = steps + warmup
            out[("step", b)] = statistics.median(times)
            out[("stats", b)] = {k: (after[k] - before[k]) / n for k in
                                 ("hook_seconds", "optimizer_seconds", "wait_seconds",
                                  "requests",
                                  "h2d_bytes", "d2h_bytes")}
            torch.cuda.reset_peak_memory_stats()
            train_step(model, opt, ids)
            out[("peak", b)] = torch.cuda.max_memory_allocated()
            out[("run", b)] = back_to_back(lambda: train_step(model, opt, ids), steps)
            out[("phases", b)] = phases(model, opt, ids)
            out[("streams", b)] = profile(lambda: train_step(model, opt, ids))
        b = min(batches)
        ids = torch.randint(0, 50257, (b, seq), device="cuda")
        before = session.stats()
        out[("fwd", b)] = statistics.median(timed(lambda: forward(model, ids), steps, warmup))
        after = session.stats()
        out[("fwd_streams", b)] = profile(lambda: forward(model, ids))
        out[("fwd_stats", b)] = {k: (after[k] - before[k]) / (steps + warmup)
                                 for k in ("hook_seconds", "requests", "h2d_bytes")}
        return out
    finally:
        daemon.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-blocks", type=int, default=4)
    ap.add_argument("--state-blocks", type=int, default=4,
                    help="optimizer state in flight, in blocks of fp32 master+m+v")
    ap.add_argument("--pool-gib", type=int, default=40)
    ap.add_argument("--nvme-gib", type=int, default=16)
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    cpu_model = build(args.layers, args.d, args.seq)
    n = sum(p.numel() for p in cpu_model.parameters())
    print(f"GPT-2 {n / 1e9:.2f}B params, {args.layers} layers, d={args.d}, T={args.seq}",
          flush=True)
    ref = run_reference(cpu_model, batches, args.seq, args.steps, args.warmup)
    print("reference:", {f"{k[0]}@B{k[1]}": round(v, 4) for k, v in ref.items()
                        if isinstance(v, float)}, flush=True)
    got = run_tierd(cpu_model, batches, args.seq, args.steps, args.warmup, args)
    print(f"\n{'what':<14}{'all-GPU s':>10}{'tierd s':>10}{'ratio':>8}"
          f"{'H2D GB':>9}{'D2H GB':>9}{'hook %':>8}{'req':>6}{'peak GB':>9}")
    for b in batches:
        s = got[("stats", b)]
        step = got[("step", b)]
        print(f"{'step B=' + str(b):<14}{ref[('step', b)]:>10.4f}{step:>10.4f}"
              f"{step / ref[('step', b)]:>8.2f}{s['h2d_bytes'] / 1e9:>9.2f}"
              f"{s['d2h_bytes'] / 1e9:>9.2f}{100 * s['hook_seconds'] / step:>8.1f}"
              f"{s['requests']:>6.0f}{got[('peak', b)] / 1e9:>9.1f}")
        print(f"{'':<14}optimizer launch share {100 * s['optimizer_seconds'] / step:.1f} %; "
              f"hook excl. optimizer {100 * (s['hook_seconds'] - s['optimizer_seconds']) / step:.1f} %; "
              f"hook less waits {100 * (s['hook_seconds'] - s['wait_seconds']) / step:.1f} %")
        run = got[("run", b)]
        print(f"{'':<14}back to back (no sync between steps): all-GPU {ref[('run', b)]:.4f} s, "
              f"tierd {run:.4f} s, ratio {run / ref[('run', b)]:.2f}")
        print(f"{'':<14}phases all-GPU {_fmt(ref[('phases', b)])}; tierd {_fmt(got[('phases', b)])}")
        print(f"{'':<14}compute stream (profiled step): {_fmt(got[('streams', b)])}")
    b = min(batches)
    s = got[("fwd_stats", b)]
    fwd = got[("fwd", b)]
    print(f"{'fwd B=' + str(b):<14}{ref[('fwd', b)]:>10.4f}{fwd:>10.4f}"
          f"{fwd / ref[('fwd', b)]:>8.2f}{s['h2d_bytes'] / 1e9:>9.2f}{0:>9.2f}"
          f"{100 * s['hook_seconds'] / fwd:>8.1f}{s['requests']:>6.0f}")
    print(f"{'':<14}compute stream (profiled forward): {_fmt(got[('fwd_streams', b)])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args),
                       "reference": {f"{k[0]}@B{k[1]}": v for k, v in ref.items()},
                       "tierd": {f"{k[0]}@B{k[1]}": v for k, v in got.items()}}, f, indent=1)


def _fmt(d: dict) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in d.items())


if __name__ == "__main__":
    main()
