"""The hooks that drive a Session: registered once per attach, handles kept.

Each hook body is one call into :class:`tierd.client.attached.Session`; the
reasoning about *when* parameters move is in the Note there. No torch
function is patched; only public ``nn.Module`` / autograd hook APIs are used.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tierd.client.attached import Session, Unit


class ModuleHooks:
    """Owns every hook handle of one attached model; :meth:`remove` undoes them all.

    Example:
        >>> hooks = ModuleHooks(session)   # doctest: +SKIP
        >>> hooks.remove()                 # doctest: +SKIP
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self._handles: list[Any] = []
        model = session.model
        self._handles.append(model.register_forward_pre_hook(self._begin_step))
        for module in model.modules():
            unit = session.unit_of.get(id(module))
            if unit is None:
                continue
            self._handles.append(module.register_forward_pre_hook(
                self._pre_forward_of(unit)))
            self._handles.append(module.register_forward_hook(
                self._post_forward_of(unit), always_call=True))
        for module in model.modules():
            if any(p is not None for p in module._parameters.values()):
                self._handles.append(module.register_state_dict_post_hook(
                    self._state_dict_hook()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # The root's pre-hook is registered first, so it runs before the root
    # unit's own pre-hook (if the root owns parameters).
    # Every hook adds its host time to session.counters.hook_seconds (the
    # benchmark reports it as the overhead share of a step).
    def _begin_step(self, module: nn.Module, args: Any) -> None:
        t0 = time.perf_counter()
        self._session.begin_step()
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _pre_forward_of(self, unit: Unit):
        def hook(module: nn.Module, args: Any) -> None:
            t0 = time.perf_counter()
            self._session.pre_forward(unit)
            self._session.counters.hook_seconds += time.perf_counter() - t0
        return hook

    def _post_forward_of(self, unit: Unit):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            t0 = time.perf_counter()
            self._session.post_forward(unit)
            self._register_pre_backward(unit, output)
            self._session.counters.hook_seconds += time.perf_counter() - t0
        return hook

    def _pre_backward_of(self, unit: Unit):
        def hook(grad: Any) -> None:
            t0 = time.perf_counter()
            self._session.pre_backward(unit)
            self._session.counters.hook_seconds += time.perf_counter() - t0
        return hook

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # fires once per backward, when the first output gradient arrives,
            # i.e. before any backward node inside the unit runs
            torch.autograd.graph.register_multi_grad_hook(
                tensors, self._pre_backward_of(unit), mode="any")

    def _state_dict_hook(self):
        # a fresh function per module: torch tags the hook object it is given
        def hook(module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: dict) -> None:
            self._session.fill_state_dict(module, state_dict, prefix)
        return hook
