"""Accuracy of compact optimizer state: loss curves of fp32 AdamW against
bf16 moments, 8-bit moments, and 8-bit moments with bf16 masters.

    python -m tierd.bench.compact --out DIR                      # GPT-2 124M, 2,000 steps
    python -m tierd.bench.compact --out DIR --settings bf16,8bit --steps 2000
    python -m tierd.bench.compact --out DIR --tiny --steps 3 --device cpu   # smoke run

On the H200 the settings can go in separate device calls (fp32 took 155 s
at 2,000 steps at commit b83e9df; a compact setting then took over twice
that, its update tensor by tensor, which now runs as multi-tensor ops:
[Note: a compact update is a few dozen launches] in tierd.optim.compact),
the later ones given the first's JSON as the fp32 reference::

    python -m tierd.bench.compact --out $OUT/fp32 --settings fp32,bf16
    python -m tierd.bench.compact --out $OUT/8bit --settings 8bit,8bit-bf16 \
        --reference $OUT/fp32/compact.json

The model is Hugging Face's ``GPT2LMHeadModel`` from a config (GPT-2 small's
shape: 12 x 768, 12 heads, vocab 50257; random weights, the same for every
setting), attached with ``compute_dtype="bf16"`` and trained with
``tierd.optim.AdamW(state=..., master=...)`` ([Note: compact optimizer
state] in tierd.optim.compact): lr ``--lr`` after a linear warm-up over the
first tenth of the steps, weight decay 0.1, batch ``--batch`` x ``--seq``.

The corpus is generated, so nothing is downloaded and every setting sees the
same tokens in the same order: a Markov chain over ``--used`` tokens of the
vocabulary, each followed by one of ``--branch`` successors of its own drawn
with Zipf weights. Its entropy (about 1.1 nats at 4 successors) is far below
the first loss (ln 50257 = 10.8), and the successor table takes thousands
of steps to learn, so the curves keep falling. The held-out loss is
measured at the end on ``--eval-batches`` batches the training never saw.

Settings (``--settings``, comma-separated, default all, in this order):
``fp32`` (exact AdamW: fp32 master and moments), ``bf16`` (bf16 moments),
``8bit`` (8-bit block-quantized moments), ``8bit-bf16`` (8-bit moments and
bf16 masters with stochastic rounding: the most compact). Each runs in turn
in this process (detached before the next); rows are written as they finish,
so a call cut short keeps them. The issue's targets: final loss within 1 %
of fp32 for bf16 moments, within 2 % for 8-bit.

Writes ``DIR/compact.json``: ``{"commit", "device", "torch", "args",
"runs": [{"setting", "state", "master", "losses" (every step's training
loss), "final_loss" (mean of the last twentieth), "eval_loss",
"final_vs_fp32" and "eval_vs_fp32" (relative to the fp32 run's, when it
ran), "bytes_per_param" (what the setting keeps at rest per trained
parameter, from the optimizer's own sizes), "seconds"}]}``, and
``DIR/compact.png`` with the curves (when matplotlib is installed; else
``--plot JSON`` draws it later on a machine that has it, training nothing). With
``--reference``, that file's fp32 run (same arguments required) is the
reference, and is copied into ``runs`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

#: name -> (moments, masters)
SETTINGS = {"fp32": ("fp32", "fp32"), "bf16": ("bf16", "fp32"), "8bit": ("8bit", "fp32"),
            "8bit-bf16": ("8bit", "bf16")}


def corpus(vocab: int, used: int, branch: int, seed: int = 0):
    """The generated language: ``used`` of the vocabulary's tokens, each
    followed by one of ``branch`` successors of its own drawn with Zipf
    weights (a Markov chain). ``batch(n, seq, gen)`` draws ``n`` sequences."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, branch + 1, dtype=torch.float64)
    weights /= weights.sum()
    tokens = torch.randperm(vocab, generator=g)[:used]
    successors = torch.randint(0, used, (used, branch), generator=g)

    def batch(n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        state = torch.randint(0, used, (n,), generator=gen)
        picks = torch.multinomial(weights.expand(n * seq, -1), 1, replacement=True,
                                  generator=gen).view(n, seq)
        out = torch.empty(n, seq, dtype=torch.long)
        for t in range(seq):
            out[:, t] = tokens[state]
            state = successors[state, picks[:, t]]
        return out
    return batch


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(args.seed)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                     vocab_size=args.vocab, n_positions=max(args.seq, 32),
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def kept_bytes_per_param(opt) -> float:
    """What the optimizer's setting keeps at rest per trained parameter:
    compute copy, a master of its own, the moments as stored."""
    tps = opt._owned()
    kept = sum(tp.nbytes + opt.moment_nbytes(tp)
               + (opt.master_nbytes(tp) if opt.separate_master(tp) else 0) for tp in tps)
    return kept / sum(tp.param.numel() for tp in tps)


def run_setting(name: str, start: dict, args, device: torch.device) -> dict:
    import tierd
    import tierd.optim
    state, master = SETTINGS[name]
    model = build(args)
    model.load_state_dict(start)
    model = tierd.attach(model, device=str(device), compute_dtype="bf16")
    try:
        opt = tierd.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                weight_decay=0.1, state=state, master=master)
        warmup = max(1, args.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        batch = corpus(args.vocab, args.used, args.branch, args.seed)
        gen = torch.Generator().manual_seed(args.seed + 1)   # the same tokens for every setting
        losses = []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ids = batch(args.batch, args.seq, gen).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - t0
        held_out = torch.Generator().manual_seed(args.seed + 2)
        evals = []
        with torch.no_grad():
            for _ in range(args.eval_batches):
                ids = batch(args.batch, args.seq, held_out).to(device)
                evals.append(model(input_ids=ids, labels=ids).loss.item())
        tail = losses[-max(1, args.steps // 20):]
        return {"setting": name, "state": state, "master": master, "losses": losses,
                "final_loss": sum(tail) / len(tail), "eval_loss": sum(evals) / len(evals),
                "bytes_per_param": kept_bytes_per_param(opt), "seconds": seconds}
    finally:
        tierd.detach(model)


def plot(result: dict, path: Path) -> str | None:
    """The loss curves (a moving average); returns why not if not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in result["runs"]:
        losses = torch.tensor(run["losses"])
        k = max(1, len(losses) // 50)
        smooth = losses.unfold(0, k, 1).mean(1) if len(losses) >= k else losses
        ax.plot(range(k, k + len(smooth)), smooth.tolist(),
                label=f"{run['setting']} ({run['bytes_per_param']:.2f} B/param, "
                      f"final {run['final_loss']:.4f})")
    a = result["args"]
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average of {max(1, a['steps'] // 50)})")
    ax.set_title(f"tierd compact optimizer state: GPT-2 {a['layers']}x{a['width']}, "
                 f"B={a['batch']} T={a['seq']}, {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def reference_run(path: Path, args: dict) -> dict:
    """The fp32 run of an earlier ``compact.json``, made with the same arguments."""
    earlier = json.loads(path.read_text())
    same = ("steps", "batch", "seq", "lr", "branch", "used", "seed", "layers", "width", "vocab")
    differ = {k: (earlier["args"].get(k), args[k]) for k in same
              if earlier["args"].get(k) != args[k]}
    if differ:
        raise SystemExit(f"--reference {path}: made with other arguments {differ} "
                         "(earlier, now); its fp32 run is no reference for this one")
    run = next((r for r in earlier["runs"] if r["setting"] == "fp32"), None)
    if run is None:
        raise SystemExit(f"--reference {path} has no fp32 run")
    return dict(run, reference=str(path))


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for compact.json/png")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and vocabulary (CPU)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--branch", type=int, default=4, help="successors of each token")
    ap.add_argument("--used", type=int, default=4096, help="tokens of the vocabulary used")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--commit", default=os.environ.get("TIERD_COMMIT"))
    ap.add_argument("--reference", type=Path, default=None,
                    help="an earlier compact.json whose fp32 run is the reference")
    ap.add_argument("--plot", type=Path, default=None,
                    help="only draw DIR/compact.png from this compact.json")
    args = ap.parse_args(argv)
    names = [n for n in args.settings.split(",") if n]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown or not names:
        ap.error(f"--settings {args.settings!r}: use a comma-separated subset of "
                 f"{', '.join(SETTINGS)}")
    args.names = [n for n in SETTINGS if n in names]
    if args.steps < 1 or args.batch < 1 or args.seq < 3 or args.eval_batches < 1:
        ap.error("--steps, --batch and --eval-batches must be >= 1, --seq >= 3")
    if args.tiny:
        args.layers, args.width, args.heads, args.vocab = 2, 64, 2, 512
        args.batch, args.seq, args.eval_batches = min(args.batch, 4), min(args.seq, 32), 2
        args.used = min(args.used, 64)
    else:
        args.layers, args.width, args.heads, args.vocab = 12, 768, 12, 50257
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot is not None:
        result = json.loads(args.plot.read_text())
        why = plot(result, args.out / "compact.png")
        if why:
            raise SystemExit(f"no plot: {why}")
        return result
    device = torch.device(args.device)
    commit = args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or None
    result = {"commit": commit, "device": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items()
                       if k not in ("out", "commit", "names", "reference")},
              "reference": None if args.reference is None else str(args.reference),
              "runs": []}
    target = args.out / "compact.json"
    if args.reference is not None:
        result["runs"].append(reference_run(args.reference, result["args"]))
    start = build(args).state_dict()   # the same weights for every setting
    for name in args.names:
        if name == "fp32" and result["runs"]:
            continue   # the reference's fp32 run stands for it
        run = run_setting(name, start, args, device)
        result["runs"].append(run)
        fp32 = next((r for r in result["runs"] if r["setting"] == "fp32"), None)
        for r in result["runs"]:
            for what in ("final", "eval"):
                r[f"{what}_vs_fp32"] = (r[f"{what}_loss"] / fp32[f"{what}_loss"] - 1
                                        if fp32 else None)
        target.write_text(json.dumps(result, indent=1))
        print(f"{name:10} final {run['final_loss']:.4f} eval {run['eval_loss']:.4f} "
              f"vs fp32 {run['final_vs_fp32'] if fp32 else '-'} "
              f"{run['bytes_per_param']:.2f} B/param {run['seconds']:.1f} s", flush=True)
    why = plot(result, args.out / "compact.png")
    if why:
        print(f"no plot: {why}")
    return result


if __name__ == "__main__":
    main()
