"""Placement in a training loop: tierd vs the same Hugging Face model all on the GPU.

    python -m tierd.bench.placement --out DIR        # the four cases below, one H200
    python -m tierd.bench.placement --out DIR --case "GPT-2"   # only the cases named so
    python -m tierd.bench.placement --out DIR --case "cap 48 GB$" --profile-steps 3 --trace
    python -m tierd.bench.placement --out DIR --tiny # CPU smoke run of the same code

On the H200 machine (the results file the README table is made from):

    python -m tierd.bench.placement --out /tmp/placement
    cp /tmp/placement/placement.json \\
       benchmarks/results/placement-nvidia-h200-$(git rev-parse --short HEAD).json

Expected device time with the defaults (``--steps 50 --sync-steps 10
--ref-steps 30``), from the step times of issue 29 (0.27 / 0.45 s for 1.3B
all-GPU / capped, 0.8 / 0.93 s for 8B, 1.7 s and a 43 s first step for 13B)
plus building, attaching and ~25 s of start-up per model: ~1.8 min for the
two GPT-2 cases, ~2.7 min for 8B, ~3.3 min for 13B, ~7.8 min in all. Where
one command may run at most 10 minutes, the model shapes can also run as
separate commands into the same ``--out`` (``--case GPT-2``, then ``--case
Llama``): each run merges its rows into ``DIR/placement.json``, a row
replacing the row of the same case.

The models are the ones users bring: ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` built from their transformers config with random
weights (seeded, so the reference and tierd start from the same values;
``GPT2Config``'s defaults besides the shape; Llama in Llama-2-7B's shape at
40 and 64 layers: 8.3B and 13.2B parameters), fp32, trained with bf16
autocast on the same batch of random tokens (labels = inputs). The cases
are issue 29's table (``CASES``): GPT-2 1.3B (24 x 2048, vocabulary 50257)
B=8 T=1024 capped at 48 GB (``gpu_memory_bytes=int(48e9)``; and so with
every streamed update in the backward, ``forward_update_share=0``) and with
default arguments; Llama 8B (40 x 4096) B=4 with activation checkpointing
capped at 100 GiB; Llama 13B (64 x 4096) B=4 with checkpointing and default
arguments.

Each model shape runs in a process of its own (a process keeps the pool
segments it page-locked). In it, the all-GPU reference (fused torch AdamW)
runs first, once per batch size, unless the model's fp32 weights, gradients
and AdamW moments (16 B a parameter) exceed the device's memory (13B: its
``allgpu_*`` are null and ``allgpu_error`` says why; out of memory says so
too); then leaves the GPU. Then each tierd case builds the model again on
the GPU and runs ``tierd.attach(model, compute_dtype="bf16", **case
options)`` with ``tierd.optim.AdamW`` (the embedded daemon sized for the
model, unless ``--pool-gib`` / ``--nvme-gib`` give its sizes).

Both run the same step function on the same data in the same loop
(``tierd.bench.steploop``): ``--steps`` steps back to back from the first
(the reference: ``--ref-steps``), timed by CUDA events recorded on the
current stream between steps with one synchronize at the end (host
timestamps on the CPU), then ``--sync-steps`` steps each between two
synchronizations, then two diagnostic steps.

``DIR/placement.json``: ``{"commit", "device", "both_ways_bandwidth_gbps",
"rows": [...]}``, a row per case with

- ``case``, ``model`` (the transformers class), ``params``, ``batch``,
  ``seq``, ``options`` (attach's arguments besides the defaults),
  ``commit``, ``error`` (tierd's run failed: the exception);
- ``tierd_s`` / ``allgpu_s``: the median of the last 20 steps back to back;
  ``tierd_run_s`` / ``allgpu_run_s`` their mean; ``tierd_sync_s`` /
  ``allgpu_sync_s``: the median of the synchronized steps; ``worst_step_s``
  (``allgpu_worst_step_s``): the slowest back-to-back step after the first
  ``--warmup``; ``first_step_s`` (``allgpu_first_step_s``): the first step;
  ``tierd_steps_s``: every back-to-back step; ``tierd_retries``: the CUDA
  caching allocator's retries in each, ``tierd_mallocs`` its cudaMalloc
  calls and ``tierd_frees`` its cudaFree calls, each a device-wide
  synchronize (counted as the host queued it; null on the CPU); ``steady_steps``: how many steps the medians are of;
- ``plan_changes``: how many steps ended on another placement plan than the
  step before, not counting the first plan made (streaming everything for a
  step counts as a plan); ``plan_changed_at``: the step numbers (1-based,
  the synchronized steps following the back-to-back ones), the first
  placement included; ``placement_replans``: the placer's own count of
  re-placements (``session.stats()``); ``placement``, ``resident_gb``,
  ``planned_pcie_gb``: the plan at the end;
- ``floor_s``: for a capped case or one the all-GPU reference cannot run, the
  larger of its compute (``allgpu_s``; where that is null, tierd's
  compute-stream busy time from its profiled step) and the PCIe time of the
  bytes the plan streams at the both-ways bandwidth measured in the same
  run (best of six); null otherwise (the target there is ``allgpu_s``);
- ``tierd_peak_gb`` / ``allgpu_peak_gb``: the allocator's peak over the
  steps after warm-up; ``pcie_in_gb`` / ``pcie_out_gb``: bytes copied per
  synchronized step;
- ``tierd_diag`` / ``allgpu_diag`` (CUDA only): one step split into forward,
  backward and ``step()`` seconds, and one profiled step (``--profile-steps
  N``: N back to back, per step) into compute-stream busy time and the idle
  time beside copies or beside nothing, and when in the step each engine
  was busy (``timeline``, ``backward_at``) (``attach_step.profile``; with
  ``--trace`` its host and device trace in ``DIR/<model>/CASE.trace.json.gz``);
  tierd's also has its hooks', optimizer's and
  waits' host seconds per synchronized step (lease waits also split by the
  kind of key: compute copies, gradients, state; and the seconds new pool
  segments took to map and page-lock here) and the caching allocator's
  reserved peak, retries and cudaMalloc/cudaFree over them, and after them
  the GB each stream's cached segments reserve and hold allocated
  (``by_stream``: a cached block serves only its own stream), and
  ``mallocs``: over two more steps recorded apart, the cudaMalloc and
  cudaFree calls by stream and by the code whose allocation made them
  (``malloc_sites``), and ``host``: a cProfile of two more steps back to
  back, the host's top functions by own time and tierd's by cumulative
  time, per step (``tierd.bench.host_profile``), and ``host_samples``: the
  lines the host was on over four more, sampled;
  ``first_step_diag``: the same host counters over the first (measuring)
  step, with the GB it copied each way and of new pool segments it mapped,
  and the daemon's pool over it: GB
  made ahead when it began, GB grown, seconds reserves spent making
  segments, GB written to and read from NVMe; and the host's seconds in
  its forward, backward and ``step()`` (``host_forward_s`` ...);
- ``optimizer_build_s``: building ``tierd.optim.AdamW``, which includes
  mapping the pool segments of the first step's gradients and state
  ([Note: segments mapped ahead] in tierd.backends.hostpool).

A model process's output is kept in ``DIR/<model>/run.log``.

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
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

import tierd
import tierd.optim
from tierd.bench import settings, steploop
from tierd.bench.allocator import alloc_counts, allocator, cache_by_stream, malloc_sites
from tierd.bench.host_profile import Sampler, host_profile
from tierd.bench.bigmodel_models import Shape, checkpointed, llama_config
from tierd.client.attach import attach, detach, session_of
from tierd.client.torch_internals import allocator_settings
from tierd.client.embedded import start_daemon
from tierd.errors import TierdError

GB = 1e9
#: bytes a parameter takes in all-GPU fp32 training: weights, gradients, two AdamW moments
TRAIN_BYTES_PER_PARAM = 16


@dataclass(frozen=True, kw_only=True)
class Model:
    """A Hugging Face causal LM's shape: ``family`` "gpt2" (``GPT2LMHeadModel``,
    ``GPT2Config`` defaults besides the shape) or "llama" (``LlamaForCausalLM``,
    ``llama`` its :class:`~tierd.bench.bigmodel_models.Shape`)."""

    family: str
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    llama: Shape | None = None
    checkpointing: bool = False

    def __post_init__(self) -> None:
        if (self.family == "llama") != (self.llama is not None) or \
                self.family not in ("gpt2", "llama"):
            raise ValueError(f"family={self.family!r} with llama={self.llama}: use 'gpt2' "
                             "with layers/hidden/heads/vocab, or 'llama' with a Shape")

    @property
    def class_name(self) -> str:
        return "LlamaForCausalLM" if self.llama is not None else "GPT2LMHeadModel"

    def params(self, seq: int) -> int:
        """Parameters, from the shape (GPT-2's LM head is tied to its embedding)."""
        if self.llama is not None:
            return self.llama.params
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + seq) * h + 2 * h

    def build(self, seq: int, device: torch.device):
        """The model with seeded random weights, fp32, in train mode, on ``device``."""
        torch.manual_seed(0)
        with torch.device(device):
            if self.llama is not None:
                from transformers import LlamaForCausalLM
                model = LlamaForCausalLM(llama_config(self.llama, seq))
            else:
                from transformers import GPT2Config, GPT2LMHeadModel
                model = GPT2LMHeadModel(GPT2Config(
                    n_layer=self.layers, n_embd=self.hidden, n_head=self.heads,
                    vocab_size=self.vocab, n_positions=seq, use_cache=False,
                    bos_token_id=min(50256, self.vocab - 1),   # 50256 unless the vocabulary
                    eos_token_id=min(50256, self.vocab - 1)))  # is smaller (tiny)
        return checkpointed(model) if self.checkpointing else model.train()


def _llama2(layers: int, **over) -> Shape:
    """Llama-2-7B's shape (4096 wide, 32 heads, vocabulary 32000) with ``layers`` layers."""
    fields_ = dict(hidden=4096, intermediate=11008, layers=layers, heads=32, kv_heads=32,
                   vocab=32000)
    return Shape(**{**fields_, **over})


MODELS = {
    "gpt2-1.3B": Model(family="gpt2", layers=24, hidden=2048, heads=16, vocab=50257),
    "llama-8B": Model(family="llama", llama=_llama2(40), checkpointing=True),
    "llama-13B": Model(family="llama", llama=_llama2(64), checkpointing=True),
    "tiny-gpt2": Model(family="gpt2", layers=2, hidden=128, heads=2, vocab=1000),
    "tiny-llama": Model(family="llama", checkpointing=True, llama=_llama2(
        2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=1000)),
}


@dataclass(frozen=True)
class Case:
    """One row: a model of ``MODELS``, a batch, and attach's arguments besides the defaults."""

    name: str
    model: str
    batch: int
    options: dict = field(default_factory=dict)


#: issue 29's table
CASES = [Case("GPT-2 1.3B B=8, cap 48 GB", "gpt2-1.3B", 8, {"gpu_memory_bytes": int(48e9)}),
         # the same with every streamed update in the backward, none in the
         # next forward ([Note: updates before the next forward] in
         # tierd.updates.forward), side by side
         Case("GPT-2 1.3B B=8, cap 48 GB, updates in backward", "gpt2-1.3B", 8,
              {"gpu_memory_bytes": int(48e9), "forward_update_share": 0.0}),
         Case("GPT-2 1.3B B=8, default", "gpt2-1.3B", 8),
         Case("Llama 8B B=4, checkpointing, cap 100 GiB", "llama-8B", 4,
              {"gpu_memory_bytes": 100 << 30}),
         Case("Llama 13B B=4, checkpointing, default", "llama-13B", 4)]
#: the CPU smoke run: the same code on models of a few MB (on the CPU only a cap places)
TINY = [Case("tiny GPT-2 B=2, cap 6 MB", "tiny-gpt2", 2, {"gpu_memory_bytes": 6_000_000}),
        Case("tiny GPT-2 B=2, default", "tiny-gpt2", 2),
        Case("tiny Llama B=2, checkpointing, cap 6 MB", "tiny-llama", 2,
             {"gpu_memory_bytes": 6_000_000}),
        Case("tiny Llama B=2, checkpointing, default", "tiny-llama", 2)]


def batch_of(model: Model, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """The same random tokens for the reference and tierd (seeded by the batch size)."""
    vocab = model.llama.vocab if model.llama is not None else model.vocab
    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def reference_misfit(params: int, device_bytes: int | None) -> str | None:
    """Why all-GPU fp32 training cannot fit ``device_bytes`` (None: it may)."""
    need = TRAIN_BYTES_PER_PARAM * params
    if device_bytes is None or need <= device_bytes:
        return None
    return (f"all on GPU does not fit: {params / 1e9:.1f}B parameters x "
            f"{TRAIN_BYTES_PER_PARAM} B (fp32 weights, gradients, AdamW moments) = "
            f"{need / GB:.0f} GB, the device has {device_bytes / GB:.0f} GB; not run")


def device_bytes(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory \
        if device.type == "cuda" else None


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


def diagnose(fn, model, opt, ids, trace: Path | None = None,
             steps: int = 1) -> dict | None:
    """Where one step's time goes (CUDA only): phases, then the streams of
    ``steps`` profiled steps back to back, per step (the trace written to
    ``trace``, if given)."""
    if ids.device.type != "cuda":
        return None
    from tierd.bench.attach_step import phases, profile
    out = phases(model, opt, ids)
    out.update(profile(fn, trace, steps))
    return out


def timed(fn, steps: int, args, device: torch.device, observe=None, between=None):
    """``steps`` back to back, then ``--sync-steps`` synchronized (``between()``
    called between the two): the figures of both (see the module docstring)
    and the two loops."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    loop = steploop.back_to_back(fn, steps, device, observe)
    if between is not None:
        between()
    synced = steploop.synchronized(fn, args.sync_steps, device, observe)
    s = steploop.summary(loop.seconds, args.warmup)
    peaks = loop.peaks[args.warmup:] + synced.peaks
    figures = {"s": s["median_s"], "run_s": s["mean_s"],
               "sync_s": steploop.summary(synced.seconds, 0)["median_s"],
               "worst_step_s": s["worst_step_s"], "first_step_s": s["first_step_s"],
               "steady_steps": s["steady_steps"], "peak_gb": max(peaks) / GB,
               "steps_s": loop.seconds, "clock": loop.clock}
    return figures, loop, synced


def run_reference(model: Model, batch: int, args, device: torch.device) -> dict:
    """The all-GPU reference's ``allgpu_*`` fields for ``batch``."""
    misfit = reference_misfit(model.params(args.seq), device_bytes(device))
    if misfit is not None:
        return {"allgpu_error": misfit}
    built = opt = fn = None
    try:
        built = model.build(args.seq, device)
        opt = torch.optim.AdamW(built.parameters(), lr=1e-4, fused=device.type == "cuda")
        ids = batch_of(model, batch, args.seq, device)
        fn = steploop.train_step(built, opt, ids, device)
        figures, _, _ = timed(fn, args.ref_steps, args, device)
        out = {"allgpu_" + k: v for k, v in figures.items() if k not in ("steps_s", "clock")}
        out["allgpu_diag"] = diagnose(fn, built, opt, ids)
        return out
    except torch.OutOfMemoryError as exc:
        return {"allgpu_error": f"all on GPU: out of memory ({exc})"[:300]}
    finally:
        built = opt = fn = None   # the reference leaves the GPU before tierd's run measures it
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def plan_of(session):
    """The placement plan a session runs on, as a comparable value (None:
    everything streamed, or no placement)."""
    plan = session.placer.plan
    return None if plan is None else tuple(sorted((i, p.name) for i, p in plan.places.items()))


def plan_changes(plans: list, before=None) -> tuple[list[int], int]:
    """The steps (1-based) that ended on another plan than the step before
    (``before``: the plan at attach), and how many of them came after the
    first plan was made.

    >>> plan_changes([None, "A", "A", None, "B", "B"])
    ([2, 4, 5], 2)
    """
    at, prev = [], before
    for step, plan in enumerate(plans, 1):
        if plan != prev:
            at.append(step)
        prev = plan
    first_made = 1 if at and before is None and plans[at[0] - 1] is not None else 0
    return at, len(at) - first_made


def run_tierd(case: Case, args, device: torch.device, client) -> dict:
    """tierd's fields of ``case``'s row."""
    model = MODELS[case.model]
    built = model.build(args.seq, device)
    options, optim = settings.split(case.options)
    built = attach(built, compute_dtype="bf16", device=device,
                   **({} if client is None else {"client": client}), **options)
    try:
        began = time.perf_counter()   # includes mapping the state's segments ahead
        opt = tierd.optim.AdamW(built.parameters(), lr=1e-4, **optim)
        optimizer_build_s = time.perf_counter() - began
        ids = batch_of(model, case.batch, args.seq, device)
        fn = first_step_marked(steploop.train_step(built, opt, ids, device), built, opt)
        session = session_of(built)
        before_plan, start, first = plan_of(session), session.stats(), {}
        pool = {"start": session.client.stats()}   # the daemon's, after the optimizer told it

        counts = [alloc_counts(device)]   # the allocator's, after each step

        def observe():
            if not first:   # the host's counters over the first (measuring) step
                first.update(session.stats())
                pool["first"] = session.client.stats()
            counts.append(alloc_counts(device))
            return plan_of(session)

        marks = []   # the counters and the allocator's after the back-to-back steps
        figures, loop, synced = timed(
            fn, args.steps, args, device, observe,
            between=lambda: marks.append((session.stats(), allocator(device))))
        (before, alloc_before), after = marks[0], session.stats()
        alloc = {k: v if k == "reserved_peak_gb" else v - alloc_before[k]
                 for k, v in allocator(device).items()}   # over the synchronized steps
        if device.type == "cuda":   # what each stream keeps cached after them
            alloc["by_stream"] = cache_by_stream(device, {
                "compute": torch.cuda.current_stream(device), **session.copy.streams})
        trace = args.out / (re.sub(r"[^A-Za-z0-9.]+", "-", case.name) + ".trace.json.gz") \
            if args.trace else None
        diag = diagnose(fn, built, opt, ids, trace, args.profile_steps)
        if diag is not None:
            diag["mallocs"] = malloc_sites(fn, device, {
                "compute": torch.cuda.current_stream(device), **session.copy.streams})
            diag["host"] = host_profile(fn, 2, lambda: torch.cuda.synchronize(device))
            with Sampler() as sampler:
                for _ in range(4):
                    fn()
                torch.cuda.synchronize(device)
            diag["host_samples"] = sampler.top(25)
        n = args.sync_steps
        if diag is not None:
            diag.update({k: (after[k] - before[k]) / n
                         for k in WAITS})
            # the state updated in the forward, a step ([Note: updates before
            # the next forward] in tierd.updates.forward)
            diag["forward_update_gb"] = (after["forward_update_bytes"]
                                         - before["forward_update_bytes"]) / n / GB
            diag["allocator"] = alloc
        at, changes = plan_changes(loop.observed + synced.observed, before_plan)
        return {"optimizer_build_s": optimizer_build_s,
                "tierd_s": figures["s"], "tierd_run_s": figures["run_s"],
                "tierd_sync_s": figures["sync_s"], "worst_step_s": figures["worst_step_s"],
                "first_step_s": figures["first_step_s"], "steady_steps": figures["steady_steps"],
                "tierd_steps_s": figures["steps_s"], "clock": figures["clock"],
                # expandable segments or not ([Note: expandable segments] in
                # tierd.client.device_allocator): rows before 055560a ran without
                "allocator_settings": allocator_settings(),
                **{name: None if counts[0] is None else
                   [b[i] - a[i] for a, b in zip(counts, counts[1:args.steps + 1])]
                   for i, name in enumerate(("tierd_retries", "tierd_mallocs", "tierd_frees"))},
                "tierd_peak_gb": figures["peak_gb"], "plan_changes": changes,
                "plan_changed_at": at, "placement_replans": after.get("placement_replans"),
                "pcie_in_gb": (after["h2d_bytes"] - before["h2d_bytes"]) / n / GB,
                "pcie_out_gb": (after["d2h_bytes"] - before["d2h_bytes"]) / n / GB,
                "planned_pcie_gb": (after["planned_pcie_bytes"] or 0) / GB,
                "resident_gb": after["resident_bytes"] / GB, "placement": after["placement"],
                "tierd_diag": diag,
                "first_step_diag": {**first_step_diag(start, first, pool["start"], pool["first"]),
                                    **fn.host_phases}}
    finally:
        detach(built)


def first_step_marked(step, model, opt):
    """``step``, recording in ``host_phases`` the host's seconds in the first
    call's forward, backward and ``step()`` (no synchronization: where the
    host itself spent or waited them), and ``host_samples``: the lines the
    host was on through it, sampled (``tierd.bench.host_profile.Sampler``)."""
    phases: dict = {}

    def marked():
        if phases:
            return step()
        own = {o: vars(o).get(name) for o, name in ((model, "forward"), (opt, "step"))}
        forward, update, t = model.forward, opt.step, [time.perf_counter()]

        def fwd(*a, **k):
            out = forward(*a, **k)
            t.append(time.perf_counter())
            return out

        def upd(*a, **k):
            t.append(time.perf_counter())   # backward has returned
            out = update(*a, **k)
            t.append(time.perf_counter())
            return out

        model.forward, opt.step = fwd, upd
        try:
            with Sampler() as sampler:
                step()
        finally:
            for o, name in ((model, "forward"), (opt, "step")):
                if own[o] is None:
                    delattr(o, name)
                else:
                    setattr(o, name, own[o])
        phases.update(host_forward_s=t[1] - t[0], host_backward_s=t[2] - t[1],
                      host_step_s=t[3] - t[2], host_samples=sampler.top(25))

    marked.host_phases = phases
    return marked


#: the session's host counters the diagnostics report (seconds): in hooks, in
#: the optimizer, waiting, on lease replies, those split by the kind of key a
#: reply was first read for, and making new pool segments usable here (page
#: tables, cudaHostRegister: inside a lease wait when a lease brings one), and
#: on helper threads ahead ([Note: segments mapped ahead] in tierd.backends.hostpool)
WAITS = ("hook_seconds", "optimizer_seconds", "wait_seconds", "lease_wait_seconds",
         "lease_wait_weights_s", "lease_wait_grads_s", "lease_wait_state_s", "pool_map_seconds",
         "pool_map_ahead_seconds")


def first_step_diag(start: dict, first: dict, pool_start: dict, pool_first: dict) -> dict:
    """Where the first step's host time went: the session's counters over it
    (seconds in hooks, in the optimizer, waiting; GB copied each way), and the
    daemon's pool: the GB made ahead when it began ([Note: growth told ahead]
    in tierd.backends.hostpool), the GB it grew by, the seconds its
    reserves spent making segments meanwhile, the GB of used bytes its
    reserves wrote zeros into and the seconds that took its loop (see
    [Note: zero slots] in tierd.backends.hostpool), and the GB it wrote to and
    read from NVMe (a pool too small for the first update's gradients and
    new state spills)."""
    out = {k: first[k] - start[k] for k in WAITS}
    out.update({k.replace("bytes", "gb"): (first[k] - start[k]) / GB
                for k in ("h2d_bytes", "d2h_bytes", "pool_mapped_bytes",
                          "pool_mapped_ahead_bytes")})
    out.update({"pool_mapped_ahead_gb_at_start": start["pool_mapped_ahead_bytes"] / GB,
                "pool_spare_gb_at_start": pool_start["pool_spare_bytes"] / GB,
                "pool_grown_gb": (pool_first["pool_mapped_bytes"]
                                  - pool_start["pool_mapped_bytes"]) / GB,
                "pool_segment_wait_s": (pool_first["pool_segment_wait_s"]
                                        - pool_start["pool_segment_wait_s"]),
                "pool_zeroed_gb": (pool_first.get("pool_zeroed_bytes", 0)
                                   - pool_start.get("pool_zeroed_bytes", 0)) / GB,
                "pool_zero_s": (pool_first.get("pool_zero_s", 0)
                                - pool_start.get("pool_zero_s", 0)),
                "nvme_written_gb": (pool_first["bytes_to_nvme"]
                                    - pool_start["bytes_to_nvme"]) / GB,
                "nvme_read_gb": (pool_first["bytes_to_pool"]
                                 - pool_start["bytes_to_pool"]) / GB})
    return out


def floor(row: dict, bandwidth: float) -> float | None:
    """A capped or non-fitting case's floor: the larger of its compute (the
    all-GPU step; where that did not run, tierd's compute-stream busy time)
    and the planned PCIe bytes at ``bandwidth``."""
    compute = row["allgpu_s"]
    if compute is None:
        compute = (row.get("tierd_diag") or {}).get("compute_busy_s")
    if compute is None:
        return None
    return max(compute, (row["planned_pcie_gb"] or 0) * GB / bandwidth)


#: every figure of a row (None in a row whose run failed)
ROW_FIELDS = ("model", "params", "batch", "seq", "options", "allgpu_s", "allgpu_run_s",
              "allgpu_sync_s", "allgpu_worst_step_s", "allgpu_first_step_s",
              "allgpu_steady_steps", "allgpu_peak_gb", "allgpu_diag", "allgpu_error",
              "tierd_s", "tierd_run_s", "tierd_sync_s", "worst_step_s", "first_step_s",
              "steady_steps", "tierd_steps_s", "tierd_retries", "tierd_mallocs", "tierd_frees",
              "clock", "allocator_settings",
              "tierd_peak_gb", "plan_changes", "plan_changed_at", "placement_replans",
              "pcie_in_gb", "pcie_out_gb", "planned_pcie_gb", "resident_gb", "placement", "tierd_diag",
              "first_step_diag", "floor_s")


def measure(args, cases: list[Case], device: torch.device) -> tuple[list[dict], float]:
    """Every case of ``cases`` in this process (one model at a time)."""
    bandwidth = both_ways_bandwidth(device)
    daemon = None
    if args.pool_gib is not None or args.nvme_gib is not None:
        daemon = start_daemon(pool=None if args.pool_gib is None else args.pool_gib << 30,
                              nvme_size=None if args.nvme_gib is None else args.nvme_gib << 30)
    rows = []
    try:
        for name in dict.fromkeys(c.model for c in cases):
            model, references = MODELS[name], {}
            for case in (c for c in cases if c.model == name):
                if case.batch not in references:
                    references[case.batch] = run_reference(model, case.batch, args, device)
                row = {k: None for k in ROW_FIELDS}
                row.update(case=case.name, model=model.class_name, error=None,
                           params=model.params(args.seq), batch=case.batch, seq=args.seq,
                           options=case.options, commit=args.commit,
                           **references[case.batch])
                client = None if daemon is None else tierd.connect(daemon.socket)
                try:
                    row.update(run_tierd(case, args, device, client))
                except (TierdError, torch.OutOfMemoryError) as exc:
                    traceback.print_exc()
                    row["error"] = f"tierd: {type(exc).__name__}: {exc}"[:500]
                if row["error"] is None and ("gpu_memory_bytes" in case.options
                                             or row["allgpu_s"] is None):
                    row["floor_s"] = floor(row, bandwidth)
                rows.append(row)
                print(json.dumps(row), flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if daemon is not None:
            daemon.stop()
    return rows, bandwidth


def measure_apart(args, models: list[str]) -> tuple[list[dict], float]:
    """Each model in a process of its own: a process keeps the pool segments
    it page-locked, and the host page-locks only so much (~70 GiB on the H200
    host), so one model's pool cannot follow another's in one process."""
    rows, bandwidth = [], 0.0
    for name in models:
        out = args.out / name
        cmd = [sys.executable, "-m", "tierd.bench.placement", "--out", str(out), "--only", name,
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--sync-steps", str(args.sync_steps), "--ref-steps", str(args.ref_steps),
               "--case", args.case, "--profile-steps", str(args.profile_steps)
               ] + ["--trace"] * args.trace
        cmd += [a for kv in args.set for a in ("--set", kv)]
        cmd += [] if args.commit is None else ["--commit", args.commit]
        cmd += [] if args.pool_gib is None else ["--pool-gib", str(args.pool_gib)]
        cmd += [] if args.nvme_gib is None else ["--nvme-gib", str(args.nvme_gib)]
        (out / "placement.json").unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        log = out / "run.log"   # kept: a process that dies leaves its reason here
        with log.open("w") as f:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        print(log.read_text()[-4000:], flush=True)
        if code != 0:
            rows += [{**{k: None for k in ROW_FIELDS}, "case": c.name, "commit": args.commit,
                      "error": f"its process ({name}) exited {code}; see {log}"}
                     for c in settings.with_settings(CASES, args.set)
                     if c.model == name and matches(c.name, args.case)]
            continue
        got = json.loads((out / "placement.json").read_text())
        rows += got["rows"]
        bandwidth = max(bandwidth, got["both_ways_bandwidth_gbps"] * GB)
    return rows, bandwidth


def matches(name: str, case: str) -> bool:
    """A case named ``name`` is one ``--case`` selects (a regular expression
    found in the name; plain words select the names that contain them)."""
    return re.search(case, name) is not None


def merged(path: Path, result: dict) -> dict:
    """``result`` with the rows of an earlier ``path`` it has no row for kept
    (a row replaces the row of the same case; the others keep their order)."""
    if not path.exists():
        return result
    old = json.loads(path.read_text())
    new = {r["case"]: r for r in result["rows"]}
    rows = [new.pop(r["case"], r) for r in old.get("rows", [])] + list(new.values())
    return {**result, "rows": rows}


def print_table(rows: list[dict]) -> None:
    def fmt(v, f):
        return format("-", ">" + re.match(r"\d*", f).group()) if v is None else format(v, f)

    def ratio(r, a, b):
        return r.get(a) / r.get(b) if r.get(a) and r.get(b) else None
    print(f"\n{'case':42} {'all-GPU s':>9} {'tierd s':>8} {'ratio':>6} {'floor s':>8} "
          f"{'/floor':>6} {'sync':>6} {'first s':>8} {'worst s':>8} {'changes':>7}")
    for r in rows:
        print(f"{r['case']:42} {fmt(r.get('allgpu_s'), '9.4f')} {fmt(r.get('tierd_s'), '8.4f')} "
              f"{fmt(ratio(r, 'tierd_s', 'allgpu_s'), '6.2f')} {fmt(r.get('floor_s'), '8.4f')} "
              f"{fmt(ratio(r, 'tierd_s', 'floor_s'), '6.2f')} "
              f"{fmt(ratio(r, 'tierd_sync_s', 'allgpu_sync_s'), '6.2f')} "
              f"{fmt(r.get('first_step_s'), '8.3f')} {fmt(r.get('worst_step_s'), '8.3f')} "
              f"{fmt(r.get('plan_changes'), '7d')}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50, help="tierd's back-to-back steps a case")
    ap.add_argument("--ref-steps", type=int, default=30,
                    help="the all-GPU reference's back-to-back steps (no placement to settle)")
    ap.add_argument("--sync-steps", type=int, default=10,
                    help="synchronized steps after the back-to-back ones")
    ap.add_argument("--warmup", type=int, default=3,
                    help="first steps left out of the worst step (and of the medians)")
    ap.add_argument("--pool-gib", type=int, default=None,
                    help="a daemon with this pool (default: attach's embedded daemon, sized "
                         "for the model and the machine)")
    ap.add_argument("--nvme-gib", type=int, default=None)
    ap.add_argument("--case", default="", help="only the cases whose name this regular "
                    "expression is found in (e.g. 'cap 48 GB': a quick re-run of those "
                    "cases; 'cap 48 GB$': of that one alone)")
    ap.add_argument("--only", default="", help="comma-separated models of MODELS "
                    "(gpt2-1.3B,llama-8B), run in this process")
    ap.add_argument("--trace", action="store_true", help="write each tierd case's profiled "
                    "step (host and device) as CASE.trace.json.gz")
    ap.add_argument("--profile-steps", type=int, default=1, help="steps the diagnostic "
                    "profile runs back to back (its figures are per step; 1: one step, "
                    "synchronized before and after)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny models")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="for the cases that do not name KEY: " + settings.HELP)
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    args = ap.parse_args(argv)
    try:
        settings.with_settings([], args.set)
        re.compile(args.case)
    except ValueError as exc:
        ap.error(str(exc))
    except re.error as exc:
        ap.error(f"--case {args.case!r} is not a regular expression: {exc}")
    if args.tiny:
        args.seq, args.steps, args.ref_steps, args.sync_steps, args.warmup = 16, 6, 4, 2, 2
        args.pool_gib, args.nvme_gib = 1, 1
    for flag in ("steps", "ref_steps"):
        if getattr(args, flag) <= args.warmup:
            ap.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must exceed "
                     f"--warmup={args.warmup}")
    for flag in ("sync_steps", "profile_steps"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be at least 1")
    args.commit = args.commit or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    logging.basicConfig(format="[%(name)s] %(message)s")
    logging.getLogger("tierd.placement").setLevel(logging.DEBUG)   # each plan, to stderr
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        rows, bandwidth = measure(args, [c for c in settings.with_settings(TINY, args.set)
                                         if matches(c.name, args.case)], device)
    elif args.only:
        rows, bandwidth = measure(args, [c for c in settings.with_settings(CASES, args.set)
                                         if c.model in args.only.split(",")
                                         and matches(c.name, args.case)], device)
    else:
        rows, bandwidth = measure_apart(args, list(dict.fromkeys(
            c.model for c in settings.with_settings(CASES, args.set) if matches(c.name, args.case))))
    result = {"commit": args.commit, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "both_ways_bandwidth_gbps": bandwidth / GB,
              "rows": rows}
    path = args.out / "placement.json"
    path.write_text(json.dumps(merged(path, result), indent=1))
    print_table(rows)


if __name__ == "__main__":
    main()
