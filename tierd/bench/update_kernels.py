"""Seconds per billion parameters of one AdamW update, by optimizer state, on one device.

    python -m tierd.bench.update_kernels --out DIR                  # every setting, 10 x 2^27
    python -m tierd.bench.update_kernels --settings 8bit-bf16 --numel 65536 --tensors 2

The update alone, outside any model: ``--tensors`` tensors of ``--numel``
elements each, stored as each setting of ``tierd.bench.compact`` keeps them
(``fp32``: fp32 masters, fp32 gradients and moments; ``bf16`` / ``8bit``:
their moments; ``8bit-bf16``: bf16 weights as masters and bf16 gradients,
[Note: the stored gradient's dtype] in ``tierd.client.tiered_param``), run as
``tierd.optim.AdamW`` runs it: ``fp32`` by torch's fused AdamW kernel on
CUDA (foreach ops elsewhere), a compact setting by
``tierd.optim.compact.adamw_step``, both ``compiled`` (what CUDA runs:
[Note: the compact update compiled on CUDA]) and ``eager`` (the ops the CPU
runs, and CUDA where compiling fails). ``--compiled`` runs the compiled way
on the CPU too (a smoke test of it; tierd never does).

Each row: ``s_per_gparam`` (mean of ``--repeats`` updates after ``--warmup``,
synchronised), ``bytes_per_param`` the stored bytes the update must read and
write (parameter, gradient read, both moments read and written), and
``GBps`` those bytes over the time: how near the update runs to the memory's
bandwidth; ``to_fp32`` the time against the fp32 row's (the reference, in
the same run). Writes ``DIR/update-kernels-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tierd.bench.compact import SETTINGS
from tierd.client.torch_internals import foreach_adamw, fused_adamw
from tierd.optim import compact, compact_compiled

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)


def tensors(setting: str, numel: int, count: int, device: torch.device) -> list[list]:
    """(params, grads, exp_avgs, exp_avg_sqs) as ``setting`` stores them."""
    state, master = SETTINGS[setting]
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    gen = torch.Generator(device).manual_seed(0)
    keep = compact.CompactState(state=state, master=master)
    out: list[list] = [[], [], [], []]
    for _ in range(count):
        p = torch.randn(numel, generator=gen, device=device).to(dtype)
        g = (torch.randn(numel, generator=gen, device=device) * 1e-2).to(dtype)
        m = torch.randn(numel, generator=gen, device=device) * 1e-3
        v = torch.rand(numel, generator=gen, device=device) * 1e-5
        moments = [keep.encode(m, keep.moment_like(p), True),
                   keep.encode(v, keep.moment_like(p), False)]
        for slot, t in zip(out, (p, g, *moments)):
            slot.append(t)
    return out


def update(setting: str, way: str, ts: list[list], step: float, books: dict) -> None:
    """One update of ``ts`` the way ``tierd.optim.AdamW`` runs ``setting``."""
    if setting == "fp32":
        exact = fused_adamw if ts[0][0].is_cuda else foreach_adamw
        exact(*ts, step=step, **HYPER)
        return
    compact.adamw_step(*ts, step=step, **HYPER, books=books,
                       compiled=compact_compiled.adamw_pieces if way == "compiled" else None)


def stored_bytes(ts: list[list]) -> int:
    """Bytes an update reads and writes: the parameter, the gradient (read)
    and both moments, each read and written."""
    size = [sum(t.numel() * t.element_size() for t in slot) for slot in ts]
    return 2 * size[0] + size[1] + 2 * (size[2] + size[3])


def measure(setting: str, way: str, args, device: torch.device) -> dict:
    ts = tensors(setting, args.numel, args.tensors, device)
    params, books, times = args.numel * args.tensors, {}, []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup + args.repeats):
        sync()
        start = time.perf_counter()
        update(setting, way, ts, float(i + 1), books)
        sync()
        times.append(time.perf_counter() - start)
    mean = statistics.fmean(times[args.warmup:])
    per_param = stored_bytes(ts) / params
    return {"setting": setting, "way": way, "params": params,
            "s_per_gparam": mean / (params / 1e9), "bytes_per_param": per_param,
            "GBps": per_param * params / mean / 1e9, "times_s": times}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory of the JSON")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of {', '.join(SETTINGS)} (fp32 is always run: "
                    "the reference)")
    ap.add_argument("--numel", type=int, default=1 << 27, help="elements of each tensor")
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiled", action="store_true",
                    help="run the compiled way on the CPU too (tierd compiles on CUDA only)")
    args = ap.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    odd = [s for s in settings if s not in SETTINGS]
    if odd or not settings:
        ap.error(f"--settings: unknown {odd}; use some of {', '.join(SETTINGS)}")
    if args.numel < 1 or args.numel % compact.BLOCK or args.tensors < 1 or args.repeats < 1 \
            or args.warmup < 0:
        ap.error(f"--numel must be a positive multiple of {compact.BLOCK}, --tensors and "
                 "--repeats >= 1, --warmup >= 0")
    device = torch.device(args.device)
    ways = ["compiled", "eager"] if device.type == "cuda" or args.compiled else ["eager"]
    rows = [measure("fp32", "torch", args, device)]
    for setting in dict.fromkeys(s for s in settings if s != "fp32"):
        rows += [measure(setting, way, args, device) for way in ways]
    for r in rows:
        r["to_fp32"] = r["s_per_gparam"] / rows[0]["s_per_gparam"]
        print(f"{r['setting']:>9} {r['way']:>8}: {r['s_per_gparam']:.4f} s/Gparam, "
              f"{r['bytes_per_param']:.2f} B/param, {r['GBps']:.0f} GB/s, "
              f"{r['to_fp32']:.2f}x fp32")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"device": name, "numel": args.numel, "tensors": args.tensors,
              "warmup": args.warmup, "repeats": args.repeats, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = name.lower().replace(" ", "-") if device.type == "cuda" else "cpu"
    (out / f"update-kernels-{tag}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
