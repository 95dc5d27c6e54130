"""A ``tierd.bench.bigmodel`` row's floor: the step its bytes and the machine's
measured bandwidths allow, and the counters it is checked against.

[Note: a row's floor]
A step cannot be shorter than the longest of three things, which at best
overlap completely:

- compute: the all-GPU step (an ``allgpu`` row) at the same width, sequence
  and batch, on a model small enough to fit, scaled by the two models' FLOPs
  per token (:meth:`tierd.bench.bigmodel_models.Shape.flops_per_token`; the
  checkpointing recompute is in both steps);
- PCIe: the bytes the plan streams per step, both ways together (the
  placer's ``planned_pcie_bytes``), at the both-ways bandwidth the worker
  measured before building the model;
- NVMe: the bytes that must cross each way. A step reads and writes the
  store bytes of every unit not resident on the GPU (a streamed unit's
  compute copy and state, a ``WEIGHTS`` unit's state, a CPU unit's gradient
  too); between steps the pool keeps at most its size of them, so the rest,
  ``step_store_bytes - pool_bytes``, is read once and written once, at best
  at the disk's mixed bandwidth: reads and writes of equal size at once
  (:func:`tierd.bench.nvme.mixed_probe`, run by the bench on the disk the
  daemon's files go to).

``floor_s`` is the longest, ``binding`` names it, and the row's target is
``TARGET`` times the floor. What the daemon moved is beside it:
``nvme_read_gb`` / ``nvme_write_gb`` per step, from its counters.
"""

from __future__ import annotations

import statistics

from tierd.client.placement import Place

GB = 1e9
#: a row's target: at most this many times its floor (issue 33)
TARGET = 1.25
PARTS = ("compute", "pcie", "nvme")


# ------------------------------------------------------------ in the worker
def traffic(session) -> dict:
    """Cumulative bytes: NVMe -> pool and pool -> NVMe (the daemon's
    counters), host -> device and device -> host (the session's copies)."""
    daemon = session.client.stats()
    mine = session.stats()
    return {"nvme_read_bytes": daemon["bytes_to_pool"],
            "nvme_write_bytes": daemon["bytes_to_nvme"], "h2d_bytes": mine["h2d_bytes"], "d2h_bytes": mine["d2h_bytes"]}


def step_store_bytes(units, places: dict) -> int:
    """Store bytes a training step reads (and writes back) for ``units``
    (:class:`tierd.client.placement.UnitBytes`) at ``places`` (index -> Place;
    a unit not in it streams)."""
    total = 0
    for u in units:
        place = places.get(u.index, Place.STREAM)
        if place is Place.STREAM:
            total += u.param_bytes + u.state_bytes
        elif place is Place.WEIGHTS:
            total += u.state_bytes
        elif place is Place.CPU:
            total += u.param_bytes + u.state_bytes + u.grad_bytes
    return total


def plan_bytes(session) -> dict:
    """What the session's plan moves per step: ``step_store_bytes``,
    ``planned_pcie_bytes`` (None before a plan), and the daemon's pool."""
    placer = session.placer
    plan = placer.plan
    return {"pool_bytes": int(session.client.stats()["pool_bytes"]),
            "step_store_bytes": step_store_bytes(placer.unit_bytes(),
                                                 {} if plan is None else plan.places),
            "planned_pcie_bytes": None if plan is None else plan.streamed_bytes}


# ------------------------------------------------------------ in the row
def measured(traffic_per_step: list[dict], warmup: int) -> dict:
    """Medians over the measured steps (after ``warmup``) of the per-step
    byte counts, in GB: ``nvme_read_gb``, ``nvme_write_gb``, ``pcie_gb``."""
    steps = traffic_per_step[warmup:]
    if not steps:
        return {"nvme_read_gb": None, "nvme_write_gb": None, "pcie_gb": None}

    def med(f) -> float:
        return statistics.median(f(s) for s in steps) / GB

    return {"nvme_read_gb": med(lambda s: s["nvme_read_bytes"]),
            "nvme_write_gb": med(lambda s: s["nvme_write_bytes"]),
            "pcie_gb": med(lambda s: s["h2d_bytes"] + s["d2h_bytes"])}


def must_cross(store_bytes: int, pool_bytes: int) -> int:
    """Bytes that must cross NVMe each way per step (see the Note)."""
    return max(0, store_bytes - pool_bytes)


def compute_reference(row: dict, rows: list[dict]) -> dict | None:
    """The ``allgpu`` row that gives ``row``'s compute: same width, sequence,
    batch and checkpointing (a layer's recompute is a third more work),
    completed; the one with the most layers."""
    refs = [r for r in rows if r["system"] == "allgpu" and r["error"] is None
            and r.get("step_s") and (r["hidden"], r["seq"], r["batch"])
            == (row["hidden"], row["seq"], row["batch"])
            and r.get("checkpointing", True) == row.get("checkpointing", True)]
    return max(refs, key=lambda r: r["layers"], default=None)


def floor(row: dict, ref: dict | None) -> dict:
    """``row``'s floor fields (see the Note); a part that was not measured is
    None and the floor is the longest of the others (None if none was, or
    only parts of 0 s were)."""
    parts = {p: None for p in PARTS}
    if ref is not None:
        parts["compute"] = ref["step_s"] * row["flops_per_token"] / ref["flops_per_token"]
    bandwidth, planned = row.get("pcie_both_ways_GBps"), row.get("planned_pcie_gb")
    if bandwidth and planned is not None:
        parts["pcie"] = planned / bandwidth
    cross = None
    if row.get("step_store_gb") is not None and row.get("pool_gb") is not None:
        cross = must_cross(round(row["step_store_gb"] * GB), round(row["pool_gb"] * GB)) / GB
        mixed = row.get("disk_mixed_GBps")
        if mixed:
            parts["nvme"] = cross / mixed
    known = {p: s for p, s in parts.items() if s is not None}
    binding = max(known, key=known.get) if known else None
    if binding is not None and not known[binding]:
        binding = None   # nothing to cross, no compute reference: no floor
    floor_s = None if binding is None else known[binding]
    return {"compute_s": parts["compute"], "pcie_s": parts["pcie"], "nvme_s": parts["nvme"],
            "nvme_must_cross_gb": cross, "floor_s": floor_s, "binding": binding,
            "target_s": None if floor_s is None else TARGET * floor_s,
            "to_floor": row["step_s"] / floor_s if floor_s and row.get("step_s") else None,
            "compute_ref": None if ref is None else ref["model"]}


def with_floors(rows: list[dict]) -> list[dict]:
    """Every completed tierd row with its floor fields (again: a compute
    reference may have come in a later call)."""
    out = []
    for r in rows:
        if r["system"] == "tierd" and r["error"] is None and r.get("step_s"):
            r = {**r, **floor(r, compute_reference(r, rows))}
        out.append(r)
    return out
