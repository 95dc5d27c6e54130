"""SGD (momentum, dampening, Nesterov, weight decay) with state kept in tierd."""

from __future__ import annotations

import torch

from tierd.optim.base import StreamedOptimizer


class SGD(StreamedOptimizer):
    """``torch.optim.SGD`` for attached models; same arguments, same results.

    Example:
        >>> opt = tierd.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # doctest: +SKIP
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 max_grad_norm: float | None = None, block_bytes: int = 64 << 20,
                 placement: str | None = None, fused: bool | None = None,
                 accumulation_steps: int | None = None, prefetch_bytes: int | None = None) -> None:
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        if momentum < 0 or weight_decay < 0:
            raise ValueError(f"momentum={momentum} and weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")
        # a per-instance copy: the base class reads state_names from self
        self.state_names = ("momentum_buffer",) if momentum != 0 else ()
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         block_bytes=block_bytes, placement=placement, fused=fused,
                         accumulation_steps=accumulation_steps,
                         prefetch_bytes=prefetch_bytes)

    def loaded_step(self, entry: dict, name: str) -> float:
        """torch's SGD keeps no step count: a loaded momentum buffer has
        been started (its next update is not the first)."""
        return float(entry.get("step", 1.0))

    def _update(self, group: dict, state: dict, param: torch.Tensor, grad: torch.Tensor,
                moments: dict[str, torch.Tensor]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        if group["maximize"]:
            grad = -grad
        if group["weight_decay"] != 0:
            grad = grad.add(param, alpha=group["weight_decay"])
        if momentum != 0:
            buf = moments["momentum_buffer"]
            if state["step"] == 1.0:     # torch starts the buffer as a copy of grad
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
        param.add_(grad, alpha=-lr)
