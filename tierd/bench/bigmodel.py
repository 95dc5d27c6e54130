"""8B and 13B Llama, T=2048, one GPU: tierd vs DeepSpeed ZeRO-3 offload vs FSDP2 CPU offload.

    python -m tierd.bench.bigmodel --out DIR                        # 8B and 13B, every system
    python -m tierd.bench.bigmodel --out DIR --systems tierd --models 8B --batch 8,4
    python -m tierd.bench.bigmodel --out DIR --largest --systems fsdp2 --ladder 16,20,24,28
    python -m tierd.bench.bigmodel --out DIR --tiny                 # CPU smoke run, same code

On a machine whose commands may run 10 minutes, run slices into one DIR (each
call merges into ``DIR/bigmodel.json``); ``--budget-s`` starts an attempt only
if its whole ``--timeout`` still fits, e.g.:

    python -m tierd.bench.bigmodel --out /tmp/sanity --models tiny --batch 2 --timeout 240
    python -m tierd.bench.bigmodel --out DIR --systems tierd --models 8B --batch 8 --timeout 540
    python -m tierd.bench.bigmodel --out DIR --systems deepspeed --models 8B,13B --batch 8 \
        --timeout 260 --budget-s 540
    python -m tierd.bench.bigmodel --out DIR --largest --systems tierd --ladder 48,64,72,80 \
        --ladder-from 64 --timeout 540 --budget-s 550   # one rung; the next call: --ladder-from 72

Past the pool (L64, L80: the NVMe regime), one call per row into one DIR, each
under 9 minutes (L64 ~6, L80 ~6-7); the first also runs the all-GPU reference
that gives both rows' compute floor (``--compute-ref``: L8 at the same width
and batch, ~20 s). The compute copies that no step reads leave the pool from
the third updating step on ([Note: cold tensors go first] in
``tierd.server.eviction``), over a few steps: L64 at a2b664c still moved 11.7
and 3.5 GB each way through NVMe at its steps 4 and 5 (0 must), hence six
warm-up steps there:

    python -m tierd.bench.bigmodel --out DIR --systems tierd --models L64 --batch 4 \
        --warmup 6 --steps 2 --compute-ref L8 --timeout 480 --budget-s 560
    python -m tierd.bench.bigmodel --out DIR --systems tierd --models L80 --batch 4 \
        --warmup 3 --steps 2 --timeout 500 --budget-s 560

Compact optimizer state (issue 34): ``--optimizer-state`` gives tierd's rows
``tierd.optim.AdamW(state=, master=)`` and ``attach(optimizer_state=...)``
with the settings of ``tierd.bench.compact`` (fp32, bf16, 8bit, 8bit-bf16);
several, comma-separated, are rows of their own, recorded with the setting
(``optimizer_state``) and the bytes it keeps at rest per trained parameter
(``bytes_per_param``). Calls of under 9 minutes each (the compute references
under 2):

    python -m tierd.bench.bigmodel --out DIR --systems tierd --models 13B --batch 4 \
        --optimizer-state fp32,8bit-bf16 --timeout 260 --budget-s 540
    python -m tierd.bench.bigmodel --out DIR --systems tierd --models L156 --batch 1 \
        --optimizer-state 8bit-bf16 --warmup 1 --steps 2 --timeout 520 --budget-s 540
    python -m tierd.bench.bigmodel --out DIR --systems allgpu --models 13B-L8 --batch 4 \
        --disk-probe-gib 0 --timeout 90     # the 13B rows' compute floor (~40 s)
    python -m tierd.bench.bigmodel --out DIR --systems allgpu --models L8 --batch 1 \
        --disk-probe-gib 0 --timeout 60     # and L156's (~20 s)

The first is the speed pair at 13B, side by side (the fp32 row at commit
dc858ac: 2.52 s steps at B=4, 3,249 tokens/s, 185 s for the attempt, with
14 B/param of state, 182 GB, of which what the GPU cannot hold streams;
8bit-bf16 keeps 4.03 B/param, 52 GB, which the GPU holds whole). The second
is the largest compact rung. The estimate: 8bit-bf16 keeps 2 B (the bf16
copy is the master) + 2 x 1.016 B (8-bit moments and their block scales) =
4.03 B per parameter at rest, so the GPU's ~115 GB left after B=1
activations, the update window and the margin hold ~28B parameters and the
store the rest: L156 (35.1B, 141 GB at rest) fits at rest. Its first step
streams everything and sums every gradient in the store before the first
update ([Note: placing before the first update] in tierd.client.placer;
``StoreNeed.first_step`` in tierd.client.capacity), in the master's dtype
([Note: the stored gradient's dtype] in tierd.client.tiered_param): 2 + 2 =
4 B per parameter, 140 GB at L156, against the pool (113 GB on the H200)
and the NVMe file (the 64 GiB disk, less what else is on it) together.
With fp32 gradients that step needed 6 B per parameter, 210 GB, and L96
(22.0B) was the largest rung expected. Expected time: the build and attach
~1.5 minutes (70 GB made on the GPU, then copied to the store), the first
step 1.5-3 minutes (70 GB read in each direction of the model, checkpointed,
70 GB of gradients written, ~30 GB of it past the pool), then steps of
~10-30 s with ~28B parameters resident.

Exact AdamW at 13B already steps near its compute floor (the state it
streams hides under the backward), so what compact state frees is memory:
enough, at 13B, for the activations of every layer (``--checkpointing
off``: no recompute, a quarter less compute), which exact state cannot
also keep on the GPU. Each setting at each choice is a row of its own:

    python -m tierd.bench.bigmodel --out DIR --systems tierd --models 13B --batch 4 \
        --optimizer-state 8bit-bf16,fp32 --checkpointing off --timeout 260 --budget-s 540
    python -m tierd.bench.bigmodel --out DIR --systems allgpu --models 13B-L8 --batch 4 \
        --checkpointing off --disk-probe-gib 0 --timeout 90   # their compute floor

Each tierd row says its floor ([Note: a row's floor] in
``tierd.bench.bigmodel_floor``): ``floor_s``, ``binding`` (compute, pcie or
nvme), ``target_s`` (1.25x the floor), ``to_floor`` (step / floor), the
parts (``compute_s``, ``pcie_s``, ``nvme_s``, ``nvme_must_cross_gb``) and
what the daemon moved, ``nvme_read_gb`` / ``nvme_write_gb`` per step (median
of the measured steps; every step's in ``traffic``). A call with tierd in it
first probes the disk under ``--cache-dir`` (where the daemon's NVMe files
go) for its mixed read + write bandwidth (``tierd.bench.nvme.mixed_probe``,
``--disk-probe-gib`` each way; ~5 s); the file's ``disk`` is the last probe.

Models are ``LlamaForCausalLM`` from config with random weights (names in
``tierd.bench.bigmodel_models``: 8B, 13B, L<layers> at the 8B width), sdpa
attention, activation checkpointing, bf16 compute, labels = inputs (random
values drawn each system's own way: speed does not depend on them). Systems
(``tierd.bench.bigmodel_systems``): ``tierd`` (built on the GPU in bf16, then
``attach(model, compute_dtype="bf16")`` with default arguments and
``tierd.optim.AdamW``), ``deepspeed`` (ZeRO-3, parameters and optimizer
offloaded to pinned CPU memory, DeepSpeedCPUAdam), ``fsdp2`` (``fully_shard``
per layer and root, ``CPUOffloadPolicy(pin_memory=True)``, bf16 params / fp32
reduce, torch's CPU AdamW). Every attempt (system, model, batch) runs in a
fresh process, world size 1, watched by this one (``bigmodel_attempt``): killed
past ``--timeout`` or when the machine's available memory falls under
``--host-floor-gib``. Batches are tried from the largest down; the first that
completes its steps is the row's, the ones that ran out of GPU memory are in
its ``notes``. ``--largest`` walks ``--ladder`` (layer counts at the 8B width)
upward per system until the first model that fails, a row per model.

Figures: ``step_s`` the median of the measured steps (CUDA-synchronised,
after ``--warmup``); ``tokens_per_s`` = B*T / step_s; ``tflops`` = model FLOPs
per second, 6 per matmul parameter per token (every parameter but the input
embedding, a table lookup) plus 12*layers*hidden*T for attention; the
recompute of activation checkpointing is NOT counted (the GPU does about 4/3
of that work). ``peak_gpu_gb`` = ``max_memory_allocated`` during the steps
(and ``peak_gpu_reserved_gb``; ``setup_peak_gpu_gb`` while the system built
the model); ``peak_host_gb`` = the machine's used memory at its
peak during the attempt minus before it (the daemon's pool and every pinned
buffer included).

``DIR/bigmodel.json``: ``{"commit", "device", "rows": [{"model", "system",
"params", "batch", "tokens_per_s", "tflops", "peak_gpu_gb", "peak_host_gb",
"error", "optimizer_state", "checkpointing", ...}], "largest": {"tierd", "deepspeed", "fsdp2"},
"largest_tierd": {setting: params}}`` (``largest``: the parameters of the
largest model each system completed with fp32 AdamW, None if none;
``largest_tierd``: tierd's per optimizer state). An existing file is merged
into: a new row replaces the row of the same model, system and optimizer
state; so slices of the work can run as separate calls. Each attempt's
output is in ``DIR/logs/``.

What was predicted before this benchmark first ran, and measured then:
``benchmarks/results/HISTORY.md``, "8B, 13B and the largest model (tierd.bench.bigmodel)".
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tierd.bench import bigmodel_results as results
from tierd.bench.bigmodel_attempt import GiB, Watch, run_attempt, sweep_scratch
from tierd.bench.bigmodel_models import rung_name, shape_of
from tierd.bench.bigmodel_systems import OPTIMIZER_STATES, PEERS, SYSTEMS, RunSpec


class Budget:
    """The call's time: an attempt starts only if its whole ``--timeout`` fits in
    what is left, so a row that says "ran past its limit" always means the
    attempt needed more than ``--timeout``, never that the call ran short."""

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else time.monotonic() + seconds

    def timeout(self, wanted: float) -> float | None:
        """``wanted`` if that much time is left, else None."""
        if self.deadline is None or self.deadline - time.monotonic() >= wanted:
            return wanted
        return None


def best_batch(system: str, model: str, args, attempt, optimizer_state: str = "fp32") -> dict:
    """Try ``args``'s batches for ``system`` from the largest down; the row of
    the first that completes, or of the last failure. ``attempt(spec, timeout)``
    runs one (``run_attempt`` bound to the watch, or a fake in tests)."""
    notes, row = [], None
    for batch in sorted(args.batches[system], reverse=True):
        timeout = args.budget.timeout(args.timeout)
        if timeout is None:
            notes.append(f"B={batch}: not run, the call's --budget-s was spent")
            return results.not_run(model, system, args.seq, "not run: the call's --budget-s "
                                   "was spent", notes, optimizer_state, args.checkpointing)
        spec = RunSpec(system=system, model=model, batch=batch, seq=args.seq,
                       warmup=args.warmup, steps=args.steps, device=args.device,
                       tierd_pool_bytes=args.tierd_pool, tierd_nvme_bytes=args.tierd_nvme,
                       optimizer_state=optimizer_state, checkpointing=args.checkpointing)
        raw = attempt(spec, timeout)
        row = results.row(spec, raw, args.commit, notes, args.disk)
        print(results.line(row), flush=True)
        if row["error"] is None or not raw.get("oom_in_step"):
            return row
        notes.append(f"B={batch}: out of GPU memory ({raw.get('phase')})")
    row["error"] = f"out of GPU memory at every batch tried; last: {row['error']}"
    return row


def climb(system: str, rungs: list[str], run_model) -> list[dict]:
    """The ladder for one system: each rung's row, up to and including the
    first that fails (``run_model(system, model) -> row``)."""
    rows = []
    for model in rungs:
        row = run_model(system, model)
        rows.append(row)
        if row["error"] is not None:
            break
    return rows


def probe_disk(args) -> dict | None:
    """The mixed read + write bandwidth of the disk under ``--cache-dir`` (for
    tierd's NVMe floor), or None when tierd is not in this call or the probe
    is off (``--disk-probe-gib 0``)."""
    if "tierd" not in args.systems or not args.disk_probe_gib:
        return None
    from tierd.bench.nvme import MiB, mixed_probe
    nbytes = max(8 * MiB, int(args.disk_probe_gib * GiB) // (8 * MiB) * (8 * MiB))
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bigmodel-disk-probe-", dir=args.cache_dir))
    try:
        disk = mixed_probe(work, nbytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"disk under {args.cache_dir}: write {disk['write_GBps']:.2f}, read "
          f"{disk['read_GBps']:.2f}, mixed {disk['mixed_each_way_GBps']:.2f} GB/s each way "
          f"({'O_DIRECT' if disk['direct_io'] else 'buffered'})", flush=True)
    return disk


def measure(args, record) -> None:
    """Every row this call asks for, each handed to ``record`` when done."""
    watch = Watch(timeout_s=args.timeout, host_floor_bytes=int(args.host_floor_gib * GiB),
                  log_dir=args.out / "logs", cache_root=args.cache_dir)
    for path in sweep_scratch(args.cache_dir):
        print(f"removed {path}: an earlier call's attempt scratch", file=sys.stderr)

    def run_model(system: str, model: str, state: str = "fp32") -> dict:
        row = best_batch(system, model, args, lambda spec, t: run_attempt(spec, watch, t),
                         state)
        record(row)
        return row

    if args.compute_ref is not None:   # at each batch tierd may run at
        for batch in args.batches["tierd"]:
            at = argparse.Namespace(**{**vars(args), "batches": {"allgpu": [batch]}})
            record(best_batch("allgpu", args.compute_ref, at,
                              lambda spec, t: run_attempt(spec, watch, t)))

    if args.largest:
        rungs = [rung_name(n, args.tiny) for n in args.ladder if n >= args.ladder_from]
        for system in args.systems:
            for state in states(system, args):
                climb(system, rungs, lambda system, model: run_model(system, model, state))
    else:
        for model in args.models:
            for system in args.systems:
                for state in states(system, args):
                    run_model(system, model, state)


def states(system: str, args) -> list[str]:
    """The optimizer states ``system`` runs in this call: ``--optimizer-state``
    for tierd, its own fp32 AdamW for the others."""
    return args.optimizer_states if system == "tierd" else ["fp32"]


def parse_args(argv=None) -> argparse.Namespace:
    doc = __doc__ or ""
    past_the_pool = doc[doc.find("Past the pool"):doc.find("Each tierd row says its floor")]
    ap = argparse.ArgumentParser(prog="python -m tierd.bench.bigmodel",
                                 description=doc.split("\n")[0], epilog=past_the_pool,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="where bigmodel.json and logs/ go")
    ap.add_argument("--systems", default=",".join(PEERS), help="comma-separated, of "
                    f"{', '.join(SYSTEMS)} (default {','.join(PEERS)}; allgpu: everything on "
                    "the GPU, the floor's compute reference)")
    ap.add_argument("--models", default="8B,13B", help="comma-separated: 8B, 13B, L<layers> "
                    "(8B width), tiny (default 8B,13B)")
    ap.add_argument("--batch", default=None, help="batches to try from the largest down, "
                    "every system (default 8,4,2,1; --largest 1; --tiny 2)")
    for s in SYSTEMS:
        ap.add_argument(f"--batch-{s}", default=None, help=f"{s}'s own batches (over --batch)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048)")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured steps (default 2; "
                    "--largest 1)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 3; "
                    "--largest 2)")
    ap.add_argument("--largest", action="store_true", help="walk --ladder per system instead "
                    "of --models, up to the first model that fails")
    ap.add_argument("--ladder", default="24,32,48,64,80,96", help="layer counts at the 8B "
                    "width (8B has 32; each layer is 218M parameters)")
    ap.add_argument("--ladder-from", type=int, default=0, help="start at this rung (layers)")
    ap.add_argument("--timeout", type=float, default=540.0, help="one attempt at most, s "
                    "(default 540)")
    ap.add_argument("--budget-s", type=float, default=None, help="the call's time: an "
                    "attempt starts only if its --timeout fits in what is left (the others "
                    "get a not-run row, which does not replace a measured one)")
    ap.add_argument("--host-floor-gib", type=float, default=3.0, help="kill an attempt when "
                    "the machine's available memory falls under this")
    ap.add_argument("--cache-dir", type=Path, default=_scratch_root(), help="where each "
                    "attempt's scratch goes (tierd's NVMe files: the disk tierd may use), "
                    "removed after it (default $TIERD_NVME, else $XDG_CACHE_HOME or ~/.cache)")
    ap.add_argument("--tierd-pool-gib", type=float, default=None, help="start tierd's daemon "
                    "with this pool (default: the embedded daemon's own sizing)")
    ap.add_argument("--tierd-nvme-gib", type=float, default=None, help="and this NVMe size")
    ap.add_argument("--optimizer-state", default="fp32", help="tierd's AdamW state, "
                    f"comma-separated, each a row of its own: {', '.join(OPTIMIZER_STATES)} "
                    "(as tierd.bench.compact; default fp32, exact AdamW). The other systems "
                    "keep their fp32 AdamW")
    ap.add_argument("--checkpointing", choices=("on", "off"), default="on",
                    help="activation checkpointing of every layer, for every system of the "
                    "call (default on; off keeps activations for backward: no recompute, "
                    "more memory); rows of each sit side by side")
    ap.add_argument("--compute-ref", default=None, metavar="MODEL", help="first run the "
                    "all-GPU reference (system allgpu) on MODEL at each of tierd's batches: "
                    "its row gives the compute part of tierd rows' floors at that width "
                    "(e.g. L8 for the L-rows)")
    ap.add_argument("--disk-probe-gib", type=float, default=None, help="GiB each way of the "
                    "mixed read + write probe of the disk under --cache-dir, run first when "
                    "tierd is in the call (default 2; --tiny 0.0625; 0: no probe)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny model, T=32")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if present (cpu with --tiny)")
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    args = ap.parse_args(argv)
    try:
        return resolve(args)
    except ValueError as exc:
        ap.error(str(exc))


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated whole numbers") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: give numbers >= 1")
    return values


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the mode, and every value checked before anything runs."""
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        raise ValueError(f"--systems: unknown {bad}; use some of {', '.join(SYSTEMS)}")
    args.optimizer_states = list(dict.fromkeys(
        s.strip() for s in args.optimizer_state.split(",") if s.strip()))
    odd = [s for s in args.optimizer_states if s not in OPTIMIZER_STATES]
    if odd or not args.optimizer_states:
        raise ValueError(f"--optimizer-state: unknown {odd}; use some of "
                         f"{', '.join(OPTIMIZER_STATES)}")
    if args.optimizer_states != ["fp32"] and "tierd" not in args.systems:
        raise ValueError(f"--optimizer-state {args.optimizer_state} is tierd's; add tierd to "
                         "--systems (the others keep their own fp32 AdamW)")
    tiny, largest = args.tiny, args.largest
    args.models = ["tiny"] if tiny and args.models == "8B,13B" else \
        [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models + ([args.compute_ref] if args.compute_ref else []):
        shape_of(m)   # an unknown name is refused here
    if args.disk_probe_gib is None:
        args.disk_probe_gib = 0.0625 if tiny else 2.0
    if args.disk_probe_gib < 0:
        raise ValueError(f"--disk-probe-gib {args.disk_probe_gib}: give 0 (no probe) or more")
    args.seq = args.seq or (32 if tiny else 2048)
    args.warmup = args.warmup if args.warmup is not None else (1 if largest or tiny else 2)
    args.steps = args.steps if args.steps is not None else (2 if largest or tiny else 3)
    if args.seq < 1 or args.warmup < 0 or args.steps < 1:
        raise ValueError("--seq and --steps must be >= 1, --warmup >= 0")
    default = "2" if tiny else "1" if largest else "8,4,2,1"
    base = _ints(args.batch or default, "--batch")
    args.batches = {s: _ints(getattr(args, f"batch_{s}"), f"--batch-{s}")
                    if getattr(args, f"batch_{s}") else base for s in SYSTEMS}
    args.ladder = sorted(_ints(args.ladder, "--ladder"))
    if args.tiny and args.ladder == [24, 32, 48, 64, 80, 96]:
        args.ladder = [1, 2, 3]
    args.device = args.device or ("cpu" if tiny else _cuda_or_cpu())
    if args.tiny and args.tierd_pool_gib is None:
        args.tierd_pool_gib, args.tierd_nvme_gib = 0.25, args.tierd_nvme_gib or 0.25
    args.tierd_pool = None if args.tierd_pool_gib is None else int(args.tierd_pool_gib * GiB)
    args.tierd_nvme = None if args.tierd_nvme_gib is None else int(args.tierd_nvme_gib * GiB)
    if args.tierd_nvme is not None and args.tierd_pool is None:
        raise ValueError("--tierd-nvme-gib needs --tierd-pool-gib (the daemon is started "
                         "with both, or with neither by tierd itself)")
    args.checkpointing = args.checkpointing == "on"
    args.budget = Budget(args.budget_s)
    args.disk = None   # the probe's figures, once main has run it
    args.commit = args.commit or _git_commit()
    return args


def _scratch_root() -> Path:
    for var in ("TIERD_NVME", "XDG_CACHE_HOME"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path.home() / ".cache"


def _cuda_or_cpu() -> str:
    """Without creating a CUDA context here: every byte of the GPU is the workers'."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=here)
    return proc.stdout.strip() or None


def main(argv=None) -> int:
    args = parse_args(argv)
    # stopped from outside (a caller's time limit): unwind, so the running
    # attempt is ended and its scratch removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bigmodel.json"
    done: list[dict] = []

    def record(row: dict) -> None:   # written as it goes: a call cut short keeps its rows
        done.append(row)
        merged = results.merge(results.load(path), [row], args.commit)
        if args.disk is not None:
            merged["disk"] = args.disk
        results.save(path, merged)
        mine = next(r for r in merged["rows"] if results.key(r) == results.key(row))
        if mine["system"] == "tierd" and mine["error"] is None:
            print(results.floor_line(mine), flush=True)

    args.disk = probe_disk(args)
    measure(args, record)
    print(results.table(results.load(path)["rows"], done), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
