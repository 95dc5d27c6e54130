"""One attempt of ``tierd.bench.bigmodel``: one system, model and batch, in its own process.

    python -m tierd.bench.bigmodel_worker SPEC.json RESULT.json

SPEC is a :class:`tierd.bench.bigmodel_systems.RunSpec` as JSON. RESULT is
rewritten (atomically) after every phase, so a parent that kills this
process for time or host memory still knows how far it got: ``phase``,
``setup_s`` (and ``setup_phases``: seconds per named part), ``step_s`` (every
step, CUDA-synchronised), ``losses``, ``peak_gpu_gb`` /
``peak_gpu_reserved_gb`` (``max_memory_allocated`` / ``max_memory_reserved``
during the steps; ``setup_peak_gpu_gb`` while the system built the model),
``notes``, ``bytes_per_param`` (tierd: what its optimizer setting keeps
at rest per trained parameter), and at the end ``done`` or ``error`` (with ``oom_in_step``: the GPU
ran out of memory during a training step, so a smaller batch may fit).
tierd's attempts also write what its floor needs ([Note: a row's floor] in
``tierd.bench.bigmodel_floor``): ``pcie_both_ways_GBps`` (measured before the
model is built, on CUDA), ``traffic`` (per step: bytes NVMe -> pool and pool
-> NVMe by the daemon's counters, host <-> device by the session's) and, after
the steps, ``plan`` (the store bytes a step moves, the pool, the planned
PCIe bytes).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tierd.bench.bigmodel_models import shape_of
from tierd.bench.bigmodel_systems import SETUPS, RunSpec

GB = 1e9


@dataclass
class Progress:
    """What the attempt has done so far, written to ``path`` after each change."""

    path: Path
    device: torch.device
    state: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._phase, self._since = None, 0.0
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.state.update(phase="starting", device=name, step_s=[], losses=[], notes=[],
                          peak_gpu_gb=0.0, peak_gpu_reserved_gb=0.0, done=False, error=None,
                          oom_in_step=False, setup_s=None)
        self.write()

    def update(self, **items) -> None:
        if self.device.type == "cuda":
            self.state["peak_gpu_gb"] = torch.cuda.max_memory_allocated(self.device) / GB
            self.state["peak_gpu_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / GB
        self.state.update(items)
        self.write()

    def setup_phase(self, name: str) -> None:
        """The setup enters phase ``name``; the one before it took until now."""
        now = time.perf_counter()
        phases = self.state.setdefault("setup_phases", {})
        if self._phase is not None:
            phases[self._phase] = now - self._since
        self._phase, self._since = name, now
        print(f"[bigmodel] setup: {name}", flush=True)
        self.update(phase=f"setup: {name}")

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)


def run(spec: RunSpec, progress: Progress) -> None:
    device = progress.device
    shape = shape_of(spec.model)
    if spec.system == "tierd" and device.type == "cuda":
        progress.update(pcie_both_ways_GBps=pcie_both_ways(device) / GB)
    t0 = time.perf_counter()
    trainer = SETUPS[spec.system](spec, shape, device, progress.setup_phase)
    progress.setup_phase("done")
    progress.state["notes"] = trainer.notes   # the same list: what a step adds shows
    progress.update(setup_s=time.perf_counter() - t0, bytes_per_param=trainer.bytes_per_param)
    if device.type == "cuda":   # the row's peaks are the training steps'; building's is kept
        progress.state["setup_peak_gpu_gb"] = progress.state["peak_gpu_gb"]
        torch.cuda.reset_peak_memory_stats(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab, (spec.batch, spec.seq), generator=gen).to(device)
    total = spec.warmup + spec.steps
    for i in range(total):
        progress.update(phase=f"step {i + 1}/{total}")
        sync(device)
        before = trainer.traffic() if trainer.traffic else None
        t0 = time.perf_counter()
        loss = trainer.step(ids)
        value = float(loss)   # waits for the step's work
        sync(device)
        progress.state["step_s"].append(time.perf_counter() - t0)
        if before is not None:
            after = trainer.traffic()
            progress.state.setdefault("traffic", []).append(
                {k: after[k] - before[k] for k in after})
        if not math.isfinite(value):   # kept out of the JSON, which has no NaN
            progress.state["notes"].append(f"loss {value} at step {i + 1}")
        progress.state["losses"].append(value if math.isfinite(value) else None)
        progress.update()
        print(f"[bigmodel] step {i + 1}/{total}: {progress.state['step_s'][-1]:.3f} s, loss "
              f"{value:.4f}, peak GPU {progress.state['peak_gpu_gb']:.1f} GB", flush=True)
    if trainer.plan is not None:
        progress.update(plan=trainer.plan())
    progress.update(phase="done", done=True)


def pcie_both_ways(device: torch.device) -> float:
    """Bytes/s of pinned host <-> device copies both ways at once (best of
    six), with the buffers given back (the model needs every byte after)."""
    from tierd.bench.placement import both_ways_bandwidth
    rate = both_ways_bandwidth(device, 512 << 20)
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)   # the pinned buffers' cache
    if host_empty is not None:
        host_empty()
    return rate


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tierd.bench.bigmodel_worker SPEC.json RESULT.json",
              file=sys.stderr)
        return 2
    spec = RunSpec(**json.loads(Path(argv[0]).read_text()))
    logging.basicConfig(stream=sys.stdout, format="[%(name)s] %(message)s")
    # each plan and each step reading it came from, in the log (L64 at a2b664c
    # counted 74.9 GB besides the plan at its first step, 17.2 at its third)
    logging.getLogger("tierd.placement").setLevel(logging.DEBUG)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    progress = Progress(Path(argv[1]), device)
    try:
        run(spec, progress)
    except Exception as exc:   # the row says why; the log has the traceback
        traceback.print_exc()
        in_step = progress.state["phase"].startswith("step")
        progress.update(error=f"{progress.state['phase']}: {type(exc).__name__}: {exc}"[:2000],
                        oom_in_step=in_step and isinstance(exc, torch.OutOfMemoryError))
        return 1
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            with contextlib.suppress(Exception):   # the result is written already
                torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
