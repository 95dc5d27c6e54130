"""Sections 3-5: training step, forward only, control-plane share.

Every case runs in a ``tierd.bench.worker`` child process (own CUDA context and
peak-memory counters, killed at its timeout). One worker per system serves
all three sections: e.g. the tierd worker trains at each batch size, does one
profiled step (PCIe bytes) and one instrumented step (hook time), then runs
the forward-only case on the same attached model.
"""

from __future__ import annotations

import importlib.util

from tierd.bench import models
from tierd.bench.common import GB, Context, Skip, fmt_bytes, row, run_worker

#: step time over the all-on-GPU reference that tierd is held to
TRAIN_TARGETS = {8: 1.5, 16: 1.15}
FORWARD_TARGET = 1.10
CONTROL_TARGET = 0.03


def need(ctx: Context, *modules: str, cuda: bool = True) -> None:
    if cuda and not ctx.cuda:
        raise Skip("needs CUDA")
    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise Skip(f"needs the {m} package")


def peer_missing(name: str) -> str | None:
    """Why peer ``name`` (fsdp2, accelerate) cannot run here, or None if it can."""
    if name == "accelerate" and importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed (pip install accelerate, or 'tierd[bench]')"
    if name == "fsdp2":
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: F401
        except ImportError:
            import torch
            return (f"FSDP2 (fully_shard, CPUOffloadPolicy) is not in torch {torch.__version__} "
                    "(it needs torch >= 2.6 with torch.distributed)")
    return None


def measured(ctx: Context, names: tuple[str, ...]) -> tuple[dict, list[dict]]:
    """Each system's worker result, and a skipped row for each peer that cannot run here."""
    results, skipped = {}, []
    for name in names:
        why = peer_missing(name)
        if why is None:
            results[name] = worker(ctx, name)
        else:
            skipped.append(row(SYSTEMS[name], "not measured", skipped=why))
    return results, skipped


def gpu_budget(ctx: Context) -> int:
    return 256 << 10 if "tiny" in ctx.model else 1 << 30


def _spec(ctx: Context, mode: str, **over) -> dict:
    s = ctx.sizes
    spec = dict(mode=mode, model=ctx.model, seq=s.seq, batches=list(s.batches),
                forward_batch=0, steps=s.train_steps, warmup=s.warmup_steps,
                profile=mode != "gpu", instrument=False, gpu_budget=gpu_budget(ctx))
    if mode == "tierd":
        spec["socket"] = str(ctx.start_daemon().socket)
    spec.update(over)
    return spec


def worker(ctx: Context, name: str, **over) -> dict:
    """The result of worker ``name`` (gpu, tierd, fsdp2, accelerate), run once per run."""
    cache = ctx.results.setdefault("_workers", {})
    if name not in cache:
        wants_forward = "forward" in ctx.selected
        if name == "accelerate":
            over = {"batches": [], "forward_batch": ctx.sizes.batches[0], **over}
        elif name in ("gpu", "tierd") and wants_forward:
            over = {"forward_batch": ctx.sizes.batches[0], **over}
        if name == "tierd" and "control" in ctx.selected:
            over = {"instrument": True, **over}
        cache[name] = run_worker(ctx, _spec(ctx, name, **over))
    return cache[name]


def config_text(ctx: Context, b: int, extra: str) -> str:
    return f"{models.describe(ctx.model)}, B={b}, T={ctx.sizes.seq}, {extra}"


SYSTEMS = {
    "gpu": "all on GPU (reference)",
    "tierd": "tierd, everything offloaded",
    "fsdp2": "FSDP2 CPUOffloadPolicy",
    "accelerate": "accelerate cpu_offload",
}
TRAIN_CONFIG = {
    "gpu": "bf16 autocast, fp32 params, torch AdamW(fused=True)",
    "tierd": "bf16 autocast, attach(compute_dtype=bf16, gpu_budget_bytes={budget}), "
             "tierd.optim.AdamW (gpu-stream), pool in host memory",
    "fsdp2": "bf16 autocast, fully_shard per block + root, CPUOffloadPolicy(pin_memory=True), "
             "world size 1, torch AdamW on CPU",
}


def _error_row(what: str, result: dict) -> dict:
    return row(what, "failed", error=result["error"], log=result.get("log", ""))


def train_rows(ctx: Context) -> list[dict]:
    need(ctx, "transformers")
    results, rows = measured(ctx, ("gpu", "tierd", "fsdp2"))
    for b in ctx.sizes.batches:
        ref = results["gpu"].get("train", {}).get(str(b))
        for name, res in results.items():
            what = f"train step B={b}: {SYSTEMS[name]}"
            if "error" in res or str(b) not in res.get("train", {}):
                rows.append(_error_row(what, res if "error" in res else
                                       {"error": res.get("partial", "not measured")}))
                continue
            r = res["train"][str(b)]
            cfg = config_text(ctx, b, TRAIN_CONFIG[name].format(
                budget=fmt_bytes(res.get("gpu_budget", 0))))
            figures = dict(step_s=r["step_s"], tokens_per_s=r["tokens_per_s"],
                           peak_gpu_bytes=r.get("peak_gpu_bytes"),
                           h2d_bytes=r.get("h2d_bytes", 0), d2h_bytes=r.get("d2h_bytes", 0),
                           steps_s=r["steps_s"], params=res["params"])
            if res.get("partial"):
                figures["partial"] = res["partial"]
            if ref:
                figures["ratio"] = r["step_s"] / ref["step_s"]
                figures["limit"] = "all-on-GPU step"
            if name == "tierd" and b in TRAIN_TARGETS:
                figures["target"] = TRAIN_TARGETS[b]
            if name == "tierd" and ref:
                figures["bound"] = bound(ctx, r, ref["step_s"], TRAIN_TARGETS.get(b))
            rows.append(row(what, cfg, **figures))
    return rows


def forward_rows(ctx: Context) -> list[dict]:
    need(ctx, "transformers")
    b = ctx.sizes.batches[0]
    results, rows = measured(ctx, ("gpu", "tierd", "accelerate"))
    ref = results["gpu"].get("forward")
    cfgs = {"gpu": "model.to(bf16), all on GPU",
            "tierd": "bf16 weights streamed from the pool (same attached model as training)",
            "accelerate": "model.to(bf16) on CPU, accelerate.cpu_offload(execution_device=cuda)"}
    for name, res in results.items():
        what = f"forward B={b}: {SYSTEMS[name]}"
        if "error" in res or "forward" not in res:
            rows.append(_error_row(what, res if "error" in res else
                                   {"error": res.get("partial", "no forward measured")}))
            continue
        r = res["forward"]
        figures = dict(step_s=r["step_s"], tokens_per_s=r["tokens_per_s"],
                       peak_gpu_bytes=r.get("peak_gpu_bytes"), h2d_bytes=r.get("h2d_bytes", 0),
                       d2h_bytes=r.get("d2h_bytes", 0), steps_s=r["steps_s"])
        if ref:
            figures.update(ratio=r["step_s"] / ref["step_s"], limit="all-on-GPU forward")
        if name == "tierd":
            figures["target"] = FORWARD_TARGET
            if ref:
                figures["bound"] = bound(ctx, r, ref["step_s"], FORWARD_TARGET)
        rows.append(row(what, config_text(ctx, b, cfgs[name] + ", torch.no_grad"), **figures))
    return rows


def control_rows(ctx: Context) -> list[dict]:
    need(ctx, *(() if ctx.model == "torch-tiny" else ("transformers",)), cuda=False)
    b = ctx.sizes.batches[0]
    res = worker(ctx, "tierd", instrument=True)
    what = f"tierd hooks + requests, share of step B={b}"
    if "error" in res:
        return [_error_row(what, res)]
    c = res.get("train", {}).get(str(b), {}).get("control")
    if c is None:
        return [_error_row(what, {"error": res.get("partial", "not measured")})]
    return [row(what, config_text(ctx, b, c["method"]), share=c["control_share"],
                hook_share=c["hook_share"], hook_s=c["hook_s"],
                wait_s=c.get("wait_s"), hook_work_share=c.get("hook_work_share"),
                request_s_outside_hooks=c["request_s_outside_hooks"],
                hook_calls=c["hook_calls"], requests=c["requests"],
                instrumented_step_s=c["step_s"], target_max=CONTROL_TARGET,
                note="host wall time; hook time includes waits inside hooks "
                     "(lease replies, copy events at the end of backward)")]


def bound(ctx: Context, r: dict, ref_s: float, target: float | None) -> str:
    """Which resource limits a tierd step: PCIe bytes at the measured pinned
    bandwidth against the reference's (compute) time."""
    lim = {x["what"]: x.get("GBps") for x in ctx.results.get("limits", {}).get("rows", [])}
    h2d_bw, d2h_bw = lim.get("pinned host->GPU"), lim.get("pinned GPU->host")
    both_bw = lim.get("pinned both ways at once")
    h2d, d2h = r.get("h2d_bytes", 0), r.get("d2h_bytes", 0)
    if not (h2d_bw and d2h_bw and both_bw) or not (h2d or d2h):
        return "unknown: limits or PCIe bytes not measured in this run"
    pcie = max(h2d / GB / h2d_bw, d2h / GB / d2h_bw, (h2d + d2h) / GB / both_bw)
    step = r["step_s"]
    head = (f"PCIe {h2d / GB:.1f} GB in + {d2h / GB:.1f} GB out per step needs >= "
            f"{pcie:.3f} s at the measured pinned bandwidth; reference compute {ref_s:.3f} s; "
            f"measured {step:.3f} s")
    if target is None or step <= target * ref_s:
        return head + (" (meets target)" if target else "")
    if pcie > target * ref_s:
        return head + f": PCIe-bound, the bytes alone exceed the target {target * ref_s:.3f} s"
    if pcie + ref_s > target * ref_s:
        return head + (": bound by PCIe + compute not overlapping (their sum "
                       f"{pcie + ref_s:.3f} s exceeds the target {target * ref_s:.3f} s)")
    return head + (": neither PCIe nor compute; the gap "
                   f"{step - max(pcie, ref_s):.3f} s is host-side (hooks, requests, waits)")
