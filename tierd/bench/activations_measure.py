"""Measuring one benchmark case: the model, one training step, its peak memory
and step time, and the host memory pinned copies may take.

What the figures mean is in [Note: peak memory and budgets] and [Note: bench
phases and host memory] in tierd/bench/activations.py, which runs the cases.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import statistics
import threading
import time
from pathlib import Path

import torch

from tierd.backends.memory import available_memory
from tierd.client.torch_internals import storage_id

#: auto's steps before its warm-up: the profiling step, then the plan's first
#: step, after which (on CUDA) the plan may be made again for the next steps.
AUTO_STEPS = 2
GiB = 1 << 30


class PeakMemory:
    """Peak bytes over a step: CUDA allocator, or sampled RssAnon on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if not self.cuda:
            with contextlib.suppress(OSError, AttributeError):
                # glibc: allocations >= 256 KiB are mmapped, so a free returns
                # the pages and RssAnon follows live tensors.
                ctypes.CDLL("libc.so.6").mallopt(-3, 256 << 10)   # M_MMAP_THRESHOLD

    @staticmethod
    def _rss_anon() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    @contextlib.contextmanager
    def measure(self):
        """Yields a dict that holds, after: ``peak`` (above the start), ``total``
        and ``reserved`` (CUDA: the allocator's reserved peak above the start's
        allocated bytes; on CPU the same as ``peak``)."""
        result = {"peak": 0, "total": 0, "reserved": 0}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            yield result
            torch.cuda.synchronize()
            result["total"] = torch.cuda.max_memory_allocated()
            result["peak"] = result["total"] - base
            result["reserved"] = torch.cuda.max_memory_reserved() - base
            return
        gc.collect()
        base = self._rss_anon()
        stop, peak = threading.Event(), [base]

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], self._rss_anon())
                time.sleep(0.0005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield result
        finally:
            stop.set()
            thread.join()
            result["total"] = max(peak[0], self._rss_anon())
            result["peak"] = result["reserved"] = result["total"] - base


def build(cfg: dict, seq: int, device: torch.device):
    """GPT-2 with random fp32 weights, made on ``device`` (no host copy of 1.3B)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, bos_token_id=0, eos_token_id=0, **cfg)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.train()


def step(model, ids: torch.Tensor) -> None:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.is_cuda):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def probe(model, ids: torch.Tensor) -> tuple[int, int]:
    """(bytes autograd saves in one forward, parameters excluded; pinned host
    bytes save_on_cpu would take for it: every saved tensor, rounded up to a
    power of two like torch's caching host allocator; 0 on CPU)."""
    params = {storage_id(p) for p in model.parameters()}
    saved: dict[int, int] = {}
    pinned = [0]

    def pack(t):
        if storage_id(t) not in params:
            saved[storage_id(t)] = t.untyped_storage().nbytes()
        if t.is_cuda:
            pinned[0] += 1 << max(0, (t.numel() * t.element_size() - 1).bit_length())
        return t.detach()   # returning t itself would leak saved outputs (a cycle)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.is_cuda):
            loss = model(input_ids=ids, labels=ids).loss
    del loss
    return sum(saved.values()), pinned[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(model, ids, *, peak: PeakMemory, ctx_factory, warmup: int, steps: int,
                deadline: float, handle=None) -> dict:
    """Median step time and peak memory of the timed steps (after ``warmup``),
    and, with a tiering ``handle``, the bytes it copied per timed step."""
    times, peaks, totals, reserved, copied = [], [], [], [], None
    for i in range(warmup + steps):
        if i > warmup and time.monotonic() + times[-1] > deadline:
            break   # one timed step at least; the rest only while time is left
        if i == warmup and handle is not None:
            copied = handle.stats()
        with ctx_factory(), peak.measure() as m:
            sync(ids.device)
            t0 = time.perf_counter()
            step(model, ids)
            sync(ids.device)
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            peaks.append(m["peak"])
            totals.append(m["total"])
            reserved.append(m["reserved"])
    row = {"step_s": statistics.median(times), "step_times": times, "steps_timed": len(times),
           "peak_bytes": max(peaks), "peak_total_bytes": max(totals),
           "peak_reserved_bytes": max(reserved)}
    if handle is not None:
        end = handle.stats()
        for k in ("d2h_bytes", "h2d_bytes"):
            row[f"{k}_per_step"] = (end[k] - copied[k]) // len(times)
    return row


def memory_check(handle, budget: int) -> dict:
    """auto's first planned step against its model (see [Note: measured memory
    correction] in tierd/client/activations/plan.py): bytes above the step's
    start, the baseline taken off (what keep-all holds beyond its saved
    activations at its peak)."""
    check = handle.check
    row = {"predicted_bytes": check.predicted, "measured_bytes": check.measured,
           "baseline_bytes": check.baseline, "growth_bytes": check.step.peak(),
           "replanned": check.plan is not None}
    if check.plan is not None:   # the plan timed, its estimate counting what was measured
        row["first_plan"] = check.ran.describe(handle.profiles, budget)
        row["replan_predicted_bytes"] = check.plan.memory
    return row


def host_available(host_bytes: int | None) -> int:
    """Host bytes free for pinned memory: MemAvailable, or, given the machine's
    size, that size less what is in use (the larger: on a VM whose memory grows
    as it is used, MemTotal and MemAvailable start far below the limit)."""
    if host_bytes is None:
        return available_memory()
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key] = int(value.split()[0]) * 1024
    in_use = info["MemTotal"] - info["MemAvailable"]
    return max(info["MemAvailable"], host_bytes - in_use)
