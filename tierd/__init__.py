"""tierd: train and run PyTorch models bigger than GPU memory.

A per-node daemon (``tierd serve``) keeps tensors in a shared pinned host pool
and on NVMe; clients store tensors directly (:func:`connect`) or attach a model
so its parameters stream onto the GPU just before use (:func:`attach`).

>>> import tierd
>>> c = tierd.connect()                 # doctest: +SKIP
>>> c.put("opt/0.m", torch.zeros(4))    # doctest: +SKIP

The names below are imported on first use, so ``import tierd`` (and the
``tierd status``/``health`` probes) does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS = {
    "AttachConfig": "tierd.client.attach", "attach": "tierd.client.attach",
    "attached": "tierd.client.attach", "detach": "tierd.client.attach",
    "commit": "tierd.client.checkpoint", "resumed_step": "tierd.client.checkpoint",
    "AsyncClient": "tierd.client.connection", "Client": "tierd.client.connection",
    "Leased": "tierd.client.connection", "aconnect": "tierd.client.connection",
    "connect": "tierd.client.connection",
    **{name: "tierd.errors" for name in (
        "AccessDenied", "Busy", "CapacityError", "DaemonUnavailable", "IntegrityError",
        "ProtocolError", "RankFailed", "StateError", "TierIOError", "TierdError",
        "UnknownKey")},
}
_SUBMODULES = ("optim",)

__all__ = sorted([*_EXPORTS, *_SUBMODULES])


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"tierd.{name}")
    raise AttributeError(f"module 'tierd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
