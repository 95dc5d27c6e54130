"""How much of the CPU optimizer update hides under backward.

    python -m tierd.bench.cpu_update                   # GPT-2 style, 6 x 512, B=4, T=128
    python -m tierd.bench.cpu_update --layers 12 --width 768 --json out.json

Runs the same model three ways on the machine's device and an embedded
daemon, ``optimizer_placement="cpu"`` throughout:

- ``in step()``: ``fused=False``, the update runs in ``opt.step()`` after
  backward (what "cpu" did before updates overlapped backward);
- ``overlapped``: the default, each unit's update runs on host threads as
  soon as its gradients are final ([Note: CPU updates overlapped with
  backward] in ``tierd.updates.cpu_update``);
- ``no math``: the overlapped path with the optimizer's math left out (an
  AdamW whose ``update_params`` does nothing): the floor of the overlapped way.

The ways take turns step by step (a load that changes meanwhile hits all
alike). It prints the median (``--stat min``: the least) wall seconds of
backward + ``step()`` and of the forward (the forward after an overlapped step waits for updates still
running) and of the whole step, the time ``step()`` takes when it updates
(``in step()``: the update alone) and the share of that hidden by
overlapping, from whole steps: ``1 - (overlapped - no_math) / update``.

Measured on the 2-core CPU machine, shared with other jobs (load average
4 to 6 during the runs), at d6b0f08 (one update thread),
``--steps 30 --warmup 3 --stat min`` (19.5M params, fp32, B=4, T=128):

| threads | way | backward + step | whole step |
|---|---|---|---|
| ``OMP_NUM_THREADS=1`` | in step() | 574 ms (step() 44 ms) | 862 ms |
| | overlapped | 574 ms | 862 ms |
| | no math | 526 ms | 825 ms |
| default (2) | in step() | 342 ms (step() 41 ms) | 509 ms |
| | overlapped | 363 ms | 533 ms |
| | no math | 305 ms | 474 ms |

On this machine the overlap hides little of the update (0.15 of it with
one intra-op thread each; with two, the overlapped step is 24 ms slower than
the update in ``step()``): backward runs on the same two cores as the
update, which other jobs also load, so the update's thread gets no idle core
(its own time grows from 41-44 ms alone to 100-129 ms beside backward). The
overlap pays where backward runs on a GPU and the host's cores idle
meanwhile; that is to be measured on the GPU machine. Shorter runs of the
same command at lower ``--steps`` moved by more than the update itself
(load average near 10).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tierd.optim
from tierd.client.attach import attach, detach
from tierd.client.embedded import start_daemon

_WAYS = ("in step()", "overlapped", "no math")


class _NoMath(tierd.optim.AdamW):
    """The overlapped path with every step of it but the optimizer's math."""

    def update_params(self, group, tps, params, grads, moments) -> None:
        pass


def build(layers: int, width: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                     n_positions=seq, vocab_size=1000, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, opt, ids, device: torch.device) -> tuple[float, float, float, float]:
    """One step: seconds of the forward, of backward + step, of step alone, of all."""
    _sync(device)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    _sync(device)
    t1 = time.perf_counter()
    loss.backward()
    _sync(device)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    _sync(device)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t1, t3 - t2, t3 - t0


def run(ref: GPT2LMHeadModel, args, socket: str) -> tuple[list[dict], float]:
    """Median seconds of forward and of backward + step, each way; the ways
    take turns step by step, so a load that changes meanwhile hits all alike."""
    runs = {}
    for way in _WAYS:
        model = attach(copy.deepcopy(ref), client=tierd.connect(socket),
                       optimizer_placement="cpu")
        cls = _NoMath if way == "no math" else tierd.optim.AdamW
        opt = cls(model.parameters(), lr=1e-4, fused=False if way == "in step()" else None)
        runs[way] = (model, opt, [], [], [], [])
    device = next(iter(runs[_WAYS[0]][0].parameters())).tiered.session.device
    gen = torch.Generator().manual_seed(0)
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            host = runs["overlapped"][1]._fused[0].host
            host.wait_all()
            update_s = host.seconds
        ids = torch.randint(0, 1000, (args.batch, args.seq), generator=gen).to(device)
        for model, opt, *times in runs.values():
            if i >= args.warmup:
                for kept, t in zip(times, _step(model, opt, ids, device)):
                    kept.append(t)
            else:
                _step(model, opt, ids, device)
    host.wait_all()
    update_s = (host.seconds - update_s) / args.steps
    rows = []
    for way, (model, _, fwd, bwd, step, total) in runs.items():
        detach(model)
        rows.append({"way": way, "forward_s": args.stat(fwd), "backward_step_s": args.stat(bwd),
                     "step_s": args.stat(step), "total_s": args.stat(total)})
    return rows, update_s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="of the steps' times (min: a machine others load)")
    p.add_argument("--json", default=None, help="write the result here too")
    args = p.parse_args(argv)
    args.stat = {"median": statistics.median, "min": min}[args.stat]
    ref = build(args.layers, args.width, args.seq)
    params = sum(t.numel() for t in ref.parameters())
    daemon = start_daemon(pool=max(256 << 20, 3 * 40 * params), nvme_size=1 << 30)
    try:
        rows, update_s = run(ref, args, str(daemon.socket))
    finally:
        daemon.stop()
    t = {r["way"]: r["total_s"] for r in rows}
    serial = rows[0]["step_s"]   # the update alone, in step() after backward
    out = {"params": params, "rows": rows, "update_thread_s": update_s,
           "hidden_fraction": 1 - (t["overlapped"] - t["no math"]) / serial}
    for r in rows:
        print(f"{r['way']:>10}: backward+step {r['backward_step_s'] * 1e3:8.1f} ms "
              f"(step() {r['step_s'] * 1e3:6.1f} ms), forward {r['forward_s'] * 1e3:8.1f} ms, "
              f"whole step {r['total_s'] * 1e3:8.1f} ms")
    print(f"{params / 1e6:.1f}M params; the update takes {serial * 1e3:.1f} ms in step() and "
          f"{update_s * 1e3:.1f} ms of thread time overlapped; "
          f"{out['hidden_fraction']:.2f} of it hidden under backward")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
