"""The CUDA caching allocator's figures for the benches: its reserved peak,
retries and cudaMalloc/cudaFree calls, what each stream's cached segments
hold, and which code's allocations made it call cudaMalloc and cudaFree.
Every function answers None or {} on the CPU."""

from __future__ import annotations

import torch

GB = 1e9


def allocator(device: torch.device) -> dict:
    """The caching allocator's reserved peak and the times it ran out of cached
    blocks and freed them all (each a device-wide synchronization) or called
    cudaMalloc / cudaFree ({} on the CPU)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"reserved_peak_gb": torch.cuda.max_memory_reserved(device) / GB,
            **{k: stats.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams",
                                            "num_device_alloc", "num_device_free")}}


def cache_by_stream(device: torch.device, streams: dict[str, object]) -> dict:
    """The caching allocator's segments now, by the stream they serve (a
    cached block serves only its own stream): GB reserved and allocated for
    each of ``streams`` (name -> torch.cuda.Stream, None skipped) and for any
    other stream ("other"); {} on the CPU."""
    if device.type != "cuda":
        return {}
    names = {s.cuda_stream: n for n, s in streams.items() if s is not None}
    out: dict[str, dict[str, float]] = {}
    for seg in torch.cuda.memory_snapshot():
        if seg.get("device", device.index or 0) != (device.index or 0):
            continue
        row = out.setdefault(names.get(seg["stream"], "other"),
                             {"reserved_gb": 0.0, "allocated_gb": 0.0})
        row["reserved_gb"] += seg["total_size"] / GB
        row["allocated_gb"] += seg["allocated_size"] / GB
    return out


ALLOC_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def alloc_counts(device: torch.device) -> tuple[int, ...] | None:
    """The caching allocator's counters so far, in ``ALLOC_COUNTS``' order:
    its retries (each freed its whole cache and synchronized every stream),
    cudaMalloc calls, and cudaFree calls (each synchronizes the device; the
    allocator also frees cached blocks without counting a retry, where a
    cudaMalloc finds the device full); None on the CPU."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return tuple(stats.get(k, 0) for k in ALLOC_COUNTS)


def segment_sites(events: list[dict], streams: dict[int, str], top: int = 8) -> dict:
    """The caching allocator's cudaMalloc and cudaFree calls among ``events``
    (a memory snapshot's device trace): for each, the count, GB, by stream
    (``streams``: CUDA stream handle -> name, else "other") and the ``top``
    code sites whose allocation made them (the innermost tierd frame, else
    transformers', else the innermost frame outside torch).

    >>> ev = [{"action": "segment_alloc", "size": 2 << 30, "stream": 7, "frames": [
    ...     {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
    ...     {"filename": "/x/tierd/updates/fused.py", "line": 537, "name": "_fetch"}]},
    ...     {"action": "alloc", "size": 1, "stream": 7, "frames": []}]
    >>> segment_sites(ev, {7: "copy_in"})["segment_alloc"]["sites"]
    {'tierd/updates/fused.py:537 _fetch': [1, 2.147]}
    """
    def site(frames: list[dict]) -> str:
        for want in ("/tierd/", "/transformers/", ""):
            for f in frames:
                name = f.get("filename", "")
                if want in name and (want or "/torch/" not in name):
                    short = name[name.rfind(want) + 1:] if want else name
                    return f"{short}:{f.get('line')} {f.get('name')}"
        return "unknown"

    out = {}
    for action in ("segment_alloc", "segment_free"):
        mine = [e for e in events if e.get("action") == action]
        by_stream: dict[str, int] = {}
        sites: dict[str, list] = {}
        for e in mine:
            name = streams.get(e.get("stream"), "other")
            by_stream[name] = by_stream.get(name, 0) + 1
            row = sites.setdefault(site(e.get("frames") or []), [0, 0.0])
            row[0] += 1
            row[1] += e.get("size", 0) / GB
        ranked = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
        out[action] = {"count": len(mine), "gb": round(sum(e.get("size", 0) for e in mine) / GB, 3),
                       "by_stream": by_stream,
                       "sites": {k: [n, round(gb, 3)] for k, (n, gb) in ranked}}
    return out


def malloc_sites(fn, device: torch.device, streams: dict, steps: int = 2) -> dict | None:
    """Where ``steps`` steps back to back, then a synchronize, made the
    caching allocator call cudaMalloc and cudaFree (:func:`segment_sites`),
    with its retries; None on the CPU. Recorded apart from the timed steps
    (recording costs host time)."""
    if device.type != "cuda":
        return None
    names = {s.cuda_stream: n for n, s in streams.items() if s is not None}
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    try:   # a diagnostic: the row stands without it
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                                 max_entries=200_000)
    except (RuntimeError, TypeError) as exc:
        return {"error": f"recording the allocator's history: {exc}"[:300]}
    try:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces") or [[]]
    index = device.index if device.index is not None else torch.cuda.current_device()
    out = segment_sites(traces[index] if index < len(traces) else [], names)
    out["steps"] = steps
    out["retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - retries
    return out
