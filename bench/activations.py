"""Activation tiering: peak memory vs step time for each policy and budget.

    python -m bench.activations            # CUDA: GPT-2 1.3B, T=1024, B=8 and 16
    python -m bench.activations --quick    # CPU: a small GPT-2, a few seconds

Rows: no tiering, ``offload``, ``recompute``, ``auto`` at several budgets
(fractions of the saved bytes measured with no tiering), and
``torch.autograd.graph.save_on_cpu``. Peak memory is the CUDA allocator's peak
over a step; on CPU it is the peak of the process's anonymous resident memory
above the model's (sampled; large allocations are mmapped so frees show up;
the shared pool is not anonymous memory, so it is not counted), i.e. what would
have been device memory. Times are medians of the timed steps, measured side
by side in one run; ratios are to no tiering.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tierd
from tierd.client.activations import tier_activations
from tierd.client.embedded import start_daemon

CUDA_MODEL = dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257)
CPU_MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024)
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)


class PeakMemory:
    """Peak bytes over a block: CUDA allocator, or sampled RssAnon on CPU."""

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
        result = {"peak": 0}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            yield result
            torch.cuda.synchronize()
            result["peak"] = torch.cuda.max_memory_allocated() - base
            return
        gc.collect()
        base = self._rss_anon()
        stop = threading.Event()
        peak = [base]

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
            result["peak"] = max(peak[0], self._rss_anon()) - base


def build(cfg: dict, seq: int, device: torch.device) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        **cfg)
    return GPT2LMHeadModel(config).to(device).train()


def step(model, ids, autocast: bool) -> None:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def run_case(model, ids, *, ctx_factory, peak: PeakMemory, steps: int, warmup: int,
             autocast: bool) -> dict:
    times, peaks = [], []
    for i in range(warmup + steps):
        with ctx_factory(), peak.measure() as m:
            if peak.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, ids, autocast)
            if peak.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
            peaks.append(m["peak"])
    return {"step_s": statistics.median(times), "peak_bytes": max(peaks)}


def saved_bytes(model, ids, autocast: bool) -> int:
    """Bytes autograd saves in one forward (not parameters), for the budgets."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
    del loss
    return sum(seen.values())


def bench(device: torch.device, cfg: dict, batches: list[int], seq: int, *,
          steps: int, warmup: int, client) -> list[dict]:
    rows = []
    autocast = device.type == "cuda"
    peak = PeakMemory(device)
    min_bytes = 1 << 20 if device.type == "cuda" else 64 << 10
    for batch in batches:
        model = build(cfg, seq, device)
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq), device=device)
        total = saved_bytes(model, ids, autocast)
        cases: list[tuple[str, int | None, object]] = [
            ("none", None, None), ("offload", None, "offload"), ("recompute", None, "recompute")]
        cases += [("auto", int(f * total), "auto") for f in BUDGET_FRACTIONS]
        for name, budget, policy in cases:
            handle = None
            if policy is not None:
                handle = tier_activations(model, client, policy=policy, budget_bytes=budget,
                                          min_bytes=min_bytes, verbose=True)
            try:
                row = run_case(model, ids, ctx_factory=contextlib.nullcontext, peak=peak,
                               steps=steps, warmup=warmup, autocast=autocast)
            finally:
                if handle is not None:
                    handle.close()
            rows.append(dict(batch=batch, policy=name, budget_bytes=budget,
                             saved_bytes=total, **row))
        pin = device.type == "cuda"
        row = run_case(model, ids, peak=peak, steps=steps, warmup=warmup, autocast=autocast,
                       ctx_factory=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin))
        rows.append(dict(batch=batch, policy="save_on_cpu", budget_bytes=None,
                         saved_bytes=total, **row))
        del model
        gc.collect()
    return rows


def report(rows: list[dict]) -> str:
    out = [f"{'B':>3} {'policy':<12} {'budget MiB':>10} {'peak MiB':>9} {'step s':>8} "
           f"{'x none':>7} {'peak/none':>9}"]
    base = {r["batch"]: r for r in rows if r["policy"] == "none"}
    for r in rows:
        b = base[r["batch"]]
        budget = "-" if r["budget_bytes"] is None else f"{r['budget_bytes'] / 2**20:.0f}"
        out.append(f"{r['batch']:>3} {r['policy']:<12} {budget:>10} "
                   f"{r['peak_bytes'] / 2**20:>9.1f} {r['step_s']:>8.3f} "
                   f"{r['step_s'] / b['step_s']:>7.2f} "
                   f"{r['peak_bytes'] / max(b['peak_bytes'], 1):>9.2f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model on CPU")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.quick:
        device, cfg, batches, seq, steps, warmup = torch.device("cpu"), CPU_MODEL, [8], 128, 3, 1
        pool = 256 << 20
    elif torch.cuda.is_available():
        device, cfg, batches, seq, steps, warmup = torch.device("cuda"), CUDA_MODEL, [8, 16], \
            1024, 5, 2
        pool = 64 << 30
    else:
        print("no CUDA here: run with --quick for the CPU version", file=sys.stderr)
        return 2
    daemon = start_daemon(pool=pool, nvme_size=max(pool, 1 << 30))
    try:
        client = tierd.connect(daemon.socket)
        rows = bench(device, cfg, batches, seq, steps=steps, warmup=warmup, client=client)
        client.close()
    finally:
        daemon.stop()
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
