"""Data-parallel tierd on the GPUs of one node, vs one rank, DDP and FSDP2.

    python -m tierd.bench.distributed --out DIR                # GPT-2 1.3B, 2 GPUs
    python -m tierd.bench.distributed --out DIR --quick        # tiny model, CPU/gloo

The orchestrator (this command) starts one ``tierd serve`` and launches each
case with ``torch.distributed.run``; ranks write their figures as JSON. Cases
(``--only``, comma-separated):

- ``correctness``: a small model in bf16, 2 ranks sharing the daemon vs 1
  rank with the global batch: per-step global loss, max relative difference.
- ``tierd``: ``tierd-1`` / ``tierd-N``, the model attached with a GPU budget
  of a few blocks (everything streams), one rank vs N ranks sharing one
  daemon (one copy), per-GPU batch B; step time (slowest rank's median),
  tokens/s, and the bytes each rank moved over its own GPU's PCIe link per
  step (``session.stats``).
- ``placed`` / ``sharded``: ``tierd-N-placed`` / ``tierd-N-sharded``, N ranks
  with placement (``gpu_memory_bytes``: the memory free at attach) keeping
  what fits on the GPUs, ``gpu_tier="replicated"`` / ``"sharded"``
  ([Note: resident state sharded by unit] in ``tierd.client.sharded``).
- ``gpu``: ``gpu-1`` / ``ddp-N``, the model all on the GPU (fp32 params, bf16
  autocast, fused torch AdamW), one rank and N ranks with DDP.
- ``fsdp2`` / ``fsdp2-offload``: ``fsdp2-N`` / ``fsdp2-offload-N``, FSDP2
  (``fully_shard`` per block and the root; bf16 params, fp32 reduction)
  without offload, and with ``CPUOffloadPolicy``.

A case that cannot run (out of memory: DDP or FSDP2 without offload at 13B+)
leaves its row out and its log in the output; the summary names it.

Issue 35's rows, on nvidia-h200-x2 (Llama from config, T=2048, activation
checkpointing, per-GPU batch 1 and 4; not run yet: no 2-GPU machine so far):

    python -m tierd.bench.distributed --out benchmarks/results/x2-distributed-1b3 \\
        --arch llama --size 1.3b --seq 2048 --checkpointing --batches 1,4 \\
        --only tierd,placed,sharded,gpu,fsdp2,fsdp2-offload --pool-gib 96 --nvme-gib 100
    python -m tierd.bench.distributed --out benchmarks/results/x2-distributed-8b \\
        --arch llama --size 8b --seq 2048 --checkpointing --batches 1,4 \\
        --only placed,sharded,gpu,fsdp2,fsdp2-offload --pool-gib 160 --nvme-gib 100 \\
        --case-timeout 900
    python -m tierd.bench.distributed --out benchmarks/results/x2-distributed-13b \\
        --arch llama --size 13b --seq 2048 --checkpointing --batches 1,4 \\
        --only placed,sharded,fsdp2,fsdp2-offload --pool-gib 120 --nvme-gib 100 \\
        --case-timeout 1200
    python -m tierd.bench.distributed --out benchmarks/results/x2-distributed-20b \\
        --arch llama --size 20b --seq 2048 --checkpointing --batches 1 \\
        --tierd-state 8bit \\
        --only placed,sharded,fsdp2,fsdp2-offload --pool-gib 120 --nvme-gib 100 \\
        --case-timeout 1800

(``--steps 4 --warmup 2`` by default.) Each rank builds the model on the
host in fp32 first: 52 GB per rank at 13B, 81 GB at 20B, which with the pool
is most of the x2 machine's 256 GiB. One copy of 13B's exact AdamW state is
208 GB, in pool and NVMe (128 GiB of disk) together; 20B needs compact
moments (``--tierd-state 8bit``: bf16 weights, fp32 masters, 8-bit moments,
about 8 B/param, 162 GB; ``master='bf16'`` is refused under ranks), while
the torch peers keep fp32 AdamW. DDP at 8B and FSDP2 without offload at 20B
are expected to run out of memory: their rows say so. The report is
``DIR/distributed.json`` with a ``.md`` table and a ``.png`` chart;
``--render DIR/distributed.json`` redraws them.

What was predicted before this benchmark first ran, and measured then:
``benchmarks/results/HISTORY.md``, "Data-parallel ranks (tierd.bench.distributed)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tierd.bench import DEFAULT_OUT
from tierd.bench.common import subprocess_env

LR = 1e-4


#: Llama shapes by size: (layers, hidden, intermediate, heads, kv heads, vocab)
LLAMA = {"1.3b": (24, 2048, 5504, 16, 16, 32000),
         "8b": (32, 4096, 14336, 32, 8, 128256),     # Llama-3-8B
         "13b": (40, 5120, 13824, 40, 40, 32000),    # Llama-2-13B
         "20b": (44, 6144, 16384, 48, 48, 32000)}    # 20.3B: does not fit 2 H200s sharded


def build(layers: int, d: int, seq: int, vocab: int, arch: str = "gpt2", size: str = ""):
    torch.manual_seed(0)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        if size:
            layers, d, inter, heads, kv, vocab = LLAMA[size]
        else:
            inter, heads, kv = 4 * d, max(1, d // 128), max(1, d // 128)
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=d, intermediate_size=inter,
                          num_attention_heads=heads, num_key_value_heads=kv,
                          vocab_size=vocab, max_position_embeddings=seq,
                          tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg).train()
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=max(1, d // 128), n_positions=seq,
                     vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "sdpa"
    return GPT2LMHeadModel(cfg).train()


def blocks(model) -> list:
    """The model's repeated blocks (what FSDP2 shards one by one)."""
    inner = getattr(model, "model", None) or model.transformer
    return list(inner.layers if hasattr(inner, "layers") else inner.h)


def fsdp2(model, device: torch.device, world: int, *, offload: bool):
    """``fully_shard`` per block and the root: bf16 params and fp32 gradient
    reduction on CUDA, with ``CPUOffloadPolicy`` when ``offload``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    if not offload:
        model = model.to(device)
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    return model


# ------------------------------------------------------------------ rank side
def rank_main(args) -> None:
    import tierd
    from tierd.client.attach import session_of
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    model = build(args.layers, args.n_embd, args.seq, args.vocab, args.arch, args.size)
    if args.checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    block = sum(p.numel() for p in blocks(model)[0].parameters()) * 2
    session = None
    if args.mode == "tierd":
        # placed: what fits stays on the GPU (the memory free at attach);
        # else a budget of a few blocks, everything streamed
        streamed = dict(gpu_budget_bytes=args.budget_blocks * block,
                        prefetch_bytes=args.budget_blocks * block)
        if args.placed:   # on the CPU placement needs a cap: one larger than the model
            streamed = {} if cuda else dict(gpu_memory_bytes=1 << 30)
        model = tierd.attach(model, job=args.job, compute_dtype="bf16",
                             gpu_tier=args.gpu_tier if world > 1 else "replicated",
                             optimizer_state=tierd.optim.CompactState(
                                 state=args.tierd_state, master=args.tierd_master),
                             **streamed)
        opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=args.tierd_state,
                                master=args.tierd_master,
                                prefetch_bytes=args.budget_blocks * block * 6)
        session = session_of(model)
    elif args.mode in ("fsdp2", "fsdp2-offload"):
        model = fsdp2(model, device, world, offload=args.mode == "fsdp2-offload")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    else:
        model = model.to(device)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if cuda else None)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=cuda)
    out = {"mode": args.mode, "world": world, "rank": rank, "cases": []}
    for b in [int(x) for x in args.batches.split(",")]:
        g = torch.Generator().manual_seed(1000 + b * world)   # same global batches for any world
        data = [torch.randint(0, args.vocab, (b * world, args.seq), generator=g)
                for _ in range(args.warmup + args.steps)]
        losses, times, pcie = [], [], []
        for i, ids in enumerate(data):
            mine = ids[rank * b:(rank + 1) * b].to(device)
            before = session.stats() if session else None
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if session:
                after = session.stats()
                pcie.append({k: after[k] - before[k] for k in ("h2d_bytes", "d2h_bytes",
                                                                 "requests", "hook_seconds")})
            losses.append(loss.item())
            if i >= args.warmup:
                times.append(dt)
        case = {"batch": b, "losses": losses, "step_s": statistics.median(times),
                "pcie": pcie[args.warmup:] if pcie else None}
        if cuda:
            case["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cases"].append(case)
    if session is not None:
        out["reduced_bytes_per_backward"] = (session.share.reducer.reduced_bytes
                                             / max(1, session.counters.backwards)
                                             if session.share else 0)
        out["job"] = session.client.stats()["jobs"].get(args.job)
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, out)
    else:
        gathered = [out]
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    if args.mode == "tierd":
        tierd.detach(model)
    if world > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------ orchestrator
def launch(args, mode: str, nproc: int, name: str, model: dict, batches: str,
           steps: int, warmup: int, socket: Path, *extra: str) -> list[dict]:
    result = args.out / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "tierd.bench.distributed", "--rank-side",
           "--mode", mode, "--job", name, "--result", str(result), "--batches", batches,
           "--steps", str(steps), "--warmup", str(warmup),
           *[f"--{k}={v}" for k, v in model.items()], *extra]
    if args.cpu:
        cmd.append("--cpu")
    if args.checkpointing:
        cmd.append("--checkpointing")
    if mode == "tierd":
        cmd += ["--tierd-state", args.tierd_state, "--tierd-master", args.tierd_master]
    env = dict(subprocess_env(), TIERD_SOCKET=str(socket))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.case_timeout)
    except subprocess.TimeoutExpired as exc:
        print(f"[{name}] timed out after {args.case_timeout:.0f} s", flush=True)
        (args.out / f"{name}.log").write_text(f"{exc.stdout or ''}{exc.stderr or ''}"
                                              f"\ntimed out after {args.case_timeout} s")
        return []
    print(f"[{name}] {time.perf_counter() - t0:.0f} s rc={proc.returncode}", flush=True)
    (args.out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.exists():
        print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
        return []
    return json.loads(result.read_text())


def start_daemon(args) -> subprocess.Popen:
    sock = args.out / "tierd.sock"
    cmd = [sys.executable, "-m", "tierd", "serve", "--nvme", str(args.out / "nvme"),
           "--socket", str(sock), "--pool", f"{args.pool_gib}GiB", "--nvme-size",
           f"{args.nvme_gib}GiB", "--log-level", "WARNING"]
    (args.out / "nvme").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env=subprocess_env())
    import tierd
    deadline = time.monotonic() + 60
    while True:
        try:
            tierd.connect(sock).close()
            return proc, sock
        except tierd.DaemonUnavailable:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.1)


def summarize(rows: dict, nproc: int) -> dict:
    """Per batch: slowest-rank step time, tokens/s, per-GPU PCIe bytes, ratios."""
    table = {}
    for name, ranks in rows.items():
        if not ranks or name.startswith("correctness"):
            continue
        for ci, case in enumerate(ranks[0]["cases"]):
            b = case["batch"]
            step = max(r["cases"][ci]["step_s"] for r in ranks)
            entry = {"step_s": step, "tokens_per_s": b * len(ranks) * ARGS.seq / step,
                     "peak_gpu_gib": max(r["cases"][ci].get("peak_gpu_bytes", 0)
                                         for r in ranks) / 2**30}
            if case.get("pcie"):
                per_rank = [{k: statistics.mean(p[k] for p in r["cases"][ci]["pcie"])
                             for k in ("h2d_bytes", "d2h_bytes", "requests")} for r in ranks]
                entry["pcie_per_gpu_gb"] = [{"in": p["h2d_bytes"] / 1e9,
                                             "out": p["d2h_bytes"] / 1e9,
                                             "requests": p["requests"]} for p in per_rank]
                entry["pool_job_bytes"] = ranks[0].get("job")
            table.setdefault(str(b), {})[name] = entry
    for b, cases in table.items():
        ref = cases.get(f"ddp-{nproc}", {}).get("step_s")
        fsdp = cases.get(f"fsdp2-{nproc}", {}).get("step_s")
        single = cases.get("gpu-1", {}).get("step_s")
        for name, e in cases.items():
            same = not name.endswith("-1")   # a case of nproc ranks
            if ref:
                e["vs_ddp_same_ranks"] = e["step_s"] / ref if same else None
            if fsdp:
                e["vs_fsdp2_same_ranks"] = e["step_s"] / fsdp if same else None
            if single:
                e["vs_gpu_1"] = e["step_s"] / single
    for name, ranks in rows.items():   # a case that failed (out of memory) says so
        if not ranks:
            for cases in table.values():
                cases[name] = {"failed": True}
    return table


def correctness(rows: dict) -> dict:
    one, two = rows.get("correctness-1"), rows.get("correctness")
    if not one or not two:
        return {"error": "a correctness case failed"}
    out = {}
    for ci, case in enumerate(one[0]["cases"]):
        ref = case["losses"]
        glob = [statistics.mean(r["cases"][ci]["losses"][i] for r in two)
                for i in range(len(ref))]
        out[str(case["batch"])] = {
            "one_rank": ref, "ranks_mean": glob,
            "max_rel_diff": max(abs(a - b) / abs(a) for a, b in zip(ref, glob))}
    return out


def render(report: dict, prefix: Path, command: str) -> None:
    """Markdown table and a step-time chart of a ``distributed.json``."""
    lines = [f"# tierd data-parallel: {report['nproc']} ranks on {report['device']}", "",
             f"`{command}`; model {report['model']}; per-GPU batch B, T={report['model']['seq']}.",
             "Step: slowest rank's median. PCIe: bytes each rank's GPU moved per step "
             "(pool to GPU / GPU to pool).", "",
             "| B | case | step s | tokens/s | vs 1 GPU all-on-GPU | vs DDP same ranks | "
             "vs FSDP2 same ranks | PCIe in/out per GPU GB | daemon requests/step/rank | "
             "peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for b, cases in report["steps"].items():
        for name, e in cases.items():
            if e.get("failed"):
                lines.append(f"| {b} | {name} | did not run (its log: `{name}.log`) |"
                             + " |" * 7)
                continue
            pcie = e.get("pcie_per_gpu_gb") or []
            io = " ".join(f"{p['in']:.1f}/{p['out']:.1f}" for p in pcie) or "-"
            req = " ".join(f"{p['requests']:.0f}" for p in pcie) or "-"
            vs_ddp, vs_gpu = e.get("vs_ddp_same_ranks"), e.get("vs_gpu_1")
            vs_fsdp = e.get("vs_fsdp2_same_ranks")
            lines.append(f"| {b} | {name} | {e['step_s']:.3f} | {e['tokens_per_s']:.0f} | "
                         f"{'-' if not vs_gpu else f'{vs_gpu:.2f}x'} | "
                         f"{'-' if not vs_ddp else f'{vs_ddp:.2f}x'} | "
                         f"{'-' if not vs_fsdp else f'{vs_fsdp:.2f}x'} | {io} | {req} | "
                         f"{e['peak_gpu_gib']:.1f} |")
    corr = report.get("correctness", {})
    for b, c in corr.items():
        if isinstance(c, dict):
            lines += ["", f"Correctness (small GPT-2, bf16, global batch {b}): mean loss of "
                      f"the ranks vs one rank, max relative difference over "
                      f"{len(c['one_rank'])} steps: {c['max_rel_diff']:.2e}."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    batches = list(report["steps"])
    names = sorted({n for c in report["steps"].values() for n, e in c.items()
                    if not e.get("failed")})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j, b in enumerate(batches) if name in report["steps"][b]]
        ys = [report["steps"][b][name]["tokens_per_s"] for b in batches
              if name in report["steps"][b]]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))],
                  [f"B={b} per GPU" for b in batches])
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title(f"GPT-2 {report['model']['layers']} layers, {report['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=110)


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="tierd")
    ap.add_argument("--job", default="bench")
    ap.add_argument("--result", default="")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT / "distributed")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--size", choices=("",) + tuple(LLAMA), default="",
                    help="a Llama size (sets layers, widths and vocab)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--tierd-state", default="fp32", help="tierd's AdamW moments (8bit: compact)")
    ap.add_argument("--tierd-master", default="fp32", help="tierd's AdamW masters (bf16: compact)")
    ap.add_argument("--placed", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gpu-tier", default="replicated", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-blocks", type=int, default=4)
    ap.add_argument("--pool-gib", type=int, default=48)
    ap.add_argument("--nvme-gib", type=int, default=64)
    ap.add_argument("--case-timeout", type=float, default=300)
    ap.add_argument("--only", default="correctness,tierd,gpu")
    ap.add_argument("--render", type=Path, help="write .md/.png next to this distributed.json")
    args = ap.parse_args()
    ARGS = args
    if args.render:
        report = json.loads(args.render.read_text())
        return render(report, args.render.with_suffix(""), report.get("command", ""))
    if args.rank_side:
        return rank_main(args)
    if args.quick:
        args.cpu = True
        args.layers, args.n_embd, args.seq, args.vocab = 2, 64, 32, 128
        args.batches, args.steps, args.warmup, args.pool_gib, args.nvme_gib = "2", 2, 1, 1, 2
    args.out.mkdir(parents=True, exist_ok=True)
    daemon, sock = start_daemon(args)
    model = dict(layers=args.layers, **{"n-embd": args.n_embd}, seq=args.seq, vocab=args.vocab,
                 **{"budget-blocks": args.budget_blocks}, arch=args.arch, size=args.size)
    small = {"layers": 4, "n-embd": 256, "seq": 128, "vocab": 1024, "budget-blocks": 2,
             "arch": args.arch, "size": ""}
    if args.quick:
        small = dict(model)
    n = args.nproc
    rows: dict = {}
    only = args.only.split(",")
    try:
        if "correctness" in only:
            rows["correctness-1"] = launch(args, "tierd", 1, "correctness-1", small,
                                           "4", 6, 0, sock)
            rows["correctness"] = launch(args, "tierd", n, "correctness", small,
                                         str(4 // n), 6, 0, sock)
        if "tierd" in only:
            rows["tierd-1"] = launch(args, "tierd", 1, "tierd-1", model, args.batches,
                                     args.steps, args.warmup, sock)
            rows[f"tierd-{n}"] = launch(args, "tierd", n, f"tierd-{n}", model, args.batches,
                                        args.steps, args.warmup, sock)
        for case, tier in (("placed", "replicated"), ("sharded", "sharded")):
            if case in only:
                rows[f"tierd-{n}-{case}"] = launch(args, "tierd", n, f"tierd-{n}-{case}", model,
                                                   args.batches, args.steps, args.warmup, sock,
                                                   "--placed", "--gpu-tier", tier)
        for mode in ("fsdp2", "fsdp2-offload"):
            if mode in only:
                rows[f"{mode}-{n}"] = launch(args, mode, n, f"{mode}-{n}", model, args.batches,
                                             args.steps, args.warmup, sock)
        if "gpu" in only:
            rows["gpu-1"] = launch(args, "ddp", 1, "gpu-1", model, args.batches,
                                   args.steps, args.warmup, sock)
            rows[f"ddp-{n}"] = launch(args, "ddp", n, f"ddp-{n}", model, args.batches,
                                      args.steps, args.warmup, sock)
    finally:
        daemon.terminate()
        daemon.wait(30)
    report = {"model": model, "nproc": n, "command": " ".join(["python -m tierd.bench.distributed",
                                                                 *sys.argv[1:]]),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "correctness": correctness(rows), "steps": summarize(rows, n), "raw": rows}
    (args.out / "distributed.json").write_text(json.dumps(report, indent=1))
    render(report, args.out / "distributed", report["command"])
    print(json.dumps({k: report[k] for k in ("correctness", "steps")}, indent=1))


if __name__ == "__main__":
    main()
