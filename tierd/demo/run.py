"""``tierd demo``: fine-tune a GPT-2 built here with ``tierd.attach`` + ``tierd.optim.AdamW``.

Runs on CUDA when present, else on the CPU. With ``--socket`` or
``$TIERD_SOCKET`` it uses the daemon there (DaemonUnavailable, naming the
path, when none answers: [Note: an explicit socket is authoritative] in
``tierd.client.embedded``); otherwise it starts a private (embedded) daemon for itself; for
``gpt2-small`` its pool is smaller than the model state, so tensors spill to
the NVMe tier and back and the progress lines show bytes moving between tiers.
On a terminal a progress bar (tqdm) shows the steps, loss and tokens/s.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import tierd
from tierd.client.attach import session_of
from tierd.config import format_size, parse_size
from tierd.demo import DEFAULTS, options  # noqa: F401  (options: for scripts)
from tierd.demo.model import GPT, PRESETS
from tierd.demo.text import Batches, generate

STATE_BYTES_PER_PARAM = 16   # fp32 weight + fp32 grad + Adam exp_avg + exp_avg_sq


@dataclass
class DemoResult:
    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)   # the daemon's, after the last step
    params: int = 0
    h2d_bytes: int = 0                          # copied pool -> compute device, all steps
    gpu_peak_bytes: int | None = None


def cmd_demo(args: argparse.Namespace) -> int:
    run(args, out=tqdm.write)    # lines go above the progress bar, not through it
    return 0


def run(args: argparse.Namespace, out=lambda line: None) -> DemoResult:
    """Train ``args.steps`` steps; ``out`` receives each progress line."""
    d = DEFAULTS[args.model]
    batch_size, seq_len = args.batch_size or d["batch_size"], args.seq_len or d["seq_len"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(args.seed)
    model = GPT(PRESETS[args.model]).train()
    n_params = sum(p.numel() for p in model.parameters())
    state = n_params * STATE_BYTES_PER_PARAM
    out(f"tierd demo: {args.model}, {n_params / 1e6:.1f}M params, model state "
        f"{format_size(state)}, {device}, {dtype}, batch {batch_size} x {seq_len} tokens")
    client, embedded = _open_client(args, state, d["pool"])
    try:
        stats = client.stats()
        out(f"daemon: pool {format_size(stats['pool_bytes'])}, NVMe "
            f"{format_size(stats['nvme_bytes'])}"
            + ("" if embedded is None else f" (private, socket {embedded.socket})"))
        tierd.attach(model, client=client, device=device, compute_dtype=dtype)
        opt = tierd.optim.AdamW(model.parameters(), lr=args.lr or d["lr"], weight_decay=0.01,
                                max_grad_norm=1.0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        data = Batches(generate(), batch_size, seq_len, args.seed)
        with tqdm(total=args.steps, desc="training", unit="step", leave=False,
                  disable=None if getattr(args, "progress", True) else True) as bar:
            result = _train(model, opt, client, data, args.steps, device, out, bar)
        result.params = n_params
        if device.type == "cuda":
            result.gpu_peak_bytes = torch.cuda.max_memory_allocated(device)
        _summary(result, state, out)
        return result
    finally:
        client.close()   # the demo's job is ephemeral: its keys go with the session
        if embedded is not None:
            embedded.stop()


def _open_client(args, state_bytes: int, default_pool: str | None):
    from tierd.client.embedded import resolve_socket, start_daemon
    choice = resolve_socket(args.socket)
    if choice.explicit:
        return tierd.connect(choice.path), None
    pool = args.pool or default_pool
    embedded = start_daemon(pool=parse_size(pool) if pool else None,
                            nvme_size=max(2 * state_bytes, 1 << 30))
    try:
        return tierd.connect(embedded.socket), embedded
    except BaseException:
        embedded.stop()
        raise


def _train(model, opt, client, data: Batches, steps: int, device, out, bar: tqdm) -> DemoResult:
    result = DemoResult()
    session = session_of(model)
    before, copies = client.stats(), session.stats()
    for step in range(1, steps + 1):
        ids, targets = (t.to(device) for t in data.next())
        start = time.perf_counter()
        _, loss = model(ids, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        stats, now = client.stats(), session.stats()
        result.losses.append(value)
        result.tokens_per_s.append(ids.numel() / seconds)
        result.h2d_bytes += now["h2d_bytes"] - copies["h2d_bytes"]
        out(f"step {step:>4}/{steps}  loss {value:7.4f}  {ids.numel() / seconds:8.0f} tok/s  "
            f"pool->{device.type} {format_size(now['h2d_bytes'] - copies['h2d_bytes']):>9}  "
            f"{device.type}->pool {format_size(now['d2h_bytes'] - copies['d2h_bytes']):>9}  "
            f"pool->NVMe {format_size(stats['bytes_to_nvme'] - before['bytes_to_nvme']):>9}  "
            f"NVMe->pool {format_size(stats['bytes_to_pool'] - before['bytes_to_pool']):>9}")
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{ids.numel() / seconds:.0f}")
        bar.update()
        before, copies = stats, now
    result.stats = client.stats()
    return result


def _summary(r: DemoResult, state: int, out) -> None:
    if not r.losses:
        return
    s = r.stats
    out(f"done: {len(r.losses)} steps, loss {r.losses[0]:.4f} -> {r.losses[-1]:.4f}, "
        f"{sum(r.tokens_per_s) / len(r.tokens_per_s):.0f} tok/s on average")
    if r.gpu_peak_bytes is None:
        out(f"model state {format_size(state)} (weights, grads, Adam moments in fp32); "
            f"ran on the CPU, so no GPU memory was used")
    else:
        out(f"GPU peak memory {format_size(r.gpu_peak_bytes)} = "
            f"{100 * r.gpu_peak_bytes / state:.0f}% of the model state {format_size(state)}")
    out(f"pool {format_size(s['pool_used_bytes'])} used of {format_size(s['pool_bytes'])}, "
        f"NVMe {format_size(s['nvme_used_bytes'])} used; daemon moved "
        f"{format_size(s['bytes_to_nvme'])} to NVMe and {format_size(s['bytes_to_pool'])} "
        f"to the pool in all")
