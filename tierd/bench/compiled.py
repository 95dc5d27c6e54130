"""torch.compile on the models people train: tierd vs all-GPU, eager, whole and regional.

    python -m tierd.bench.compiled --out DIR                  # every case below (CUDA)
    python -m tierd.bench.compiled --out DIR --model gpt2-1.3b --compiled whole
    python -m tierd.bench.compiled --out DIR --tiny --device cpu --backend aot_eager

On the H200, three calls of the device machine, each well under its
10-minute limit (estimated before the first run: GPT-2 about 3 minutes,
Llama about 6 in all, most of it inductor compiling, the 8B model's
attaches and its 0.5-1 s steps; about 9-10 minutes of device time)::

    python -m tierd.bench.compiled --out $OUT/gpt2 --model gpt2-1.3b
    python -m tierd.bench.compiled --out $OUT/llama --model llama-8b --compiled eager,regional
    python -m tierd.bench.compiled --out $OUT/llama-whole --model llama-8b --compiled whole
    python -m tierd.bench.compiled --out $OUT/llama13 --model llama-13b --compiled eager,whole

Every row compares tierd with all-GPU run the same way in the same process,
so the rows of a way can be measured in a call of their own. ``--set
KEY=VALUE`` (:mod:`tierd.bench.settings`) runs the tierd rows with an attach
argument besides the case's (``optim.KEY``: the optimizer's), in rows named
for it, e.g. ``--case "cap 100" --compiled regional --set
forward_update_share=0``. Rows are
written as they are measured: a call cut short keeps the rows it finished.

Models are Hugging Face ``transformers`` models built from a config with
random weights (``use_cache=False``: training needs no KV cache, and
Hugging Face's cache code recompiles per layer under ``torch.compile``):

- ``gpt2-1.3b``: ``GPT2LMHeadModel``, 24 x 2048, vocab 50257, B=8, T=1024;
- ``llama-8b``: ``LlamaForCausalLM``, Llama-3-8B's shape (32 x 4096, 8 kv
  heads, vocab 128256), B=2, T=2048, gradient checkpointing; attached with
  the defaults and again capped at 100 GB (``gpu_memory_bytes=100e9``);
- ``llama-13b``: ``LlamaForCausalLM`` in Llama-2-13B's shape (40 x 5120, MLP
  13824, vocab 32000), B=4, T=2048, gradient checkpointing, default attach.
  Its fp32 weights, gradients and AdamW moments do not fit the H200, so its
  all-GPU rows record the error; its target compares tierd compiled with
  tierd eager (``ratio`` stays null there: no reference ran).

Each model runs in a process of its own on CUDA (a process keeps the pool
segments it page-locked). In it, every case is run three ways: ``eager``,
``whole`` (``torch.compile(model)``; tierd: ``torch.compile(tierd.attach(model))``)
and ``regional`` (each block ``.compile()``; tierd: attach, then each block);
all-GPU with fp32 parameters and fused ``torch.optim.AdamW``, tierd with
``attach(model, compute_dtype="bf16")`` (default placement, plus the case's
options) and ``tierd.optim.AdamW``; all under bf16 autocast.

Timing is back to back, as a training loop runs: no synchronization between
steps, one at the end; each step's seconds come from CUDA events recorded on
the compute stream at step boundaries (``perf_counter`` on the CPU). Warm-up
steps (compiling, tierd's measuring and placing) are not timed.

Writes ``DIR/compiled.json``: ``{"commit", "device", "torch", "transformers",
"both_ways_bandwidth_gbps", "args", "rows"}``; a row per case and way:
``case``, ``model`` (class name), ``compiled`` (eager / whole / regional),
``allgpu_s`` and ``tierd_s`` (median step), ``floor_s``, ``ratio`` and
``ratio_to`` (``allgpu`` or ``floor``), ``recompiles`` (frames dynamo
compiled during tierd's timed steps; ``allgpu_recompiles`` likewise),
``graph_breaks`` (counted while tierd's row compiled; ``allgpu_graph_breaks``),
``frames`` (frames dynamo compiled in tierd's row, warm-up included),
``frames_per_step`` (compiled frames one step after the timed ones runs, from
the profiler: 1 where the model compiled into one graph, about one a block
where the forward is split at its blocks; ``allgpu_frames_per_step``), ``peak_gb`` (tierd's
peak allocated over the timed steps; ``allgpu_peak_gb``), ``reserved_gb`` (the
allocator's reserved peak over them) and ``alloc_retries`` (the times it freed
its cache and retried in them, each synchronizing every stream), ``worst_s``,
``replans`` (placement changes in the timed steps), ``planned_pcie_gb``,
``units_by_place`` (the plan's units by place: resident, weights, stream,
cpu; None without a plan) and ``hooked_units`` (units running tierd's hooks,
which break a compiled block: those that stream weights, or whose update
waits for their forward), and ``error`` / ``allgpu_error`` (an
out-of-memory is recorded, not fatal).

``floor_s`` is given where the case is capped or all-GPU does not fit: the
larger of the compute (the all-GPU step compiled the same way; where that
does not fit, tierd's compute-stream busy time in one profiled step) and the
PCIe time of the bytes the plan streams, at the both-ways bandwidth measured
in the same process. ``ratio`` is ``tierd_s`` over ``allgpu_s``, or over
``floor_s`` for those cases.

``--tiny --device cpu --backend aot_eager`` runs tiny GPT-2 and Llama configs
through the same code (the tests do); figures mean something only on a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import tierd
import tierd.optim
from tierd.bench import settings
from tierd.bench.bigmodel_models import BASES, checkpointed, llama_config
from tierd.bench.placement import both_ways_bandwidth
from tierd.bench.steploop import train_step
from tierd.client.attach import attach, detach, session_of
from tierd.client.embedded import start_daemon
from tierd.client.torch_internals import (compiled_regions_run, dynamo_frames_compiled,
                                          dynamo_graph_breaks, dynamo_reset)
from tierd.errors import CapacityError

GB = 1e9
WAYS = ("eager", "whole", "regional")


@dataclass(frozen=True, kw_only=True)
class Model:
    """One benchmark model: a transformers class from a config, and its batch."""

    kind: str            # "gpt2" or "llama"
    layers: int
    hidden: int
    heads: int
    vocab: int
    batch: int
    seq: int
    kv_heads: int = 0    # llama only
    intermediate: int = 0
    checkpointing: bool = False

    def build(self, device: str) -> torch.nn.Module:
        """The model with random weights, fp32, in train mode, on ``device``."""
        torch.manual_seed(0)
        if self.kind == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel
            cfg = GPT2Config(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                             vocab_size=self.vocab, n_positions=self.seq, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                             bos_token_id=0, eos_token_id=0)
            cfg._attn_implementation = "sdpa"
            with torch.device(device):
                model = GPT2LMHeadModel(cfg)
        else:
            from transformers import LlamaForCausalLM
            shape = replace(BASES["tiny"], hidden=self.hidden, intermediate=self.intermediate,
                            layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                            vocab=self.vocab)
            with torch.device(device):
                model = LlamaForCausalLM(llama_config(shape, self.seq))   # use_cache=False
        return checkpointed(model) if self.checkpointing else model.train()


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated decoder blocks (what regional compile compiles one by one)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


MODELS = {
    "gpt2-1.3b": Model(kind="gpt2", layers=24, hidden=2048, heads=16, vocab=50257,
                       batch=8, seq=1024),
    "llama-8b": Model(kind="llama", layers=32, hidden=4096, heads=32, kv_heads=8,
                      intermediate=14336, vocab=128256, batch=2, seq=2048,
                      checkpointing=True),
    "llama-13b": Model(kind="llama", layers=40, hidden=5120, heads=40, kv_heads=40,
                       intermediate=13824, vocab=32000, batch=4, seq=2048,
                       checkpointing=True),
    "gpt2-tiny": Model(kind="gpt2", layers=2, hidden=64, heads=2, vocab=1000, batch=2, seq=16),
    "llama-tiny": Model(kind="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                        intermediate=128, vocab=256, batch=2, seq=16, checkpointing=True),
}


@dataclass(frozen=True)
class Case:
    """A row group: a model attached with ``options`` (besides ``compute_dtype``)."""

    name: str
    model: str
    options: dict = field(default_factory=dict)

    @property
    def capped(self) -> bool:
        return "gpu_memory_bytes" in self.options


CASES = [Case("GPT-2 1.3B B=8 T=1024", "gpt2-1.3b"),
         Case("Llama 8B B=2 T=2048, checkpointing", "llama-8b"),
         Case("Llama 8B B=2 T=2048, checkpointing, cap 100 GB", "llama-8b",
              {"gpu_memory_bytes": int(100e9)}),
         Case("Llama 13B B=4 T=2048, checkpointing", "llama-13b")]
TINY = [Case("tiny GPT-2 B=2 T=16", "gpt2-tiny"),
        Case("tiny Llama B=2 T=16, checkpointing", "llama-tiny"),
        Case("tiny Llama B=2 T=16, checkpointing, cap 2 MB", "llama-tiny",
             {"gpu_memory_bytes": int(2e6)})]
#: what a row records when it runs out of memory instead of dying
OUT_OF_MEMORY = (torch.OutOfMemoryError, CapacityError)


class Clock:
    """Back-to-back step timing, peak memory and dynamo's counts for one row."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def run(self, step, warmup: int, steps: int) -> dict:
        """``warmup`` untimed steps, then ``steps`` back to back: median and
        worst step seconds, peak GB, frames compiled in the timed steps; then
        one step under the profiler: the compiled frames a step runs."""
        for _ in range(warmup):
            step()
        self.sync()
        frames = dynamo_frames_compiled()
        retries = self.retries()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            for i in range(steps):
                marks[i].record()
                step()
            marks[-1].record()
            self.sync()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        got = {"step_s": statistics.median(times), "worst_s": max(times),
               "peak_gb": torch.cuda.max_memory_allocated(self.device) / GB
               if self.cuda else None,
               "reserved_gb": torch.cuda.max_memory_reserved(self.device) / GB
               if self.cuda else None,
               "alloc_retries": self.retries() - retries if self.cuda else None,
               "recompiles": dynamo_frames_compiled() - frames,
               "frames": dynamo_frames_compiled()}
        got["frames_per_step"] = compiled_regions_run(step)
        self.sync()
        return got

    def retries(self) -> int:
        """The caching allocator's retries so far (each freed its cache and
        synchronized every stream); 0 on the CPU."""
        if not self.cuda:
            return 0
        return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def compiled_way(model, way: str, backend: str):
    """What the training loop calls: ``model``, compiled whole, or with each
    block compiled in place (regional: the blocks stay compiled)."""
    if way == "whole":
        return torch.compile(model, backend=backend)
    if way == "regional":
        for block in blocks(model):
            block.compile(backend=backend)
    return model


def batch_of(spec: Model, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(0)
    return torch.randint(0, spec.vocab, (spec.batch, spec.seq), device=device, generator=gen)


def run_allgpu(spec: Model, ways: list[str], args, clock: Clock) -> dict:
    """All on the GPU, the ways in order (regional last: it compiles in place),
    on one model and optimizer: way -> timing dict, or ``{"error": ...}``."""
    out, held = {}, {}
    try:
        held["model"] = spec.build(str(clock.device))
        held["opt"] = torch.optim.AdamW(held["model"].parameters(), lr=1e-4,
                                        fused=clock.cuda)
    except OUT_OF_MEMORY as exc:
        held.clear()
        clock.free()
        return {way: {"error": f"all on GPU: out of memory building ({exc})"[:300]}
                for way in ways}
    ids = batch_of(spec, clock.device)
    for way in ways:
        dynamo_reset()
        try:
            step = train_step(compiled_way(held["model"], way, args.backend), held["opt"],
                              ids, clock.device)
            out[way] = clock.run(step, args.warmup, args.steps)
            out[way]["graph_breaks"] = dynamo_graph_breaks()
        except OUT_OF_MEMORY as exc:
            out[way] = {"error": f"all on GPU: out of memory ({exc})"[:300]}
            held["opt"].zero_grad()
        step = None
        clock.free()
    held.clear()   # the model and its state leave the GPU before tierd's rows
    dynamo_reset()
    clock.free()
    return out


def run_tierd(cpu_model, spec: Model, case: Case, way: str, args, clock: Clock, daemon, *,
              need_busy: bool) -> dict:
    """One tierd row: attach, compile ``way``, warm up, time; detach (the CPU
    model gets its values back for the next row). ``need_busy``: also profile
    one step for its compute-stream busy seconds."""
    dynamo_reset()
    options, optim = settings.split(case.options)
    model = attach(cpu_model, client=tierd.connect(daemon.socket), device=str(clock.device),
                   compute_dtype="bf16", **options)
    try:
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-4, **optim)
        step = train_step(compiled_way(model, way, args.backend), opt,
                          batch_of(spec, clock.device), clock.device)
        session = session_of(model)
        replans = session.stats()["placement_replans"]
        got = clock.run(step, args.warmup, args.steps)
        stats = session.stats()
        plan = session.placer.plan
        got.update(graph_breaks=dynamo_graph_breaks(),
                   replans=stats["placement_replans"] - replans,
                   planned_pcie_gb=(stats["planned_pcie_bytes"] or 0) / GB,
                   units_by_place=None if plan is None else dict(Counter(
                       p.value for p in plan.places.values())),
                   hooked_units=session.hooks.hooked_units)
        if clock.cuda and need_busy:   # all-GPU did not fit: the floor's compute
            from tierd.bench.attach_step import profile
            got["compute_busy_s"] = profile(step)["compute_busy_s"]
        return got
    finally:
        step = opt = None
        detach(model)
        dynamo_reset()
        clock.free()


def row(case: Case, spec: Model, way: str, cls: str, ref: dict, got: dict,
        bandwidth: float) -> dict:
    """The row of ``case`` run ``way``: the all-GPU and tierd figures, and the
    floor where it is capped or all-GPU does not fit."""
    allgpu_s = ref.get("step_s")
    floor_s = None
    if case.capped or allgpu_s is None:
        compute = allgpu_s if allgpu_s is not None else got.get("compute_busy_s")
        if compute is not None:
            floor_s = max(compute, got.get("planned_pcie_gb", 0) * GB / bandwidth)
    base, to = (floor_s, "floor") if floor_s is not None else (allgpu_s, "allgpu")
    tierd_s = got.get("step_s")
    return {"case": case.name, "model": cls, "compiled": way, "allgpu_s": allgpu_s,
            "tierd_s": tierd_s, "floor_s": floor_s,
            "ratio": tierd_s / base if tierd_s and base else None,
            "ratio_to": to if tierd_s and base else None,
            "recompiles": got.get("recompiles"), "graph_breaks": got.get("graph_breaks"),
            "frames": got.get("frames"), "frames_per_step": got.get("frames_per_step"),
            "allgpu_frames_per_step": ref.get("frames_per_step"),
            "peak_gb": got.get("peak_gb"), "reserved_gb": got.get("reserved_gb"),
            "alloc_retries": got.get("alloc_retries"), "worst_s": got.get("worst_s"),
            "replans": got.get("replans"), "planned_pcie_gb": got.get("planned_pcie_gb"),
            "units_by_place": got.get("units_by_place"), "hooked_units": got.get("hooked_units"),
            "compute_busy_s": got.get("compute_busy_s"),
            "allgpu_recompiles": ref.get("recompiles"),
            "allgpu_graph_breaks": ref.get("graph_breaks"), "allgpu_peak_gb": ref.get("peak_gb"),
            "allgpu_worst_s": ref.get("worst_s"), "error": got.get("error"),
            "allgpu_error": ref.get("error")}


def measure(name: str, cases: list[Case], ways: list[str], args, device: torch.device,
            bandwidth: float, save: Callable[[dict], None]) -> None:
    """Every row of model ``name`` in this process: all-GPU first, then tierd
    way by way (regional last: its blocks stay compiled), case by case; each
    row given to ``save`` as it is measured (a run cut short keeps its rows)."""
    spec = MODELS[name]
    if args.layers:
        spec = replace(spec, layers=args.layers)
    clock = Clock(device)
    print(f"{name}: {spec}", flush=True)
    ref = run_allgpu(spec, ways, args, clock)
    cpu_model = spec.build(str(device)).to("cpu")   # random init is fast on a GPU
    cls = type(cpu_model).__name__
    daemon = start_daemon(pool=args.pool_gib << 30, nvme_size=args.nvme_gib << 30)
    try:
        for way in ways:
            for case in cases:
                t0 = time.perf_counter()
                try:
                    got = run_tierd(cpu_model, spec, case, way, args, clock, daemon,
                                    need_busy="step_s" not in ref[way])
                except OUT_OF_MEMORY as exc:
                    got = {"error": f"tierd: out of memory ({exc})"[:300]}
                save(row(case, spec, way, cls, ref[way], got, bandwidth)
                     | {"wall_s": time.perf_counter() - t0})
    finally:
        daemon.stop()


def measure_apart(args, save: Callable[[dict], None]) -> float:
    """Each model in a process of its own (a process keeps the pool segments
    it page-locked, and the host page-locks only so much); its rows given to
    ``save``. Returns the largest both-ways bandwidth the processes measured."""
    bandwidth = 0.0
    for name in args.names:
        sub = args.out / name
        cmd = [sys.executable, "-m", "tierd.bench.compiled", "--out", str(sub), "--model", name,
               "--case", args.case, "--compiled", args.compiled, "--layers", str(args.layers),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--backend",
               args.backend, "--pool-gib", str(args.pool_gib), "--nvme-gib", str(args.nvme_gib),
               "--device", args.device] + ["--tiny"] * args.tiny \
            + [a for kv in args.set for a in ("--set", kv)]
        failed = subprocess.run(cmd).returncode != 0
        got = json.loads((sub / "compiled.json").read_text()) \
            if (sub / "compiled.json").exists() else {"rows": []}
        for r in got["rows"]:
            save(r)
        bandwidth = max(bandwidth, got.get("both_ways_bandwidth_gbps", 0) * GB)
        if failed:
            save({"case": f"{name} (the rest)", "model": name, "compiled": None,
                  "error": "its process failed; see its output above"})
    return bandwidth


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for compiled.json")
    ap.add_argument("--model", default="", help="comma-separated models to run "
                    f"(default every model of the cases): {', '.join(MODELS)}")
    ap.add_argument("--case", default="", help="only the cases whose name contains this "
                    "(comma-separated: any of these)")
    ap.add_argument("--compiled", default=",".join(WAYS),
                    help="comma-separated ways to run: eager, whole, regional")
    ap.add_argument("--layers", type=int, default=0, help="override every model's layer "
                    "count (smoke runs; same shape per layer)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (back to back)")
    ap.add_argument("--warmup", type=int, default=6, help="untimed steps: compiling, and "
                    "tierd's measuring and placing")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--pool-gib", type=int, default=60)
    ap.add_argument("--nvme-gib", type=int, default=48)
    ap.add_argument("--tiny", action="store_true", help="the tiny cases (CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="for the cases that do not name KEY: " + settings.HELP)
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    args = ap.parse_args(argv)
    ways = [w for w in args.compiled.split(",") if w]
    if not ways or set(ways) - set(WAYS):
        ap.error(f"--compiled {args.compiled!r}: use a comma-separated subset of {WAYS}")
    args.ways = [w for w in WAYS if w in ways]   # regional last: it compiles in place
    wanted = args.case.split(",")
    try:
        cases = settings.with_settings(TINY if args.tiny else CASES, args.set)
    except ValueError as exc:
        ap.error(str(exc))
    args.cases = [c for c in cases if any(w in c.name for w in wanted)]
    names = list(dict.fromkeys(c.model for c in args.cases))
    if args.model:
        unknown = set(args.model.split(",")) - set(MODELS)
        if unknown:
            ap.error(f"--model: unknown {sorted(unknown)}; the models: {', '.join(MODELS)}")
        names = [n for n in names if n in args.model.split(",")]
    if not names:
        ap.error(f"no case left to run (--case {args.case!r}, --model {args.model!r}, "
                 f"--tiny {args.tiny})")
    args.names = names
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    import transformers
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    result = {"commit": commit, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "both_ways_bandwidth_gbps": None,
              "args": {k: v for k, v in vars(args).items() if k in
                       ("steps", "warmup", "backend", "layers", "pool_gib", "nvme_gib", "device",
                        "case", "compiled", "model", "tiny")},
              "rows": []}
    target = args.out / "compiled.json"

    def save(r: dict) -> None:
        print(json.dumps(r), flush=True)
        result["rows"].append(r)
        target.write_text(json.dumps(result, indent=1))

    if device.type == "cuda" and len(args.names) > 1:
        result["both_ways_bandwidth_gbps"] = measure_apart(args, save) / GB
    else:
        bandwidth = both_ways_bandwidth(device)
        result["both_ways_bandwidth_gbps"] = bandwidth / GB
        for name in args.names:
            cases = [c for c in args.cases if c.model == name]
            measure(name, cases, args.ways, args, device, bandwidth, save)
    target.write_text(json.dumps(result, indent=1))
    report(result["rows"])
    return result


def report(rows: list[dict]) -> None:
    fmt = lambda v, f: "-" if v is None else format(v, f)   # noqa: E731
    print(f"\n{'case':48} {'way':8} {'all-GPU s':>9} {'tierd s':>8} {'floor s':>8} "
          f"{'ratio':>6} {'recomp':>6} {'breaks':>6} {'frames':>6} {'peak GB':>7}")
    for r in rows:
        print(f"{r['case']:48} {r['compiled'] or '-':8} {fmt(r.get('allgpu_s'), '9.4f')} "
              f"{fmt(r.get('tierd_s'), '8.4f')} {fmt(r.get('floor_s'), '8.4f')} "
              f"{fmt(r.get('ratio'), '6.2f')} {fmt(r.get('recompiles'), '6d')} "
              f"{fmt(r.get('graph_breaks'), '6d')} {fmt(r.get('frames_per_step'), '6d')} "
              f"{fmt(r.get('peak_gb'), '7.1f')}"
              + (f"  {r['error']}" if r.get("error") else ""))


if __name__ == "__main__":
    main()
