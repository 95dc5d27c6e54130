"""One rank of a data-parallel training run, launched like torchrun launches it.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 TIERD_SOCKET=... \\
        python -m tests.client.dist_worker --out DIR [--steps 3] [--tierd]

Without WORLD_SIZE (or with 1) it is the single-process reference. Each rank
trains on its contiguous share of every global batch; the loss is the mean
over the rank's share, so averaged gradients are those of the global batch.
Rank results (losses, final weights, the daemon's view of the job) go to
``DIR/rank<R>.pt``. ``--die-at-step N`` makes rank ``--die-rank`` exit
abruptly (SIGKILL itself) at step N; every other rank records the error it got.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import tierd
from tests.client.models import batches, gpt2


def _owns_parameters(module: torch.nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--short-seq-from", type=int, default=None,
                    help="from this step on, sequences are 8 tokens (new input shapes)")
    ap.add_argument("--short-last-window", action="store_true",
                    help="the last step has one micro-batch, not --accumulate")
    ap.add_argument("--tierd", action="store_true", help="attach (else plain torch)")
    ap.add_argument("--ddp", action="store_true", help="plain torch DDP (a reference)")
    ap.add_argument("--job", default="ddp")
    ap.add_argument("--compute-dtype", default="fp32")
    ap.add_argument("--resident-below", type=int, default=0,
                    help="attach's resident_below_bytes (small params stay on the device)")
    ap.add_argument("--gpu-memory-bytes", type=int, default=None,
                    help="attach's gpu_memory_bytes (on the CPU: placement against it)")
    ap.add_argument("--last-rank-gpu-memory-bytes", type=int, default=None,
                    help="the last rank asks for another cap (every rank gets the smallest)")
    ap.add_argument("--device", default=None, help="attach's device (default: its own choice)")
    ap.add_argument("--module-units", action="store_true",
                    help="a unit per module owning parameters (attach's unit_modules), "
                         "the granularity the caps of the placement tests are set for")
    ap.add_argument("--state", default="fp32", help="tierd.optim.AdamW's state= (compact)")
    ap.add_argument("--gpu-tier", default="replicated", help="attach's gpu_tier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--last-rank-n-embd", type=int, default=None,
                    help="the last rank builds a different model (attach must refuse)")
    ap.add_argument("--die-rank", type=int, default=None)
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--commit-at", type=int, default=None, help="commit after this step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--start-step", type=int, default=0)
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    odd = args.last_rank_n_embd is not None and rank == world - 1
    cap = args.gpu_memory_bytes
    if args.last_rank_gpu_memory_bytes is not None and rank == world - 1:
        cap = args.last_rank_gpu_memory_bytes
    model = gpt2(seed=args.seed, n_embd=args.last_rank_n_embd if odd else args.n_embd)
    data = batches(args.steps * args.accumulate, batch=args.global_batch, seed=args.seed + 1)
    share = args.global_batch // world
    result: dict = {"rank": rank, "losses": []}
    try:
        if args.tierd:
            model = tierd.attach(model, job=args.job, resume=args.resume,
                                 compute_dtype=args.compute_dtype,
                                 resident_below_bytes=args.resident_below,
                                 gpu_memory_bytes=cap, device=args.device,
                                 gpu_tier=args.gpu_tier,
                                 unit_modules=_owns_parameters if args.module_units else None)
            opt = tierd.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                                    max_grad_norm=args.clip, state=args.state,
                                    accumulation_steps=args.accumulate)
        else:
            if args.ddp:
                model = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01,
                                    foreach=False)
        for step in range(args.start_step, args.steps):
            if args.die_at_step == step and rank == args.die_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            micros = 1 if args.short_last_window and step == args.steps - 1 else args.accumulate
            for micro in range(micros):
                ids = data[step * args.accumulate + micro][rank * share:(rank + 1) * share]
                if args.short_seq_from is not None and step >= args.short_seq_from:
                    ids = ids[:, :8]
                ids = ids if args.device is None else ids.to(args.device)
                loss = model(input_ids=ids, labels=ids).loss / args.accumulate
                loss.backward()
                result["losses"].append(loss.item())
            if not args.tierd and args.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()
            if args.commit_at == step:
                tierd.commit(model, opt, step)
        plain = model.module if args.ddp else model
        result["weights"] = {k: v.clone() for k, v in plain.state_dict().items()}
        if args.tierd:
            stats = tierd.client.attach.session_of(model).client.stats()
            result["job"] = stats["jobs"].get(args.job)
            session = tierd.client.attach.session_of(model)
            result["session"] = session.stats()
            plan = session.placer.plan
            result["plan"] = None if plan is None else {
                "places": {i: p.value for i, p in plan.places.items()},
                "device_bytes": plan.device_bytes, "streamed_bytes": plan.streamed_bytes}
            tierd.detach(model)
            result["detached"] = {k: v.clone() for k, v in model.state_dict().items()}
    except Exception as exc:   # the test reads what each rank saw
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        result["error_at"] = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{rank}.pt")
    if world > 1 and "error" not in result:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
