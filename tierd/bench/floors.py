"""A step's floor from first principles: the rates a bench measures on the
machine it runs on (pinned PCIe copies each way and both at once, the
disk's sequential read) and the longest of a row's compute, copies and
the NVMe reads its pool cannot spare. Used by ``tierd.bench.lora70b``."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tierd.client.torch_internals import free_pinned_host_cache

GB = 1e9


def pcie_bandwidths(device: torch.device, nbytes: int = 256 << 20) -> dict:
    """Bytes/s of pinned copies host to device, device to host and both at once
    (best of six each); nominal figures on the CPU, where nothing crosses PCIe."""
    if device.type != "cuda":
        return {"h2d": 10 * GB, "d2h": 10 * GB, "both": 20 * GB}
    host_in = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host_out = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev_in = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def best(h2d: bool, d2h: bool) -> float:
        out = 0.0
        for _ in range(6):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if h2d:
                with torch.cuda.stream(s1):
                    dev_in.copy_(host_in, non_blocking=True)
            if d2h:
                with torch.cuda.stream(s2):
                    host_out.copy_(dev_out, non_blocking=True)
            torch.cuda.synchronize(device)
            out = max(out, (h2d + d2h) * nbytes / (time.perf_counter() - t0))
        return out
    rates = {"h2d": best(True, False), "d2h": best(False, True), "both": best(True, True)}
    del host_in, host_out, dev_in, dev_out
    free_pinned_host_cache()   # the pool page-locks what the host allows
    return rates


def disk_read_rate(args) -> float | None:
    """Bytes per second the disk under the embedded daemon's NVMe files reads
    (``tierd.bench.nvme.mixed_probe``'s sequential O_DIRECT read of
    ``--disk-probe-gib``), or None with the probe off."""
    if not args.disk_probe_gib:
        return None
    import shutil
    import tempfile
    from tierd.bench.nvme import MiB, mixed_probe
    from tierd.client.embedded import nvme_root
    nbytes = max(8 * MiB, int(args.disk_probe_gib * (1 << 30)) // (8 * MiB) * (8 * MiB))
    nvme_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lora70b-disk-probe-", dir=nvme_root()))
    try:
        return mixed_probe(work, nbytes)["read_GBps"] * GB
    finally:
        shutil.rmtree(work, ignore_errors=True)


def nvme_floor(streamed: float, passes: int, pool: float, read_rate: float | None
               ) -> tuple[float | None, float]:
    """Seconds the disk needs at least, and the bytes it must read: the
    frozen base streams ``streamed`` bytes over ``passes`` passes (a LoRA
    step's forward and its backward's recompute: 2; a token: 1); between
    passes the pool keeps at most its ``pool`` bytes of it, so each pass
    reads the rest from the disk.

    Example:
        >>> nvme_floor(300e9, 2, 100e9, 2e9)   # 150 GB a pass, 50 of it from the disk
        (50.0, 100000000000.0)
    """
    must = passes * max(0.0, streamed / passes - pool)
    return (None if read_rate is None else must / read_rate), must


def floors(row: dict, rates: dict, tflops: float, read_rate: float | None = None) -> dict:
    """The row's floor: the longest of its compute, its copies at the
    measured PCIe bandwidths, and (a tierd row) what the disk must read."""
    compute = row["step_flops"] / (tflops * 1e12)
    pin, pout = row["pcie_in_gb"] * GB, row["pcie_out_gb"] * GB
    parts = {"compute": compute,
             "pcie": max(pin / rates["h2d"], pout / rates["d2h"], (pin + pout) / rates["both"])}
    out = {"compute_floor_s": compute, "pcie_floor_s": parts["pcie"]}
    if "pool_gb" in row:
        nvme, must = nvme_floor(pin, 2, row["pool_gb"] * GB, read_rate)
        out.update(nvme_must_read_gb=must / GB, nvme_floor_s=nvme,
                   disk_read_gbps=None if read_rate is None else read_rate / GB)
        if nvme is not None:
            parts["nvme"] = nvme
    binding = max(parts, key=parts.get)
    return {**out, "floor_s": parts[binding], "binding": binding}
