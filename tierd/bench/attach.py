"""How fast ``tierd.attach`` writes a model into the store, and a bulk put of zeros.

    python -m tierd.bench.attach --json attach.json            # 8 Llama-3-8B layers: 2.8B params
    python -m tierd.bench.attach --quick                       # small, CPU, seconds
    python -m tierd.bench.attach --layers 4 --cases cpu-bf16,weights --zeros-gb 0 --json a.json
                                                               # issue 33's rows (H200: ~2 min)
    TIERD_POOL_THREADS=0 python -m tierd.bench.attach          # no segments made ahead

Each case starts a fresh daemon (so the pool grows as in a real attach)
and times ``tierd.attach`` end to end, reporting GB/s of store state
written (bf16 compute copies, plus fp32 masters where attach makes them:
none for a value already in bf16, whose master the first update makes; or
fp32 alone), the client's CPU time and minor page faults, and the daemon's
CPU time and the seconds its reserves spent making pool segments (its
event loop answered nothing else meanwhile). Cases (``--cases``): a CPU
fp32 model attached with ``compute_dtype`` bf16 (the figure the project
holds itself to: >= 5 GB/s on the GPU machine) and fp32,
the same values streamed from a bf16 safetensors file into a meta model
(``weights=``), and, with CUDA, the model built on the GPU in bf16. The
``zeros`` cases store zero tensors in 64 MiB batches as the optimizer's
states are created, into a fresh pool and again into the warm one (its
segments kept), by ``put_many`` of ``torch.zeros`` and by ``put_zeros``.
Each case checks a stored value against the source, bitwise, before it
counts. Models are Llama blocks from config with random weights (no
download). The daemons' pool budget is 20 B per parameter (attach checks
room for the training state), so all 32 layers of the 8B need more memory
than the H200 host has; 8 layers store 17 GB per case.

The write path is [Note: attach's write path] in ``tierd.client.registry``.
What was predicted for it and measured before and after:
``benchmarks/results/HISTORY.md``, "Attach's write path (tierd.bench.attach)".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import tierd
from tierd.client.attach import attach, detach, session_of
from tierd.client.copy_stream import register_pool
from tierd.client.embedded import start_daemon

ZERO_BATCH = 64 << 20   # bytes per put_many of zeros, ~ one module's optimizer states


class Block(nn.Module):
    """A Llama decoder block's parameters (attention, gated MLP, two norms)."""

    def __init__(self, d: int, ff: int, kv: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False), nn.Linear(d, kv, bias=False),
                                          nn.Linear(d, kv, bias=False), nn.Linear(d, d, bias=False))
        self.gate, self.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)
        self.norm1, self.norm2 = nn.LayerNorm(d, bias=False), nn.LayerNorm(d, bias=False)


class Model(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.d)
        self.layers = nn.ModuleList(Block(args.d, args.ff, args.kv) for _ in range(args.layers))
        self.head = nn.Linear(args.d, args.vocab, bias=False)


def build(args, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Model:
    torch.manual_seed(0)
    with torch.device(device):
        model = Model(args).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    return model


def _stored_bytes(model: nn.Module, client, compute: torch.dtype) -> tuple[int, int]:
    """(bytes attach stored, of which fp32 masters) for an attached ``model``:
    a compute copy per parameter, and a master where attach made one (none
    for a value already in the compute dtype: [Note: masters made when first
    needed] in ``tierd.client.registry``)."""
    keys, stored = session_of(model).keys, set(client.keys())
    copies = masters = 0
    for name, p in model.named_parameters():
        copies += p.numel() * compute.itemsize
        masters += p.numel() * 4 if keys.master(name) in stored else 0
    return copies + masters, masters


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall time, this process's CPU time and minor faults, the daemon's CPU."""

    def __init__(self, daemon_pid: int) -> None:
        self.pid = daemon_pid

    def __enter__(self) -> "Meter":
        self.r0 = resource.getrusage(resource.RUSAGE_SELF)
        self.d0 = _cpu_seconds(self.pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        self.client_cpu_s = (r1.ru_utime - self.r0.ru_utime) + (r1.ru_stime - self.r0.ru_stime)
        self.client_sys_s = r1.ru_stime - self.r0.ru_stime
        self.minor_faults = r1.ru_minflt - self.r0.ru_minflt
        self.daemon_cpu_s = _cpu_seconds(self.pid) - self.d0

    def row(self, case: str, nbytes: int, **extra) -> dict:
        return {"case": case, "bytes": nbytes, "seconds": round(self.seconds, 3),
                "gb_per_s": round(nbytes / self.seconds / 1e9, 3),
                "client_cpu_s": round(self.client_cpu_s, 2),
                "client_sys_s": round(self.client_sys_s, 2), "client_minor_faults": self.minor_faults,
                "daemon_cpu_s": round(self.daemon_cpu_s, 2), **extra}


def _daemon(pool_bytes: int):
    """A fresh daemon whose pool may grow to ``pool_bytes`` (only what is
    stored takes memory), so attach's capacity check passes without a large
    NVMe file."""
    return start_daemon(pool=pool_bytes + (256 << 20), nvme_size=256 << 20)


def _check(model: nn.Module, expected: torch.Tensor) -> None:
    """After detach, one matrix holds the source's value, bitwise (read back
    from the fp32 master, or the fp32 copy)."""
    got = model.layers[0].gate.weight.detach()
    if not torch.equal(got.cpu(), expected.to(got.dtype).cpu()):
        raise AssertionError("the attached value differs from the source's")


def attach_case(args, case: str, compute: torch.dtype, device: str = "cpu",
                dtype: torch.dtype = torch.float32, weights: Path | None = None) -> dict:
    model = build(args, device, dtype)
    expected = model.layers[0].gate.weight.detach().clone()
    if weights is not None:   # the file holds it in bf16
        expected = expected.to(torch.bfloat16)
        with torch.device("meta"):
            model = Model(args)
    # attach checks room for the training state (18 B/param) and its largest tensor
    daemon = _daemon(20 * sum(p.numel() for p in model.parameters()))
    try:
        client = tierd.connect(daemon.socket)
        with Meter(daemon.process.pid) as m:
            attach(model, client=client, compute_dtype=compute, weights=weights)
        segment_wait = client.stats()["pool_segment_wait_s"]
        nbytes, masters = _stored_bytes(model, client, compute)
        detach(model)
        _check(model, expected)
        client.close()
    finally:
        daemon.stop()
    return m.row(case, nbytes, params=sum(p.numel() for p in model.parameters()),
                 master_bytes=masters, daemon_segment_wait_s=segment_wait)


def zeros_case(args, how: str) -> list[dict]:
    """Zero fp32 tensors stored in batches, into a fresh pool, then a warm one
    (its segments kept): ``put_many`` of ``torch.zeros`` (what ``tierd.optim``
    does for its moments) or ``put_zeros`` (nothing copied)."""
    n = ZERO_BATCH // 4 // 4   # four tensors per batch
    batches = max(1, int(args.zeros_gb * 1e9) // ZERO_BATCH)
    nbytes = batches * ZERO_BATCH
    daemon = _daemon(nbytes)
    rows = []
    try:
        client = tierd.connect(daemon.socket)
        register_pool(client, torch.device(args.device))   # as an attached model's client
        for pool in ("fresh", "warm"):
            keys = []
            with Meter(daemon.process.pid) as m:
                for b in range(batches):
                    names = [f"z/{b}.{i}" for i in range(4)]
                    if how == "put_zeros":
                        client.put_zeros({k: torch.empty(n, device="meta") for k in names})
                    else:
                        client.put_many({k: torch.zeros(n) for k in names})
                    keys += names
            if not torch.equal(client.get(keys[-1]), torch.zeros(n)):
                raise AssertionError("a stored zero tensor reads back non-zero")
            rows.append(m.row(f"zeros by {how}, {pool} pool", nbytes))
            client.delete(keys)
        client.close()
    finally:
        daemon.stop()
    return rows


def _save_bf16(args, path: Path) -> None:
    from safetensors.torch import save_file
    model = build(args)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              path)


def _warm_up(args) -> None:
    """The first attach of a process imports torch's compiler parts (~1 s) and
    may create the CUDA context: not the write path's cost."""
    daemon = start_daemon(pool=64 << 20, nvme_size=64 << 20)
    try:
        with tierd.connect(daemon.socket) as client:
            detach(attach(nn.Linear(4, 4).to(args.device), client=client,
                          compute_dtype=torch.bfloat16))
    finally:
        daemon.stop()


CASES = ("cpu-bf16", "cpu-fp32", "weights", "gpu", "zeros")


def run(args) -> list[dict]:
    bf16, fp32 = torch.bfloat16, torch.float32
    rows = []
    if "cpu-bf16" in args.cases:
        rows.append(attach_case(args, "cpu fp32 model, compute bf16", bf16))
    if "cpu-fp32" in args.cases:
        rows.append(attach_case(args, "cpu fp32 model, compute fp32", fp32))
    if "weights" in args.cases:
        if args.tmp:
            Path(args.tmp).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            path = Path(tmp) / "model.safetensors"
            _save_bf16(args, path)
            os.sync()   # written just now: its pages stay cached (the page cache warm)
            rows.append(attach_case(args, "weights= bf16 file, meta fp32 model, compute bf16",
                                    bf16, weights=path))
    if "gpu" in args.cases and args.device == "cuda":
        rows.append(attach_case(args, "gpu bf16 model, compute bf16", bf16, "cuda", bf16))
    if "zeros" in args.cases:
        rows += zeros_case(args, "put_many") + zeros_case(args, "put_zeros")
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--ff", type=int, default=14336)
    p.add_argument("--kv", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--zeros-gb", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="a small model (CPU: seconds)")
    p.add_argument("--tmp", default=None, help="where the safetensors file is written")
    p.add_argument("--json", default=None, help="write the result here too")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"which rows, comma-separated among {', '.join(CASES)} (default: all)")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown {', '.join(unknown)}; choose among {', '.join(CASES)}")
    if args.quick:
        args.layers, args.d, args.ff, args.kv, args.vocab, args.zeros_gb = 2, 256, 512, 64, 1000, 0.2
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _warm_up(args)
    rows = run(args)
    for r in rows:
        print(f"{r['case']:>52}: {r['bytes'] / 1e9:7.2f} GB in {r['seconds']:7.2f} s = "
              f"{r['gb_per_s']:6.2f} GB/s; client CPU {r['client_cpu_s']:.1f} s "
              f"({r['client_sys_s']:.1f} sys, {r['client_minor_faults']} faults), "
              f"daemon CPU {r['daemon_cpu_s']:.1f} s"
              + (f", {r['daemon_segment_wait_s']:.2f} s making segments in reserves"
                 if "daemon_segment_wait_s" in r else ""))
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "threads": torch.get_num_threads(),
           "pool_threads": os.environ.get("TIERD_POOL_THREADS", "default"), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
