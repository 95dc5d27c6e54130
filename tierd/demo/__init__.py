"""``tierd demo``: fine-tune a small GPT-2 with every tensor in tierd's tiers.

This module holds only the demo's options, so ``tierd --help`` and the other
commands never import torch; :mod:`tierd.demo.run` trains.
"""

from __future__ import annotations

import argparse

#: Per model (the presets of :mod:`tierd.demo.model`): batch size, sequence
#: length, learning rate, private pool (None: the embedded daemon's own
#: default, half of available memory).
DEFAULTS = {
    "gpt2-small": dict(batch_size=4, seq_len=128, lr=3e-3, pool="40MiB"),
    "gpt2-1.3b": dict(batch_size=8, seq_len=1024, lr=1e-4, pool=None),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``tierd demo``."""
    p.add_argument("--model", choices=sorted(DEFAULTS), default="gpt2-small",
                   help="gpt2-small: 3M parameters, runs on a CPU in seconds; gpt2-1.3b: "
                        "for a GPU (default gpt2-small)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--batch-size", type=int, help="sequences per step (small 4, 1.3b 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (small 128, 1.3b 1024)")
    p.add_argument("--lr", type=float, help="AdamW learning rate (small 3e-3, 1.3b 1e-4)")
    p.add_argument("--dtype", choices=("fp32", "bf16"),
                   help="compute dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--device", help="compute device (default cuda if present, else cpu)")
    p.add_argument("--socket", help="use the daemon at this socket (default $TIERD_SOCKET) "
                                    "instead of a private one")
    p.add_argument("--pool", help="pool of the private daemon (small: 40MiB, below its "
                                  "model state, so it spills to NVMe; 1.3b: the embedded "
                                  "default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the text "
                                                       "(default 0)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it is shown only on a terminal anyway)")


def options(**kw) -> argparse.Namespace:
    """The demo's arguments as ``tierd demo`` would parse them (for tests and scripts)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args([])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns
