"""Llama-3-70B's shape on one GPU: LoRA fine-tuning and generation, built from config.

    python -m tierd.bench.lora70b --out DIR --case lora-80g      # one case (CUDA)
    python -m tierd.bench.lora70b --out DIR --tiny               # CPU smoke run, every case
    python -m tierd.bench.lora70b --merge FILE --out DIR         # rows of FILE into DIR's file
    python -m tierd.bench.lora70b --out DIR --case lora-24g --set resident_below_bytes=1048576
        # a setting beside the defaults (attach's; optim.KEY: the optimizer's),
        # its rows named for it: "lora-24g, resident_below_bytes=1048576"

On the H200 machine, one call per line (each case builds the 70B model again,
in a process of its own; estimated before the first run: about 1 minute of
start-up, calibration and bandwidth, up to 3 minutes to build and attach,
then the case: about 2.5 minutes for 50 steps at 80 GB, 4 at 24 GB, 2.5 for
128 tokens; ``--budget-s`` (default 540) stops the steps or tokens of a case
in time to write its row, recording how many ran)::

    python -m tierd.bench.lora70b --out $OUT --case allgpu
    python -m tierd.bench.lora70b --out $OUT --case lora-default
    python -m tierd.bench.lora70b --out $OUT --case lora-80g
    python -m tierd.bench.lora70b --out $OUT --case lora-24g --warmup 8 --steps 14
        # (its first ~6 steps move the blocks attach spilled: 8 warm-up steps)
    python -m tierd.bench.lora70b --out $OUT --case generate-80g
    python -m tierd.bench.lora70b --out $OUT --case peer-80g
    python -m tierd.bench.lora70b --out $OUT --case generate-lora-80g   # optional
    # here, after each call, with the file it brought back:
    python -m tierd.bench.lora70b --merge <files_at>/lora70b-nvidia-h200-<commit>.json \\
        --out benchmarks/results

The model is ``LlamaForCausalLM`` in Llama-3-70B's shape (80 x 8192, MLP
28672, 64 heads / 8 kv heads, vocabulary 128256, untied head: 70.6B
parameters, 141 GB in bf16) built on the meta device in bf16 and wrapped by
peft (``get_peft_model``, LoRA r=16, alpha 32, no dropout, on q/k/v/o,
task CAUSAL_LM); ``tierd.attach(model, init=True, compute_dtype="bf16")``
gives it random weights unit by unit (the model's own initialization), so
neither the GPU nor the host ever holds all of it at once. Training: B=1,
T=2048, Hugging Face gradient checkpointing (non-reentrant), bf16 autocast,
``tierd.optim.AdamW`` over the adapters (the base is frozen), random tokens
as inputs and labels. ``--layers N`` keeps N layers; ``--tiny`` a model of a
few hundred kB (the tests run it on the CPU).

Cases (``--case`` takes a comma-separated list; ``CASES``):

- ``allgpu``: the same LoRA step with the model built on the GPU, no tierd
  (a model that does not fit says so: out of memory is the row's error,
  without building where its bf16 weights alone exceed the device; the
  H200's 139 GiB, 149 GB, holds the 141 GB with ~8 GB for the rest);
- ``lora-default``: attach with the defaults; ``lora-80g`` / ``lora-24g``:
  ``gpu_memory_bytes`` 80 GB / 24 GB (standing in for smaller GPUs);
- ``generate-80g``: greedy generation (KV cache) of 128 tokens from a
  512-token prompt on the plain model (no adapter, as the peer's), attached
  capped at 80 GB, no optimizer;
- ``peer-80g``: the same generation with Hugging Face accelerate: the plain
  model dispatched by ``infer_auto_device_map`` with
  ``max_memory={0: 80 GB, "cpu": what the host has free less 8 GiB}`` and
  ``dispatch_model`` (what ``from_pretrained(device_map="auto")`` does after
  loading), random weights; a failure is its row's error;
- ``generate-lora-80g``: ``generate-80g`` on the peft model. peft's
  ``generate`` calls the wrapped model's forward, not the PeftModel's; tierd
  begins a step there too ([Note: a step begins where the model is
  entered] in tierd.client.hooks), so placement places as for the plain
  model (seen on the CPU with a tiny peft Llama).

With ``--layers`` or ``--tiny`` a cap is scaled by the model's parameters
over the full shape's, and raised to 1.25x the largest unit's need where it
falls below (the row's ``cap_gb``).

Every training process first measures, on the same device, the compute
rate: the same LoRA step all on the GPU on 8 of the shape's 80 layers
(every matrix as in the full model, so the same products; the tiny shape
with ``--tiny``), ``tflops``
= its FLOPs (:func:`lora_step_flops`) over its median of 5 steps after 3;
and every training and generation process the PCIe bandwidths: pinned
copies host to device, device to host, and both at once (best of six,
256 MiB each way).

Writes ``DIR/lora70b-<device>-<commit>.json``: ``{"commit", "device",
"rows"}``, a row replacing the row of the same case. Every row has
``case``, ``kind``, ``commit``, ``shape``, ``params``, ``error``; then

- build (every tierd case, and a ``build`` row from the latest of them):
  ``build_s`` (meta model to attached), ``host_peak_rss_gb`` and
  ``host_peak_anon_gb`` (this process's resident set and its anonymous
  part, sampled every 0.1 s while building; the pool is shared memory,
  counted in the first only where this process touched it);
- training: ``tierd_s`` (median of the last 20 steps back to back, CUDA
  events), ``first_step_s``, ``worst_step_s`` (after ``--warmup``),
  ``steps_s``, ``steps_run``, ``plan_changes``, ``placement``,
  ``resident_gb``, ``pcie_in_gb`` / ``pcie_out_gb`` (copied per steady
  step: the median of the steps after warm-up), ``peak_gb`` (allocator),
  ``nvme_read_gb`` / ``nvme_write_gb`` (the daemon's NVMe traffic per
  steady step: where the streamed base exceeds ``pool_gb``, the pool's
  size, the excess is read from the disk, which no floor here counts),
  ``nvme_read_ahead_gb`` (of those reads, the ones the daemon began ahead
  of their lease: [Note: the job's access plan] in tierd.server.readahead),
  ``nvme_read_busy_s`` (seconds a steady step the disk had a read in
  flight: [Note: the disk's busy time] in tierd.server.transfers) and
  ``lease_wait_s`` (host seconds a steady step blocked on the daemon's
  leases), ``read_ahead`` (the daemon's seconds in its catalog serving
  requests, ``catalog_s``, and its read-ahead passes a steady step,
  the positions their horizons reached, summed, and how many stopped for
  want of room or to wait on transfers in flight);
  ``step_flops``, ``tflops``, ``compute_floor_s`` (FLOPs over ``tflops``),
  ``pcie_floor_s`` (the copies' time at the measured bandwidths: the
  larger of in / host-to-device, out / device-to-host and both / both-ways;
  with copies mostly one way, the one-way bandwidth binds),
  ``nvme_must_read_gb`` and ``nvme_floor_s`` (a tierd row: the frozen base
  crosses PCIe once in the forward and once in backward's recompute, and
  the pool keeps at most its size of it between them, so the rest of each
  pass is read from the disk, at ``disk_read_gbps``: :func:`nvme_floor`,
  :func:`disk_read_rate`), ``floor_s`` (the largest) and ``binding``
  (which); ``allgpu`` has ``allgpu_s``;
- generation: ``new_tokens``, ``first_token_s`` (prompt to first token,
  the measuring step included), ``tokens_per_s`` (new tokens over the whole
  call), ``decode_tokens_per_s`` (tokens after the first
  ``--warmup-tokens`` over their time), ``token_s`` (each token's seconds),
  ``pcie_in_gb_per_token``, ``nvme_read_gb_per_token`` and
  ``token_floor_s`` (the larger of that at the host-to-device bandwidth
  and what the disk must read, as below); the peer's row has ``peer`` and its device map
  (``gpu_layers``, ``cpu_layers``), and ``stopped_by_budget`` where the
  budget ended the generation early.
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
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tierd.bench import settings, steploop
from tierd.bench.bigmodel_models import Shape, checkpointed, default_dtype, llama_config
from tierd.bench.floors import disk_read_rate, floors, nvme_floor, pcie_bandwidths

GB = 1e9
#: Llama-3-70B's shape
FULL = Shape(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=128256)
TINY = Shape(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=256)
#: the rate's shape: 8 of the 80 layers (8B's ran 305 TFLOPS, the 70B's ~555)
CALIBRATION = replace(FULL, layers=8)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Case:
    """A row: ``kind`` says what runs ("allgpu", "train", "generate", "peer");
    ``cap_gb`` is ``gpu_memory_bytes`` in GB for the full shape (None: the
    default); ``lora``: the model wrapped by peft with the adapters."""

    name: str
    kind: str
    cap_gb: float | None = None
    lora: bool = True


CASES = [Case("allgpu", "allgpu"), Case("lora-default", "train"),
         Case("lora-80g", "train", 80), Case("lora-24g", "train", 24),
         Case("generate-80g", "generate", 80, lora=False),
         Case("peer-80g", "peer", 80, lora=False),
         Case("generate-lora-80g", "generate", 80)]
BY_NAME = {c.name: c for c in CASES}


# ------------------------------------------------------------------ sizes and FLOPs
def lora_params(shape: Shape, rank: int) -> int:
    """Parameters of the adapters: A (rank x in) and B (out x rank) per projection."""
    kv = shape.hidden // shape.heads * shape.kv_heads
    per_layer = rank * ((shape.hidden + shape.hidden) * 2 + (shape.hidden + kv) * 2)
    return shape.layers * per_layer


def attention_flops(shape: Shape, seq: int, batch: int = 1) -> int:
    """Attention's score and value products in a checkpointed step: 4 * hidden
    * seq a token and layer forward, once more recomputed, twice that backward."""
    return batch * seq * 16 * shape.layers * shape.hidden * seq


def lora_step_flops(shape: Shape, seq: int, rank: int, batch: int = 1) -> int:
    """Model FLOPs of one LoRA step with checkpointed layers and a frozen base:
    per token, 2 a matmul parameter forward, 2 again for the layers'
    recomputation, 2 backward for the input gradients (no weight gradients);
    the LM head forward and backward only; the adapters 6 a parameter
    (recompute: 2 more); and :func:`attention_flops`."""
    layer_matmul = shape.layer_params - 2 * shape.hidden   # norms are no matmul
    head = shape.vocab * shape.hidden
    per_token = 6 * shape.layers * layer_matmul + 4 * head + 8 * lora_params(shape, rank)
    return batch * seq * per_token + attention_flops(shape, seq, batch)


# ------------------------------------------------------------------ models
def lora_config(rank: int):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")


def meta_model(shape: Shape, seq: int, rank: int | None, *, train: bool):
    """The bf16 Llama on the meta device, wrapped by peft with adapters of
    ``rank`` (fp32, as peft makes them) unless None; checkpointing on and
    train mode for training, eval mode else (without adapters frozen, as a
    model only generating is)."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"), default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(llama_config(shape, seq))
    model = checkpointed(model) if train else model.eval()
    if rank is not None:
        from peft import get_peft_model
        model = get_peft_model(model, lora_config(rank))
    elif not train:
        model.requires_grad_(False)
    return model.train() if train else model.eval()


def least_cap(model) -> int:
    """The largest unit's bytes on the device at once: bf16 weights, and the
    fp32 state of what trains (what attach's cap check asks for)."""
    from tierd.client.registry import unit_roots
    blocks = unit_roots(model)
    inside = {id(p) for b in blocks for p in b.parameters()}

    def need(params) -> int:
        return sum(p.numel() * (2 + 12 * p.requires_grad) for p in params)
    rest = need(p for p in model.parameters() if id(p) not in inside)
    return max([rest] + [need(b.parameters()) for b in blocks])


def cap_bytes(case: Case, shape: Shape, model) -> int | None:
    """``case``'s cap for ``shape``: scaled from the full shape, at least 1.25x
    the largest unit's need ([module docstring])."""
    if case.cap_gb is None:
        return None
    cap = int(case.cap_gb * GB)
    if shape != FULL:
        cap = max(cap * shape.params // FULL.params, least_cap(model) * 5 // 4)
    return cap


def tokens(shape: Shape, batch: int, seq: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (batch, seq), generator=g).to(device)


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ host memory
class HostMemory:
    """This process's peak resident set and its anonymous part, sampled every
    0.1 s on a thread while in the ``with`` block (Linux; zeros elsewhere)."""

    def __init__(self) -> None:
        self.peak_rss = self.peak_anon = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def now() -> tuple[int, int]:
        try:
            with open("/proc/self/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            return 0, 0
        kb = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024   # noqa: E731
        return kb("VmRSS"), kb("RssAnon")

    def _sample(self) -> None:
        while True:
            self._sample_once()
            if self._done.wait(0.1):
                return

    def __enter__(self) -> "HostMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._sample_once()

    def _sample_once(self) -> None:
        rss, anon = self.now()
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)


def lora_loop(model, device: torch.device, ids, args, deadline: float, observe=None):
    """LoRA steps back to back: ``--warmup`` first, then as many of the rest of
    ``--steps`` as the deadline leaves time for (at the last warm-up step's
    pace); the two loops' steps, seconds and observations joined."""
    import tierd.optim
    params = [p for p in model.parameters() if p.requires_grad]
    attached = _is_attached(model)
    opt = (tierd.optim.AdamW(params, lr=1e-4, **settings.split(args.settings)[1]) if attached
           else torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda"))
    step = steploop.train_step(model, opt, ids, device)
    first = steploop.back_to_back(step, args.warmup, device, observe)
    left = args.steps - args.warmup
    if deadline != float("inf"):
        left = min(left, int((deadline - time.monotonic()) / max(first.seconds[-1], 1e-3)))
    rest = steploop.back_to_back(step, max(1, left), device, observe)
    return (first.seconds + rest.seconds, first.peaks + rest.peaks,
            first.observed + rest.observed)


def _is_attached(model) -> bool:
    from tierd.client.attached import is_attached
    return is_attached(model)


def calibrate(args, device: torch.device) -> dict:
    """The compute rate: the LoRA step all on ``device`` at ``CALIBRATION``,
    the full shape's layers, 8 of them (the tiny shape with ``--tiny``), its
    FLOPs over its median step."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    shape = TINY if args.tiny else CALIBRATION
    torch.manual_seed(0)
    with torch.device(device), default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(llama_config(shape, args.seq))
    model = get_peft_model(checkpointed(model), lora_config(args.rank)).train()
    ids = tokens(shape, 1, args.seq, device)
    seconds, _, _ = lora_loop(model, device, ids, replace_steps(args, 8), float("inf"))
    step_s = steploop.summary(seconds, min(3, len(seconds) - 1))["median_s"]
    flops = lora_step_flops(shape, args.seq, args.rank)
    del model
    free_device(device)
    return {"shape": asdict(shape), "step_s": step_s, "flops": flops,
            "tflops": flops / step_s / 1e12}


def replace_steps(args, steps: int):
    return argparse.Namespace(**{**vars(args), "steps": steps, "warmup": min(args.warmup, 3)})


# ------------------------------------------------------------------ tierd
def build_attached(case: Case, shape: Shape, args, device: torch.device, *, train: bool):
    """The meta LoRA model attached with ``init=True`` (and ``case``'s cap);
    returns it and the build figures."""
    import tierd
    model = meta_model(shape, args.seq, args.rank if case.lora else None, train=train)
    cap = cap_bytes(case, shape, model)
    options = {**({} if cap is None else {"gpu_memory_bytes": cap}),
               **settings.split(args.settings)[0]}
    t0 = time.perf_counter()
    with HostMemory() as memory:
        model = tierd.attach(model, init=True, compute_dtype="bf16", device=device, **options)
    return model, {"build_s": time.perf_counter() - t0, "cap_gb": None if cap is None else cap / GB,
                   "host_peak_rss_gb": memory.peak_rss / GB,
                   "host_peak_anon_gb": memory.peak_anon / GB}


#: the daemon's seconds serving requests in its catalog, and its counters of
#: read-ahead passes (tierd.server.records.TierCounters)
READ_AHEAD = ("catalog_s", "read_ahead_passes", "read_ahead_reach", "read_ahead_no_room", "read_ahead_waits")


def traffic(session) -> tuple:
    """What the counters say after a step: the attached model's plan and
    bytes copied in and out, the daemon's bytes read from and written to
    NVMe (the part of the streamed base the pool cannot hold) and read
    ahead, the disk's busy seconds reading, the host's seconds waiting
    on leases, and the read-ahead's passes (:data:`READ_AHEAD`)."""
    from tierd.bench.placement import plan_of
    stats, daemon = session.stats(), session.client.stats()
    return (plan_of(session), stats["h2d_bytes"], stats["d2h_bytes"],
            daemon["bytes_to_pool"], daemon["bytes_to_nvme"], daemon["bytes_read_ahead"],
            daemon.get("nvme_read_busy_s", 0.0), stats["lease_wait_seconds"],
            *(daemon.get(k, 0) for k in READ_AHEAD))


def progress(session, before: tuple):
    """``traffic`` after each step, each step's figures printed as it ends
    (host clock: a run stopped by a time limit still shows its steps)."""
    last, clock = [before], [time.monotonic()]

    def observe() -> tuple:
        now, got = time.monotonic(), traffic(session)
        d = [b - a for a, b in zip(last[0][1:], got[1:])]
        print(f"[lora70b] step {len(clock)}: {now - clock[-1]:.2f} s (host), PCIe in "
              f"{d[0] / GB:.1f} GB, out {d[1] / GB:.1f} GB; NVMe read {d[2] / GB:.2f} GB "
              f"({d[4] / GB:.2f} ahead), written {d[3] / GB:.2f} GB; the disk reading "
              f"{d[5]:.1f} s; leases waited {d[6]:.1f} s; the daemon's catalog {d[7]:.2f} s; "
              f"read-ahead passes {d[8]} reaching {d[9] / max(d[8], 1):.1f} positions, "
              f"stopped {d[10]} for room, {d[11]} to wait", flush=True)
        last[0] = got
        clock.append(now)
        return got
    return observe


def per_step(observed: list, skip: int) -> tuple[float, ...]:
    """Median bytes per step of each counter ``traffic`` returns after the
    plan (copied in, out, read from NVMe, written to it), from the counters
    before the first step and after each, the first ``skip`` steps left out
    (all steps where none would be left)."""
    pairs = list(zip(observed, observed[1:]))
    steps = pairs[skip:] or pairs
    if not steps:
        return (0.0,) * (len(observed[0]) - 1)
    return tuple(statistics.median(b[i] - a[i] for a, b in steps)
                 for i in range(1, len(observed[0])))


def run_train(case: Case, shape: Shape, args, device: torch.device, deadline: float) -> list:
    from tierd.bench.placement import plan_changes
    from tierd.client.attach import session_of
    rates, calibration = pcie_bandwidths(device), calibrate(args, device)
    model, build = build_attached(case, shape, args, device, train=True)
    session = session_of(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = traffic(session)
    seconds, peaks, observed = lora_loop(model, device, tokens(shape, 1, args.seq, device),
                                         args, deadline, progress(session, before))
    s = steploop.summary(seconds, args.warmup)
    pin, pout, nvme_in, nvme_out, ahead, busy, waits, *passes = per_step([before] + observed,
                                                                         args.warmup)
    stats = session.stats()
    row = {**build, "tierd_s": s["median_s"], "first_step_s": s["first_step_s"],
           "worst_step_s": s["worst_step_s"], "steady_steps": s["steady_steps"],
           "steps_run": len(seconds), "steps_s": seconds,
           "plan_changes": plan_changes([o[0] for o in observed], before[0])[1],
           "placement": stats["placement"], "resident_gb": stats["resident_bytes"] / GB,
           "pcie_in_gb": pin / GB, "pcie_out_gb": pout / GB, "peak_gb": max(peaks) / GB,
           "nvme_read_gb": nvme_in / GB, "nvme_write_gb": nvme_out / GB,
           "nvme_read_ahead_gb": ahead / GB, "nvme_read_busy_s": busy,
           "lease_wait_s": waits, "read_ahead": dict(zip(READ_AHEAD, passes)), "pool_gb": session.pool_bytes / GB,
           "step_flops": lora_step_flops(shape, args.seq, args.rank),
           "tflops": calibration["tflops"], "calibration": calibration,
           "bandwidth_gbps": {k: v / GB for k, v in rates.items()}}
    row.update(floors(row, rates, calibration["tflops"], disk_read_rate(args)))
    # no detach: it would bring the whole model back into this process's memory
    return [{**row}, {"case": "build", "kind": "build", "built_by": row_name(case, args),
                      **build}]


def run_allgpu(case: Case, shape: Shape, args, device: torch.device, deadline: float) -> list:
    from peft import get_peft_model
    from transformers import LlamaForCausalLM
    if device.type == "cuda":   # weights larger than the device: no build to find out
        total = torch.cuda.get_device_properties(device).total_memory
        if 2 * shape.params > total:
            raise torch.OutOfMemoryError(
                f"does not fit: {2 * shape.params / GB:.1f} GB of bf16 weights, "
                f"{total / GB:.1f} GB on the device")
    rates, calibration = pcie_bandwidths(device), calibrate(args, device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device), default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(llama_config(shape, args.seq))
    model = get_peft_model(checkpointed(model), lora_config(args.rank)).train()
    build_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, peaks, _ = lora_loop(model, device, tokens(shape, 1, args.seq, device), args,
                                  deadline)
    s = steploop.summary(seconds, args.warmup)
    row = {"build_s": build_s, "allgpu_s": s["median_s"], "first_step_s": s["first_step_s"],
           "worst_step_s": s["worst_step_s"], "steady_steps": s["steady_steps"],
           "steps_run": len(seconds), "steps_s": seconds, "peak_gb": max(peaks) / GB,
           "pcie_in_gb": 0.0, "pcie_out_gb": 0.0,
           "step_flops": lora_step_flops(shape, args.seq, args.rank),
           "tflops": calibration["tflops"], "calibration": calibration}
    row.update(floors(row, rates, calibration["tflops"]))
    return [row]


# ------------------------------------------------------------------ generation
def token_clock(observe=None):
    """A streamer that timestamps each token ``generate`` hands it (its first
    call is the prompt; ``generate`` copies each token to the host first, so a
    timestamp is the token's arrival) and keeps what ``observe()`` returns at
    each call, the prompt's included."""
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.marks: list = []
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True
            if observe is not None:
                self.marks.append(observe())

        def end(self) -> None:
            pass
    return TokenClock()


def deadline_criteria(deadline: float):
    """Stop generating once the monotonic clock passes ``deadline``."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Deadline(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = time.monotonic() > deadline
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool,
                              device=input_ids.device)
    return StoppingCriteriaList([Deadline()])


def generate_timed(model, prompt, args, deadline: float, observe=None) -> dict:
    """Greedy generation of ``--new-tokens`` (end-of-sequence suppressed), timed per token."""
    clock = token_clock(observe)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=prompt, max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                       pad_token_id=0, streamer=clock,
                       stopping_criteria=deadline_criteria(deadline))
    times = clock.times
    gaps = [b - a for a, b in zip([t0] + times, times)]
    n, skip = len(times), min(args.warmup_tokens, len(times) - 1)
    decode = (n - 1 - skip) / (times[-1] - times[skip]) if n - 1 > skip else None
    return {"new_tokens": n, "first_token_s": gaps[0], "token_s": gaps,
            "tokens_per_s": n / (times[-1] - t0), "decode_tokens_per_s": decode,
            "stopped_by_budget": n < args.new_tokens, "prompt": prompt.shape[1],
            "marks": clock.marks}


def run_generate(case: Case, shape: Shape, args, device: torch.device, deadline: float) -> list:
    from tierd.client.attach import session_of
    rates = pcie_bandwidths(device)
    model, build = build_attached(case, shape, args, device, train=False)
    session = session_of(model)
    got = generate_timed(model, tokens(shape, 1, args.prompt, device), args, deadline,
                         lambda: traffic(session))
    marks = got.pop("marks")
    pin, _, nvme_in, _, ahead, *_ = per_step(marks, args.warmup_tokens + 1)
    stats = session.stats()
    disk, must = nvme_floor(pin, 1, session.pool_bytes, disk_read_rate(args))
    return [{**build, **got, "placement": stats["placement"],
             "resident_gb": stats["resident_bytes"] / GB, "pcie_in_gb_per_token": pin / GB,
             "nvme_read_gb_per_token": nvme_in / GB, "nvme_must_read_gb": must / GB,
             "nvme_read_ahead_gb_per_token": ahead / GB,
             "pool_gb": session.pool_bytes / GB,
             "token_floor_s": max(pin / rates["h2d"], disk or 0.0),
             "bandwidth_gbps": {k: v / GB for k, v in rates.items()}}]


def run_peer(case: Case, shape: Shape, args, device: torch.device, deadline: float) -> list:
    """accelerate's ``device_map="auto"`` generation with ``case``'s cap on GPU 0."""
    if device.type != "cuda":
        raise RuntimeError("accelerate's device_map='auto' peer needs a CUDA device")
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import LlamaForCausalLM

    from tierd.backends.memory import available_memory
    with init_empty_weights(), default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(llama_config(shape, args.seq)).eval()
    cap = cap_bytes(case, shape, model)
    max_memory = {device.index or 0: cap, "cpu": available_memory() - (8 << 30)}
    t0 = time.perf_counter()
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=torch.bfloat16,
                                       no_split_module_classes=model._no_split_modules)
    placed = list(device_map.values())
    if "disk" in placed:
        raise RuntimeError(f"accelerate's device map sends {placed.count('disk')} modules to "
                           f"disk with max_memory={max_memory}")
    torch.manual_seed(0)
    std = model.config.initializer_range
    for name, param in list(model.named_parameters()):
        where = _mapped_device(name, device_map)
        value = torch.empty(param.shape, dtype=torch.bfloat16, device=device)
        value.fill_(1.0) if param.ndim == 1 else value.normal_(0.0, std)
        set_module_tensor_to_device(model, name, where, value=value.to(where))
        del value
    model = dispatch_model(model, device_map=device_map)
    build_s = time.perf_counter() - t0
    got = generate_timed(model, tokens(shape, 1, args.prompt, device), args, deadline)
    got.pop("marks")
    layers = {k: v for k, v in device_map.items() if ".layers." in k}
    return [{"peer": "accelerate device_map=auto + dispatch_model", "build_s": build_s,
             "cap_gb": cap / GB, "max_memory_gb": {str(k): v / GB for k, v in max_memory.items()},
             "gpu_layers": sum(v != "cpu" for v in layers.values()),
             "cpu_layers": sum(v == "cpu" for v in layers.values()), "lora": False, **got}]


def _mapped_device(name: str, device_map: dict):
    best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")),
               key=len)
    where = device_map[best]
    return f"cuda:{where}" if isinstance(where, int) else where


RUNNERS = {"allgpu": run_allgpu, "train": run_train, "generate": run_generate,
           "peer": run_peer}


# ------------------------------------------------------------------ rows and files
def shape_of(args) -> Shape:
    shape = TINY if args.tiny else FULL
    return shape if args.layers is None else replace(shape, layers=args.layers)


def measure_one(case: Case, args) -> list[dict]:
    """``case``'s rows, measured in this process; an error is the row's."""
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shape = shape_of(args)
    base = {"case": row_name(case, args), "kind": case.kind, "commit": args.commit, "error": None,
            "shape": asdict(shape), "params": shape.params, "seq": args.seq, "batch": 1,
            "lora_rank": args.rank, "lora_params": lora_params(shape, args.rank)}
    deadline = args.started + args.budget_s - 20   # time left to write the row
    try:
        rows = RUNNERS[case.kind](case, shape, args, device, deadline)
    except Exception as exc:   # an out-of-memory or a failed peer is the row's result
        traceback.print_exc()
        return [{**base, "error": f"{type(exc).__name__}: {exc}"[:600]}]
    return [{**base, **r} for r in rows]   # the build row names its own case


def row_name(case: Case, args) -> str:
    """``case``'s row's name: the case's, and a tierd case's ``--set`` settings
    (the peer's and the all-GPU step's take none)."""
    return case.name + (settings.suffix(args.settings) if case.kind in ("train", "generate")
                        else "")


def result_name(device: str, commit: str | None) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"lora70b-{slug}-{(commit or 'unknown')[:7]}.json"


def merged(path: Path, result: dict) -> dict:
    """``result`` with the rows of an existing ``path`` it has no row for kept."""
    if not path.exists():
        return result
    old = json.loads(path.read_text())
    new = {r["case"]: r for r in result["rows"]}
    rows = [new.pop(r["case"], r) for r in old.get("rows", [])] + list(new.values())
    return {**old, **result, "rows": rows}


def run_apart(cases: list[Case], args) -> list[dict]:
    """Each case in a process of its own (a process keeps the pool segments it
    page-locked, and the model stays attached until the process ends)."""
    rows = []
    for case in cases:
        part = args.out / f".{case.name}.rows.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tierd.bench.lora70b", "--one", case.name,
               "--rows-to", str(part)] + args.passed
        code = subprocess.run(cmd).returncode
        if part.exists():
            rows += json.loads(part.read_text())
            part.unlink()
        else:
            rows.append({"case": row_name(case, args), "kind": case.kind, "commit": args.commit,
                         "error": f"its process ended with code {code} before writing a row; "
                                  "see its output above"})
    return rows


def print_table(rows: list[dict]) -> None:
    def f(v, spec):
        return format("-", ">" + re.match(r"\d*", spec).group()) if v is None else format(v, spec)
    print(f"\n{'case':18} {'s/step':>8} {'floor s':>8} {'/floor':>6} {'binding':>8} "
          f"{'first s':>8} {'worst s':>8} {'tok/s':>7} {'build s':>8} {'rss GB':>7}  error")
    for r in rows:
        s = r.get("tierd_s") or r.get("allgpu_s")
        ratio = s / r["floor_s"] if s and r.get("floor_s") else None
        print(f"{r['case']:18} {f(s, '8.3f')} {f(r.get('floor_s'), '8.3f')} "
              f"{f(ratio, '6.2f')} {r.get('binding') or '-':>8} "
              f"{f(r.get('first_step_s'), '8.2f')} {f(r.get('worst_step_s'), '8.2f')} "
              f"{f(r.get('decode_tokens_per_s'), '7.2f')} {f(r.get('build_s'), '8.1f')} "
              f"{f(r.get('host_peak_anon_gb'), '7.2f')}  {(r.get('error') or '')[:60]}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder of the results file")
    ap.add_argument("--case", default=",".join(c.name for c in CASES),
                    help="comma-separated cases: " + ", ".join(BY_NAME))
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers")
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (tests)")
    ap.add_argument("--seq", type=int, default=None, help="training tokens (default 2048)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--steps", type=int, default=50, help="training steps a case")
    ap.add_argument("--warmup", type=int, default=3, help="first steps not in the medians")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated (default 128)")
    ap.add_argument("--warmup-tokens", type=int, default=2,
                    help="first tokens not in decode_tokens_per_s (measuring, placing)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds a case's process may run; steps and tokens stop in time")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="merge these results files into --out's files; measure nothing")
    ap.add_argument("--disk-probe-gib", type=float, default=None,
                    help="GiB the disk under the daemon's NVMe files is read in, for the "
                         "floor's NVMe part (default 2; --tiny 0.0625; 0: no probe)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="for the tierd cases: " + settings.HELP)
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)       # a child's case
    ap.add_argument("--rows-to", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.started = time.monotonic()
    tiny = args.tiny
    args.seq = args.seq or (32 if tiny else 2048)
    args.prompt = args.prompt or (8 if tiny else 512)
    args.new_tokens = args.new_tokens or (6 if tiny else 128)
    if args.disk_probe_gib is None:
        args.disk_probe_gib = 0.0625 if tiny else 2.0
    if tiny and args.steps == 50:
        args.steps = 6
    if args.steps <= args.warmup:
        ap.error(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    try:
        args.settings = settings.parse(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    unknown = [c for c in args.case.split(",") if c not in BY_NAME]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(BY_NAME)}")
    args.commit = args.commit or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    passed = ["--out", str(args.out), "--seq", str(args.seq), "--rank", str(args.rank),
              "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
              "--warmup-tokens", str(args.warmup_tokens), "--budget-s", str(args.budget_s),
              "--disk-probe-gib", str(args.disk_probe_gib)]
    passed += [a for kv in args.set for a in ("--set", kv)]
    passed += ["--tiny"] * tiny + ([] if args.layers is None else ["--layers", str(args.layers)])
    args.passed = passed + ([] if args.commit is None else ["--commit", args.commit])
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("tierd.placement").setLevel(logging.DEBUG)   # each plan, to stderr
    if args.merge:
        for source in args.merge:
            got = json.loads(source.read_text())
            target = args.out / source.name
            target.write_text(json.dumps(merged(target, got), indent=1))
            print(f"{len(got['rows'])} rows of {source} merged into {target}")
        return None
    if args.one is not None:
        rows = measure_one(BY_NAME[args.one], args)
        args.rows_to.write_text(json.dumps(rows))
        return None
    device = "cpu" if args.tiny or not torch.cuda.is_available() \
        else torch.cuda.get_device_name()
    rows = run_apart([BY_NAME[c] for c in args.case.split(",")], args)
    result = {"commit": args.commit, "device": device, "rows": rows}
    path = args.out / result_name(device, args.commit)
    result = merged(path, result)
    path.write_text(json.dumps(result, indent=1))
    print_table(rows)
    print(f"\nrows in {path}")
    return result


if __name__ == "__main__":
    main()
