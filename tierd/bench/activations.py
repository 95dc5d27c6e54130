"""Activation tiering: peak device memory vs step time, per policy and memory budget.

    python -m tierd.bench.activations --out DIR --host-gib 128   # CUDA: GPT-2 1.3B, T=1024, B=8, 16
    python -m tierd.bench.activations --quick                      # CPU: a small GPT-2, < 1 minute

For each batch size one process measures, side by side: no tiering (``none``),
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, tierd ``offload`` and
``recompute``, and tierd ``auto`` at several memory budgets. A row is the
median time of the timed steps (forward + backward + zero_grad, bf16 autocast
on CUDA, the device synchronized around each step) and the peak memory over
them. Per budget it says which fixed policy (none, offload, recompute) is
fastest within the budget, whether ``auto`` fits it and is within 5 % of that
policy's step time, and whether ``auto`` beats save_on_cpu where both fit.

``--budget-s`` caps the run's wall time: past it no case starts, and a case's
timed steps stop early (at least one) when the next would cross it. The
outputs, ``activations-<device>.json`` / ``.md`` / ``.png`` under ``--out``, are
rewritten after every case, so a run cut short keeps what it measured.

This module runs the cases (:class:`Run`) and holds the command line;
``activations_measure`` measures one case, ``activations_verdicts`` compares
``auto`` with the fixed policies per budget, ``activations_report`` renders the
Markdown and the PNG.

[Note: peak memory and budgets]
Peak memory is the CUDA allocator's peak during a step minus what was
allocated when it began (the fp32 weights): gradients, saved activations and
workspace. On CPU it is the sampled peak of the process's anonymous resident
memory above the step's start (large allocations are mmapped, so frees show
up; the tierd pool is shared memory, not counted), i.e. what would have been
device memory. A budget caps that peak: ``overhead + f * saved`` for each
fraction ``f``, where ``saved`` is the bytes autograd saves in one forward
(parameters excluded) and ``overhead = peak(none) - saved`` is the rest of the
step; ``auto`` is given ``budget_bytes = f * saved`` (on CUDA it reads that
budget the same way: see [Note: measured memory correction] in
tierd/client/activations/plan.py). A row *fits* a budget
when its measured peak is at most the cap (``f = 1`` is ``none``'s own peak).
Rows also give the allocator's *reserved* peak: a tensor freed while tierd's
copy stream still reads it leaves the allocated count at once but its memory
only once the copy is done, so a gap between the two shows memory held by
copies in flight (a hard cap would make the allocator wait for them).

[Note: bench phases and host memory]
save_on_cpu pins host memory for every tensor it saves (torch's caching host
allocator rounds each up to a power of two) and tierd's pool is pinned host
memory as well: at B=16 the two would not both fit the H200 host's 128 GiB.
So ``none`` and save_on_cpu run first for every batch, the pinned cache is
emptied after each, and only then does the daemon start, its pool sized to
the largest batch's saved bytes (segments are made as they fill, so an unused
pool costs nothing). save_on_cpu is skipped, with the reason, where its
pinned need exceeds the available memory (``--host-gib``: the machine's size,
for a VM whose MemAvailable reads low until its memory is used).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The --budget-s clock: torch is already imported with the tierd package this
# module lives in, so the clock starts after it.
STARTED = time.monotonic()

import torch  # noqa: E402

import tierd  # noqa: E402
from tierd.backends.memory import available_memory  # noqa: E402
from tierd.bench import DEFAULT_OUT  # noqa: E402
from tierd.bench.activations_measure import (  # noqa: E402
    AUTO_STEPS, GiB, PeakMemory, build, host_available, memory_check,
    probe, sync, timed_steps)
from tierd.bench.activations_report import describe, markdown, plot  # noqa: E402
from tierd.bench.activations_verdicts import verdicts  # noqa: E402
from tierd.client.torch_internals import free_pinned_host_cache  # noqa: E402
from tierd.client.activations import tier_activations  # noqa: E402
from tierd.errors import TierdError  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What a run measures; ``--quick`` and the CUDA run differ only here."""

    model: dict               # GPT2Config fields
    batches: tuple[int, ...]
    seq: int
    steps: int                # timed steps per case (median); fewer when time runs short
    warmup: int               # untimed steps first (auto: AUTO_STEPS more)
    #: Budgets (see [Note: peak memory and budgets]) in the order they run:
    #: the first three for every batch, then the rest, so a run cut short by
    #: --budget-s still has a spread of budgets for each batch.
    fractions: tuple[float, ...]
    min_bytes: int            # tier_activations(min_bytes=...)
    #: tier_activations(prefetch_bytes=...); None: its default (128 MiB, tiny
    #: next to GPT-2 1.3B's saved bytes; the small model needs a smaller window
    #: to show what backward holds).
    prefetch_bytes: int | None
    budget_s: float           # default --budget-s
    host_margin: int          # host memory left free when sizing pinned memory and pool
    nvme_size: int            # the daemon's NVMe file (used only if the pool is short)


FULL = Sizes(model=dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=50257),
             batches=(8, 16), seq=1024, steps=3, warmup=1,
             fractions=(0.1, 0.5, 1.0, 0.25, 0.75), min_bytes=1 << 20, prefetch_bytes=None,
             budget_s=210, host_margin=12 * GiB, nvme_size=8 * GiB)
QUICK = Sizes(model=dict(n_layer=4, n_embd=128, n_head=4, vocab_size=512),
              batches=(8,), seq=64, steps=2, warmup=1, fractions=(0.25, 0.5, 1.0),
              min_bytes=64 << 10, prefetch_bytes=1 << 20, budget_s=60,
              host_margin=2 * GiB, nvme_size=1 * GiB)


# ------------------------------------------------------------------- the run
class Run:
    """One bench run: its clock, rows and output files."""

    def __init__(self, sizes: Sizes, device: torch.device, out: Path, *, budget_s: float,
                 quick: bool, nvme: Path | None, host_bytes: int | None) -> None:
        self.sizes, self.device, self.out, self.nvme = sizes, device, out, nvme
        self.host_bytes = host_bytes
        self.deadline = STARTED + budget_s
        self.peak = PeakMemory(device)
        self.rows: list[dict] = []
        self.saved: dict[int, int] = {}     # batch -> bytes saved in one forward
        self.pinned: dict[int, int] = {}    # batch -> pinned bytes save_on_cpu takes
        self.name = f"activations-{device.type}" + ("-quick" if quick else "")
        cuda = device.type == "cuda"
        self.meta = {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "model": f"GPT-2 ({sizes.model['n_layer']} layers, d={sizes.model['n_embd']}, "
                     f"vocab {sizes.model['vocab_size']})",
            "seq": sizes.seq, "batches": list(sizes.batches), "fractions": list(sizes.fractions),
            "min_bytes": sizes.min_bytes, "prefetch_bytes": sizes.prefetch_bytes,
            "steps": sizes.steps, "warmup": sizes.warmup,
            "budget_s": budget_s, "autocast": "bf16" if cuda else None,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python -m tierd.bench.activations", *sys.argv[1:]]),
            "unit": "GiB" if cuda else "MiB",
        }

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - STARTED:6.1f} s] {text}", file=sys.stderr, flush=True)

    def case(self, model, ids, policy: str, *, client=None, fraction: float | None = None,
             cap: int | None = None, auto_bytes: int | None = None,
             skip: str | None = None) -> dict:
        """Measure one (batch, policy, budget); a failure or skip is a row too."""
        batch = ids.shape[0]
        row = dict(batch=batch, policy=policy, fraction=fraction, budget_bytes=cap,
                   auto_budget_bytes=auto_bytes, saved_bytes=self.saved[batch])
        warmup = self.sizes.warmup + AUTO_STEPS * (policy == "auto")
        slowest = max((r["step_s"] for r in self.rows
                       if r["batch"] == batch and r["status"] == "ok"), default=0.0)
        if skip is None and self.remaining() < max(1e-3, (warmup + 1) * slowest):
            skip = f"--budget-s spent ({self.remaining():.0f} s left)"
        if skip is not None:
            row.update(status="skipped", reason=skip)
        else:
            try:
                row.update(status="ok", **self._measure(model, ids, policy, client, auto_bytes,
                                                        warmup))
            # A bench run is one shot on a lent machine: a case that fails
            # (out of memory, pool full) is recorded and the run goes on.
            except (RuntimeError, TierdError, OSError) as exc:
                row.update(status="error", reason=f"{type(exc).__name__}: {exc}"[:600])
            finally:
                model.zero_grad(set_to_none=True)
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.rows.append(row)
        self.log(describe(row, self.meta["unit"]))
        self.write_json()
        return row

    def _measure(self, model, ids, policy, client, auto_bytes, warmup) -> dict:
        common = dict(peak=self.peak, warmup=warmup, steps=self.sizes.steps,
                      deadline=self.deadline)
        if policy == "none":
            return timed_steps(model, ids, ctx_factory=contextlib.nullcontext, **common)
        if policy == "save_on_cpu":
            pin = self.device.type == "cuda"
            try:
                return timed_steps(model, ids, **common, ctx_factory=lambda:
                                   torch.autograd.graph.save_on_cpu(pin_memory=pin))
            finally:
                free_pinned_host_cache()
        options = {} if self.sizes.prefetch_bytes is None else \
            {"prefetch_bytes": self.sizes.prefetch_bytes}
        handle = tier_activations(model, client, policy=policy, budget_bytes=auto_bytes,
                                  min_bytes=self.sizes.min_bytes, verbose=False, **options)
        try:
            row = timed_steps(model, ids, ctx_factory=contextlib.nullcontext, handle=handle,
                              **common)
            if handle.plan is not None:
                row["plan"] = handle.plan.describe(handle.profiles, auto_bytes)
                row["plan_modes"] = {m.value: sum(x is m for x in handle.plan.modes)
                                     for m in set(handle.plan.modes)}
            if handle.check is not None:
                row["memory_check"] = memory_check(handle, auto_bytes)
            return row
        finally:
            handle.close()

    def execute(self) -> None:
        t0 = time.monotonic()
        model = build(self.sizes.model, self.sizes.seq, self.device)
        sync(self.device)
        self.meta["build_s"] = round(time.monotonic() - t0, 1)
        gen = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, self.sizes.model["vocab_size"], (b, self.sizes.seq),
                             generator=gen).to(self.device) for b in self.sizes.batches]
        for x in ids:
            self.saved[x.shape[0]], self.pinned[x.shape[0]] = probe(model, x)
        self.log(f"model built in {self.meta['build_s']} s; saved bytes per forward "
                 + ", ".join(f"B={b}: {n / 2**30:.2f} GiB" for b, n in self.saved.items()))
        for x in ids:   # see [Note: bench phases and host memory]
            self.case(model, x, "none")
            self.case(model, x, "save_on_cpu", skip=self._pinned_short(x.shape[0]))
        self.meta["pinned_cache_freed"] = free_pinned_host_cache()
        self._tierd_cases(model, ids)

    def _pinned_short(self, batch: int) -> str | None:
        need = self.pinned[batch]
        free = host_available(self.host_bytes) - self.sizes.host_margin
        if need > free:
            return (f"needs ~{need / GiB:.1f} GiB of pinned host memory, "
                    f"{free / GiB:.1f} GiB available (less a {self.sizes.host_margin / GiB:.0f} "
                    f"GiB margin)")
        return None

    def _tierd_cases(self, model, ids) -> None:
        from tierd.client.embedded import start_daemon
        # The daemon refuses a pool above MemAvailable; it makes segments as they fill.
        room = max(256 << 20, available_memory() - self.sizes.host_margin)
        pool = min(max(self.saved.values()) * 3 // 2 + (256 << 20), room)
        self.meta["pool_bytes"] = pool
        if self.remaining() <= 0:   # every case would be skipped: no daemon needed
            self._tierd_rows(model, ids, None)
            return
        daemon = start_daemon(pool=pool, nvme_size=self.sizes.nvme_size, nvme_dir=self.nvme)
        try:
            client = tierd.connect(daemon.socket)
            try:
                self._tierd_rows(model, ids, client)
            finally:
                client.close()
        finally:
            daemon.stop()

    def _tierd_rows(self, model, ids, client) -> None:
        for x in ids:
            self.case(model, x, "recompute", client=client)
            self.case(model, x, "offload", client=client)
            self._auto_rows(model, x, client, self.budgets(x.shape[0])[:3])
        for x in ids:
            self._auto_rows(model, x, client, self.budgets(x.shape[0])[3:])

    def _auto_rows(self, model, x, client, budgets) -> None:
        for f, cap, auto_bytes, skip in budgets:
            self.case(model, x, "auto", client=client, fraction=f, cap=cap,
                      auto_bytes=auto_bytes, skip=skip)

    def budgets(self, batch: int) -> list[tuple[float, int | None, int, str | None]]:
        """(fraction, peak cap, auto's budget_bytes, why skipped) per budget; see
        [Note: peak memory and budgets]."""
        saved = self.saved[batch]
        none = next((r for r in self.rows if r["batch"] == batch and r["policy"] == "none"
                     and r["status"] == "ok"), None)
        if none is None:
            return [(f, None, int(f * saved), "no `none` row to size the budget from")
                    for f in self.sizes.fractions]
        overhead = max(0, none["peak_bytes"] - saved)
        return [(f, none["peak_bytes"] if f == 1.0 else overhead + int(f * saved),
                 int(f * saved), None) for f in self.sizes.fractions]

    # ---------------------------------------------------------------- outputs
    def results(self) -> dict:
        self.meta["wall_s"] = round(time.monotonic() - STARTED, 1)
        return {"meta": self.meta, "rows": self.rows, "budgets": verdicts(self.rows)}

    def write_json(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.name}.json"
        path.write_text(json.dumps(self.results(), indent=1))
        return path

    def write_all(self) -> list[Path]:
        results = self.results()
        paths = [self.write_json(), self.out / f"{self.name}.md"]
        paths[1].write_text(markdown(results))
        png = self.out / f"{self.name}.png"
        why = plot(results, png)
        if why is None:
            paths.append(png)
        else:
            self.log(f"no PNG: {why}")
        return paths


# --------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tierd.bench.activations",
                                description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model on CPU (a smoke run)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for the JSON, Markdown and PNG (default: ./{DEFAULT_OUT}; "
                        "with --quick a new temporary directory)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time cap in seconds from start, model build included "
                        f"(default {QUICK.budget_s:.0f} quick, {FULL.budget_s:.0f} full)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case (median)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes")
    p.add_argument("--host-gib", type=float, default=None,
                   help="the machine's memory in GiB, for a VM whose MemAvailable reads "
                        "low until memory is used (default: trust MemAvailable)")
    p.add_argument("--nvme", type=Path, default=None,
                   help="directory of the daemon's NVMe file (default under ~/.cache/tierd)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sizes = QUICK if args.quick else FULL
    if args.steps is not None:
        sizes = dataclasses.replace(sizes, steps=max(1, args.steps))
    if args.batches:
        sizes = dataclasses.replace(sizes, batches=tuple(int(b) for b in args.batches.split(",")))
    if args.quick:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        print("no CUDA here: run with --quick for the CPU version", file=sys.stderr)
        return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="tierd-act-bench-")) if args.quick
                       else DEFAULT_OUT)
    run = Run(sizes, device, out, budget_s=args.budget_s or sizes.budget_s, quick=args.quick,
              nvme=args.nvme,
              host_bytes=None if args.host_gib is None else int(args.host_gib * GiB))
    try:
        run.execute()
    finally:
        paths = run.write_all()
    print((out / f"{run.name}.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
