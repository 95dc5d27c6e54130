"""The key layout: every key the client stores is spelled here and nowhere else.

An attached model stores everything under one prefix, ``tierd-attach/<name>``
(``name`` is the job's name or a random one), so deleting, committing and
resuming a model means acting on one prefix:

``<prefix>/p/<param>``            the value in the compute dtype (what is copied in)
``<prefix>/master/<param>``       fp32 master weights when the compute dtype is lower
``<prefix>/grad/<param>``         the fp32 gradient summed across backwards
``<prefix>/optim/<state>/<param>`` an optimizer state (``exp_avg``, ``momentum_buffer``, ...)
``<prefix>/optim/step/<param>``   the optimizer's step count (stored at commit)
``<prefix>/optim/_step``          the training step of the last commit

Activation tiering stores chunks under ``tierd-act/<random>/<n>``.

Example:
    >>> k = ModelKeys.for_name("run1")
    >>> k.param("h.0.weight"), k.state("exp_avg", "h.0.weight")
    ('tierd-attach/run1/p/h.0.weight', 'tierd-attach/run1/optim/exp_avg/h.0.weight')
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

ATTACH_ROOT = "tierd-attach"
ACTIVATION_ROOT = "tierd-act"

_KINDS = {"p": "weights", "grad": "grads", "master": "state", "optim": "state"}


def key_kind(key: str) -> str | None:
    """What an attached model's key holds: "weights" (compute copies),
    "grads", "state" (masters and optimizer state); None for other keys.

    Example:
        >>> key_kind(ModelKeys("tierd-attach/m").grad("h.0.w")), key_kind("tierd-act/x/0")
        ('grads', None)
    """
    parts = key.split("/", 3)
    return _KINDS.get(parts[2]) if len(parts) > 3 and parts[0] == ATTACH_ROOT else None


def random_name() -> str:
    return uuid.uuid4().hex[:12]


def activation_prefix() -> str:
    """A fresh prefix for one activation store's chunks."""
    return f"{ACTIVATION_ROOT}/{random_name()}"


@dataclass(frozen=True)
class ModelKeys:
    """The keys of one attached model (see the module docstring)."""

    prefix: str

    @classmethod
    def for_name(cls, name: str | None) -> "ModelKeys":
        return cls(f"{ATTACH_ROOT}/{name or random_name()}")

    def param(self, name: str) -> str:
        return f"{self.prefix}/p/{name}"

    def master(self, name: str) -> str:
        return f"{self.prefix}/master/{name}"

    def grad(self, name: str) -> str:
        return f"{self.prefix}/grad/{name}"

    def state(self, state: str, name: str) -> str:
        return f"{self.prefix}/optim/{state}/{name}"

    def step_count(self, name: str) -> str:
        return self.state("step", name)

    @property
    def training_step(self) -> str:
        return f"{self.prefix}/optim/_step"

    @property
    def all(self) -> str:
        """The prefix every key of the model starts with (for ``keys()``/``delete``)."""
        return self.prefix + "/"
