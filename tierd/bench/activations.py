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
tierd/client/activations_plan.py). A row *fits* a budget
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
import ctypes
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# The --budget-s clock: torch is already imported with the tierd package this
# module lives in, so the clock starts after it.
STARTED = time.monotonic()

import torch  # noqa: E402

import tierd  # noqa: E402
from tierd.backends.hostpool import available_memory  # noqa: E402
from tierd.bench import DEFAULT_OUT  # noqa: E402
from tierd.client.activations import tier_activations  # noqa: E402
from tierd.errors import TierdError  # noqa: E402

FIXED = ("none", "offload", "recompute")
WITHIN = 1.05    # auto is "within 5 %" of the best fixed policy at or below this ratio
#: auto's steps before its warm-up: the profiling step, then the plan's first
#: step, after which (on CUDA) the plan may be made again for the next steps.
AUTO_STEPS = 2
GiB = 1 << 30


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


# ------------------------------------------------------------------ measuring
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
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    pinned = [0]

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
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
    correction] in tierd/client/activations_plan.py): bytes above the step's
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


def free_pinned_host_cache() -> bool:
    """Give the caching host allocator's unused pinned memory back to the OS
    (False where this torch has no call for it, or there is no CUDA)."""
    if not torch.cuda.is_available():
        return False
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"),
                        (torch._C, "_host_emptyCache")):
        fn = getattr(owner, name, None)
        if fn is not None:
            fn()
            return True
    return False


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


# ----------------------------------------------------------------- verdicts
def verdicts(rows: list[dict]) -> list[dict]:
    """Per (batch, budget): the fixed policies that fit, the fastest of them,
    and how ``auto`` compares to it and to save_on_cpu."""
    out = []
    autos = sorted((r for r in rows if r["policy"] == "auto"),
                   key=lambda r: (r["batch"], r["fraction"]))
    for auto in autos:
        batch, cap = auto["batch"], auto["budget_bytes"]
        ok = {r["policy"]: r for r in rows if r["batch"] == batch and r["status"] == "ok"
              and r["policy"] != "auto"}
        fits = {p: cap is not None and r["peak_bytes"] <= cap for p, r in ok.items()}
        fitting = [ok[p] for p in FIXED if fits.get(p)]
        best = min(fitting, key=lambda r: r["step_s"], default=None)
        ran = auto["status"] == "ok"
        auto_fits = ran and cap is not None and auto["peak_bytes"] <= cap
        ratio = auto["step_s"] / best["step_s"] if ran and best else None
        soc = ok.get("save_on_cpu")
        both = auto_fits and soc is not None and fits["save_on_cpu"]
        out.append(dict(
            batch=batch, fraction=auto["fraction"], budget_bytes=cap, fits=fits,
            best_fixed=best["policy"] if best else None,
            best_fixed_step_s=best["step_s"] if best else None,
            auto_status=auto["status"], auto_step_s=auto.get("step_s"),
            auto_peak_bytes=auto.get("peak_bytes"), auto_fits=auto_fits,
            auto_vs_best=ratio,
            auto_within_5pct=(auto_fits and ratio <= WITHIN) if ratio is not None else None,
            save_on_cpu_fits=fits.get("save_on_cpu"),
            auto_faster_than_save_on_cpu=auto["step_s"] < soc["step_s"] if both else None))
    return out


# ------------------------------------------------------------------ reports
def _size(n: int | None, unit: str) -> str:
    return "-" if n is None else f"{n / (GiB if unit == 'GiB' else 1 << 20):.2f}"


def _flag(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def describe(row: dict, unit: str) -> str:
    what = f"B={row['batch']} {row['policy']}" + (
        f" f={row['fraction']}" if row["fraction"] is not None else "")
    if row["status"] != "ok":
        return f"{what}: {row['status']} ({row['reason']})"
    return (f"{what}: {row['step_s']:.3f} s (median of {row['steps_timed']}), "
            f"peak {_size(row['peak_bytes'], unit)} {unit}")


def summary(budgets: list[dict]) -> str:
    """One line: how often auto met each of its two targets."""
    judged = [v for v in budgets if v["auto_within_5pct"] is not None]
    near = sum(v["auto_within_5pct"] for v in judged)
    both = [v for v in budgets if v["auto_faster_than_save_on_cpu"] is not None]
    faster = sum(v["auto_faster_than_save_on_cpu"] for v in both)
    return (f"auto fits and is within 5 % of the best fixed policy that fits at {near} of "
            f"{len(judged)} budgets (where some fixed policy fits and auto ran); faster than "
            f"save_on_cpu at {faster} of {len(both)} budgets where both fit.")


def markdown(results: dict) -> str:
    meta, unit = results["meta"], results["meta"]["unit"]
    none = {r["batch"]: r for r in results["rows"] if r["policy"] == "none"
            and r["status"] == "ok"}
    out = [f"# Activation tiering: peak memory vs step time ({meta['device']})", "",
           f"{meta['model']}, T={meta['seq']}, autocast {meta['autocast']}, "
           f"min_bytes {meta['min_bytes']}, median of up to {meta['steps']} steps after "
           f"{meta['warmup']} warm-up (auto: +{AUTO_STEPS}); wall {meta['wall_s']} s of "
           f"--budget-s {meta['budget_s']}; `{meta['command']}`", "",
           "Peak: above the weights, over a step (see [Note: peak memory and budgets] in "
           "tierd/bench/activations.py). Budget cap = overhead + f x saved.", "",
           f"| B | policy | f | cap {unit} | peak {unit} | reserved {unit} | step s | x none | "
           f"to pool {unit}/step | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        f = "-" if r["fraction"] is None else r["fraction"]
        cells = [r["batch"], r["policy"], f, _size(r["budget_bytes"], unit)]
        base = none.get(r["batch"])
        if r["status"] == "ok":
            cells += [_size(r["peak_bytes"], unit), _size(r["peak_reserved_bytes"], unit),
                      f"{r['step_s']:.3f}",
                      f"{r['step_s'] / base['step_s']:.2f}" if base else "-",
                      _size(r.get("d2h_bytes_per_step"), unit), "ok"]
        else:
            cells += ["-"] * 5 + [f"{r['status']}: {r['reason']}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out += ["", "## Per budget", "",
            f"| B | f | cap {unit} | fixed policies that fit | best fixed (s) | auto s | "
            f"auto peak {unit} | auto fits | auto / best | within 5 % | save_on_cpu fits | "
            "auto faster than save_on_cpu |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in results["budgets"]:
        fitting = ", ".join(p for p in FIXED if v["fits"].get(p)) or "(no fixed policy)"
        best = "-" if v["best_fixed"] is None else \
            f"{v['best_fixed']} ({v['best_fixed_step_s']:.3f})"
        auto_s = "-" if v["auto_step_s"] is None else f"{v['auto_step_s']:.3f}"
        ratio = "-" if v["auto_vs_best"] is None else f"{v['auto_vs_best']:.2f}"
        out.append(f"| {v['batch']} | {v['fraction']} | {_size(v['budget_bytes'], unit)} | "
                   f"{fitting} | {best} | {auto_s} | {_size(v['auto_peak_bytes'], unit)} | "
                   f"{_flag(v['auto_fits'] if v['auto_status'] == 'ok' else None)} | {ratio} | "
                   f"{_flag(v['auto_within_5pct'])} | {_flag(v['save_on_cpu_fits'])} | "
                   f"{_flag(v['auto_faster_than_save_on_cpu'])} |")
    out += ["", summary(results["budgets"])]
    plans = [r for r in results["rows"] if r.get("plan")]
    if plans:
        out += ["", "## auto plans", ""]
        out += [f"- B={r['batch']} f={r['fraction']}: {r['plan']}" + _checked(r, unit)
                for r in plans]
    return "\n".join(out) + "\n"


def _checked(row: dict, unit: str) -> str:
    c = row.get("memory_check")
    if c is None:
        return ""
    made = f"made again; first: {c['first_plan']}" if c["replanned"] else "kept"
    return (f". First step: {_size(c['measured_bytes'], unit)} {unit} above keep-all's "
            f"overhead ({_size(c['baseline_bytes'], unit)}) at peak, "
            f"{_size(c['predicted_bytes'], unit)} planned: {made}")


def plot(results: dict, path: Path) -> str | None:
    """The curve: peak memory vs step time per batch; returns why not if not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    unit = results["meta"]["unit"]
    scale = GiB if unit == "GiB" else 1 << 20
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return "no figures to plot"
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5), squeeze=False)
    style = {"none": ("k", "o"), "offload": ("tab:blue", "s"), "recompute": ("tab:green", "^"),
             "save_on_cpu": ("tab:red", "X")}
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        for r in mine:
            if r["policy"] in style:
                color, marker = style[r["policy"]]
                ax.scatter(r["step_s"], r["peak_bytes"] / scale, c=color, marker=marker,
                           s=60, label=r["policy"], zorder=3)
        autos = sorted((r for r in mine if r["policy"] == "auto"), key=lambda r: r["fraction"])
        if autos:
            ax.plot([r["step_s"] for r in autos], [r["peak_bytes"] / scale for r in autos],
                    "-o", c="tab:purple", label="auto (budget f)", zorder=2)
            for r in autos:
                ax.annotate(f"f={r['fraction']}", (r["step_s"], r["peak_bytes"] / scale),
                            fontsize=7, xytext=(4, 4), textcoords="offset points")
                ax.axhline(r["budget_bytes"] / scale, c="tab:purple", lw=0.6, ls=":")
        ax.set_xlabel("median step time (s)")
        ax.set_ylabel(f"peak memory above weights ({unit})")
        ax.set_title(f"B={batch}, T={results['meta']['seq']} (dotted: budgets)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"tierd activation tiering, {results['meta']['model']}, "
                 f"{results['meta']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


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
