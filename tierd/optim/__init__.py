"""Optimizers whose master weights and states live in tierd (``tierd.optim``).

Example:
    >>> opt = tierd.optim.AdamW(tierd.attach(model).parameters(), lr=1e-4)  # doctest: +SKIP
"""

from tierd.optim.adamw import AdamW
from tierd.optim.base import StreamedOptimizer
from tierd.optim.compact import CompactState
from tierd.optim.sgd import SGD

__all__ = ["AdamW", "CompactState", "SGD", "StreamedOptimizer"]
