"""The rows of ``tierd.bench.bigmodel`` and the ``bigmodel.json`` they are merged into."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from tierd.bench import bigmodel_floor
from tierd.bench.bigmodel_models import shape_of
from tierd.bench.bigmodel_systems import PEERS, RunSpec

GB = 1e9

#: the issue's schema; every row has these keys (extra keys follow them)
ROW_KEYS = ("model", "system", "params", "batch", "tokens_per_s", "tflops", "peak_gpu_gb",
            "peak_host_gb", "error")


def _base(model: str, system: str, seq: int, optimizer_state: str,
          checkpointing: bool = True) -> dict:
    shape = shape_of(model)
    return {"model": model, "system": system, "optimizer_state": optimizer_state,
            "checkpointing": checkpointing, "params": shape.params, "layers": shape.layers, "hidden": shape.hidden,
            "seq": seq, "flops_per_token": shape.flops_per_token(seq)}


def key(r: dict) -> tuple[str, str, str, int | None, bool]:
    """What a row is of: model, system, optimizer state (rows written before
    the setting was recorded were fp32), for the all-GPU compute references
    only the batch (a reference is per batch:
    ``bigmodel_floor.compute_reference``; a system's row is its best batch),
    and whether layers were checkpointed (rows before it was recorded were).
    A new row replaces only the row with the same key, so settings of one
    model, and references at several batches, sit side by side."""
    batch = r.get("batch") if r["system"] == "allgpu" else None
    return (r["model"], r["system"], r.get("optimizer_state") or "fp32", batch,
            r.get("checkpointing", True))


def row(spec: RunSpec, raw: dict, commit: str | None, notes: list[str],
        disk: dict | None = None) -> dict:
    """The row of one attempt from what its worker wrote and its parent saw;
    ``disk``: the call's probe of the NVMe disk (``tierd.bench.nvme.mixed_probe``),
    for tierd's floor ([Note: a row's floor] in tierd.bench.bigmodel_floor)."""
    base = _base(spec.model, spec.system, spec.seq, spec.optimizer_state, spec.checkpointing)
    times = raw.get("step_s") or []
    measured = times[spec.warmup:]
    ok = bool(raw.get("done")) and raw.get("error") is None and raw.get("killed") is None \
        and len(measured) == spec.steps
    step = statistics.median(measured) if ok else None
    tokens = spec.batch * spec.seq / step if step else None
    error = None if ok else _error(raw, spec)
    return {
        "model": spec.model, "system": spec.system, "params": base["params"],
        "batch": spec.batch, "tokens_per_s": tokens,
        "tflops": tokens * base["flops_per_token"] / 1e12 if tokens else None,
        "peak_gpu_gb": raw.get("peak_gpu_gb"), "peak_host_gb": raw.get("peak_host_gb"),
        "error": error, **base, "step_s": step, "step_times": times,
        "losses": raw.get("losses") or [], "warmup": spec.warmup, "steps": spec.steps,
        "peak_gpu_reserved_gb": raw.get("peak_gpu_reserved_gb"),
        "setup_peak_gpu_gb": raw.get("setup_peak_gpu_gb"),
        "setup_s": raw.get("setup_s"), "setup_phases": raw.get("setup_phases") or {},
        "wall_s": raw.get("wall_s"),
        "lowest_available_gib": raw.get("lowest_available_gib"),
        "notes": [*notes, *(raw.get("notes") or [])], "device": raw.get("device"),
        "commit": commit, "log": raw.get("log"),
        **({"bytes_per_param": raw.get("bytes_per_param")} if spec.system == "tierd" else {}),
        **(_traffic(spec, raw, disk) if spec.system == "tierd" else {}),
    }


def _traffic(spec: RunSpec, raw: dict, disk: dict | None) -> dict:
    """tierd's measured bytes per step and what its floor is computed from."""
    plan = raw.get("plan") or {}

    def gb(key: str) -> float | None:
        return None if plan.get(key) is None else plan[key] / GB

    return {**bigmodel_floor.measured(raw.get("traffic") or [], spec.warmup),
            "traffic": raw.get("traffic") or [], "planned_pcie_gb": gb("planned_pcie_bytes"),
            "step_store_gb": gb("step_store_bytes"), "pool_gb": gb("pool_bytes"),
            "pcie_both_ways_GBps": raw.get("pcie_both_ways_GBps"),
            "disk_mixed_GBps": None if disk is None else disk["mixed_each_way_GBps"]}


def _error(raw: dict, spec: RunSpec) -> str:
    where = f" (at {raw['phase']})" if raw.get("phase") else ""
    if raw.get("killed"):
        return raw["killed"] + where
    if raw.get("error"):
        return raw["error"]
    if raw.get("done"):
        return f"finished {len(raw.get('step_s') or [])} steps of {spec.warmup + spec.steps}"
    tail = (raw.get("log_tail") or "").strip().splitlines()[-5:]
    code = raw.get("returncode")
    how = f"was killed by signal {-code}" if isinstance(code, int) and code < 0 else \
        f"exited with status {code}"
    oom = " (SIGKILL from outside: the kernel's OOM killer?)" if code == -9 else ""
    return (f"the worker {how}{oom}{where} without a result; its log ends: "
            f"{' | '.join(tail)}")[:2000]


def not_run(model: str, system: str, seq: int, why: str, notes: list[str],
            optimizer_state: str = "fp32", checkpointing: bool = True) -> dict:
    """A row for an attempt that never started; it does not replace a measured row."""
    return {"model": model, "system": system, "params": shape_of(model).params, "batch": None,
            "tokens_per_s": None, "tflops": None, "peak_gpu_gb": None, "peak_host_gb": None,
            "error": why, **_base(model, system, seq, optimizer_state, checkpointing),
            "notes": list(notes),
            "not_run": True}


def load(path: Path) -> dict:
    """The results so far (an empty result if there is no file yet)."""
    if not path.exists():
        return {"commit": None, "device": None, "rows": [], "largest": largest([])}
    data = json.loads(path.read_text())
    if not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} has no 'rows' list: not a bigmodel.json; use another --out")
    return data


def merge(old: dict, new_rows: list[dict], commit: str | None) -> dict:
    """``old`` with ``new_rows`` in: a row replaces the one of the same
    :func:`key` (in place, so the order stays), unless it is a not-run row
    and a row is there already."""
    rows = list(old["rows"])
    where = {key(r): i for i, r in enumerate(rows)}
    for r in new_rows:
        i = where.get(key(r))
        if i is None:
            where[key(r)] = len(rows)
            rows.append(r)
        elif not r.get("not_run"):
            rows[i] = r
    devices = [r.get("device") for r in new_rows if r.get("device")]
    return {**old, "commit": commit or old.get("commit"),
            "device": devices[-1] if devices else old.get("device"),
            "rows": bigmodel_floor.with_floors(rows), "largest": largest(rows),
            "largest_tierd": largest_tierd(rows)}


def _largest(rows: list[dict]) -> int | None:
    sizes = [r["params"] for r in rows if r["error"] is None]
    return max(sizes) if sizes else None


def largest(rows: list[dict]) -> dict:
    """Per system compared, the parameters of the largest model it completed
    with fp32 AdamW state (like for like; None if none)."""
    return {system: _largest([r for r in rows if key(r)[1:3] == (system, "fp32")])
            for system in PEERS}


def largest_tierd(rows: list[dict]) -> dict:
    """Per optimizer state tierd ran, the parameters of the largest model it
    completed (None if none)."""
    states = dict.fromkeys(key(r)[2] for r in rows if r["system"] == "tierd")
    return {s: _largest([r for r in rows if key(r)[1:3] == ("tierd", s)]) for s in states}


def save(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def _fmt(value, spec: str) -> str:
    """``value`` formatted, or a dash as wide."""
    if value is None:
        return "-".rjust(int(spec.split(".")[0].rstrip("df") or 0))
    return format(value, spec)


def _what(r: dict) -> str:
    """Model, system (with its optimizer state unless fp32, and no-ckpt where
    layers were not checkpointed) and batch."""
    state = key(r)[2]
    system = r["system"] if state == "fp32" else f"{r['system']}/{state}"
    recompute = "" if key(r)[4] else " no-ckpt"
    return f"{r['model']:>6} {system:>9}{recompute} B={r['batch']}"


def line(r: dict) -> str:
    """One attempt, for the progress output."""
    what = _what(r)
    if r["error"] is None:
        return (f"{what}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tokens/s, "
                f"{r['tflops']:.1f} TFLOPS, GPU {_fmt(r['peak_gpu_gb'], '.1f')} GB, host "
                f"{_fmt(r['peak_host_gb'], '.1f')} GB")
    return f"{what}: {r['error'][:300]}"


def floor_line(r: dict) -> str:
    """A tierd row's floor beside its step ([Note: a row's floor] in
    tierd.bench.bigmodel_floor), for the progress output."""
    what = _what(r)
    if r.get("floor_s") is None:
        return f"{what}: no floor (nothing it is computed from was measured)"
    parts = ", ".join(f"{p} {_fmt(r[f'{p}_s'], '.1f')} s" for p in bigmodel_floor.PARTS)
    cross = r.get("nvme_must_cross_gb")
    return (f"{what}: floor {r['floor_s']:.1f} s ({r['binding']}-bound; {parts}; "
            f"{_fmt(cross, '.1f')} GB must cross NVMe each way at "
            f"{_fmt(r.get('disk_mixed_GBps'), '.2f')} GB/s mixed); step {r['step_s']:.1f} s = "
            f"{r['to_floor']:.2f}x the floor (target <= {bigmodel_floor.TARGET}x: "
            f"{r['target_s']:.1f} s); NVMe read {_fmt(r.get('nvme_read_gb'), '.1f')} GB, "
            f"written {_fmt(r.get('nvme_write_gb'), '.1f')} GB per step")


def table(rows: list[dict], this_call: list[dict]) -> str:
    """Every row of the file; those measured in this call marked with *."""
    keys = {key(r) for r in this_call}
    out = [f"  {'model':>6} {'system':>9} {'state':>9} {'params':>7} {'B':>3} {'tokens/s':>9} "
           f"{'TFLOPS':>7} {'GPU GB':>7} {'host GB':>7} {'step s':>7} {'floor s':>7} "
           f"{'binding':>7} {'x floor':>7} {'NVMe r GB':>9} {'w GB':>6}  error"]
    for r in rows:
        mark = "*" if key(r) in keys else " "
        state = key(r)[2] if key(r)[4] else f"{key(r)[2]} no-ckpt"
        out.append(f"{mark} {r['model']:>6} {r['system']:>9} {state:>9} "
                   f"{r['params'] / 1e9:6.2f}B "
                   f"{_fmt(r['batch'], '3d')} {_fmt(r['tokens_per_s'], '9.0f')} "
                   f"{_fmt(r['tflops'], '7.1f')} {_fmt(r['peak_gpu_gb'], '7.1f')} "
                   f"{_fmt(r['peak_host_gb'], '7.1f')} {_fmt(r.get('step_s'), '7.2f')} "
                   f"{_fmt(r.get('floor_s'), '7.2f')} {(r.get('binding') or '-'):>7} "
                   f"{_fmt(r.get('to_floor'), '7.2f')} {_fmt(r.get('nvme_read_gb'), '9.2f')} "
                   f"{_fmt(r.get('nvme_write_gb'), '6.2f')}  {(r['error'] or '')[:100]}")
    return "\n".join(out)
