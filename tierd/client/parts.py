"""What the parts of an attached model are given: each takes only the
collaborators it uses, declared here (a leaf module: it imports no part),
as FSDP2's parameter groups take ``mesh_info`` and ``comm_ctx`` instead of
the state that holds everything.

Example:
    >>> from tierd.client.parts import StepEvents
    >>> hasattr(StepEvents, "begin_step")
    True
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class StepEvents(Protocol):
    """What a model's hooks report (``tierd.client.hooks``); the attached
    session (``AttachSession``) answers each with one call into its parts."""

    def begin_step(self, signature: tuple = ()) -> None:
        """The root forward begins (the shapes of its inputs)."""

    def pre_forward(self, unit: Any) -> None:
        """A forward of ``unit`` begins: its parameters must be on the device."""

    def post_forward(self, unit: Any) -> None:
        """A forward of ``unit`` ended."""

    def forward_waits(self) -> set[int]:
        """Units (indices) whose forward may have to wait for an optimizer
        update first: they need a pre-forward hook even when kept whole."""

    def waits_for_update(self, unit: Any) -> bool:
        """An optimizer update of ``unit`` waits for its forward, beginning now."""

    def update_before_forward(self, unit: Any) -> None:
        """Run (or wait for) the updates :meth:`waits_for_update` found."""

    def pre_backward(self, unit: Any) -> None:
        """The first gradient of ``unit``'s outputs arrived."""

    def post_backward(self, unit: Any) -> None:
        """The gradients of ``unit``'s inputs are computed: its backward is done."""

    def gradient_arrives(self) -> None:
        """Autograd is about to accumulate a parameter's gradient."""

    def fill_state_dict(self, module: nn.Module, state_dict: dict, prefix: str) -> None:
        """``module.state_dict()`` collected its entries: give them values."""

    def write_values(self, values: dict) -> None:
        """Make ``values`` (by TieredParam) the parameters' values."""


class PoolGradients(Protocol):
    """What the gradient views (``tierd.client.grad_view``) need of the
    session: settled copies, and the pool's gradients through leases."""

    #: its ``GradBucket``: gradients held on the device are written to the
    #: pool (``spill``) before the pool's are changed in place
    grads: Any

    def settle(self, *, synchronize: bool = True, write_resident: bool = True) -> None:
        """Every copy landed and every lease released."""

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """New CPU tensors with the stored bytes of ``keys``."""
