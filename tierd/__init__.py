"""tierd: train and run PyTorch models bigger than GPU memory.

A per-node daemon (``tierd serve``) keeps tensors in a shared pinned host pool
and on NVMe; clients store tensors directly (:func:`connect`) or attach a model
so its parameters stream onto the GPU just before use (:func:`attach`).

>>> import tierd
>>> c = tierd.connect()                 # doctest: +SKIP
>>> c.put("opt/0.m", torch.zeros(4))    # doctest: +SKIP
"""

from tierd import optim
from tierd.client.attach import AttachConfig, attach, attached, detach
from tierd.client.checkpoint import commit, resumed_step
from tierd.client.connection import AsyncClient, Client, Leased, aconnect, connect
from tierd.errors import (Busy, CapacityError, DaemonUnavailable, IntegrityError,
                          ProtocolError, RankFailed, StateError, TierdError, TierIOError, UnknownKey)

__version__ = "0.1.0"

__all__ = ["AttachConfig", "attach", "attached", "commit", "detach", "optim", "resumed_step", "AsyncClient", "Busy", "CapacityError", "Client", "DaemonUnavailable",
           "IntegrityError", "Leased", "ProtocolError", "RankFailed", "StateError", "TierIOError",
           "TierdError", "UnknownKey", "aconnect", "connect"]
