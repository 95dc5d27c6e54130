"""AdamW with its master weights and moments kept in tierd: exact fp32 by
default, or compact ([Note: compact optimizer state] in tierd.optim.compact)."""

from __future__ import annotations

import torch

from tierd.client.torch_internals import foreach_adamw, fused_adamw
from tierd.optim.base import StreamedOptimizer
from tierd.optim import compact_compiled
from tierd.optim.compact import Codebook, CompactState, adamw_step


class AdamW(StreamedOptimizer):
    """``torch.optim.AdamW`` for attached models; same arguments, same results.

    On the CPU the update is torch's single-tensor AdamW line for line, so
    fp32 results are bitwise equal to ``torch.optim.AdamW(..., foreach=False)``;
    on CUDA it is torch's fused kernel, bitwise ``AdamW(..., fused=True)``.

    Example:
        >>> model = tierd.attach(model)                                         # doctest: +SKIP
        >>> opt = tierd.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
        ...                         max_grad_norm=1.0)                          # doctest: +SKIP
        >>> model(x).loss.backward(); opt.step(); opt.zero_grad()               # doctest: +SKIP

    ``state`` and ``master`` choose compact state, never the default
    ([Note: compact optimizer state] in tierd.optim.compact): ``state="bf16"``
    (bf16 moments) or ``"8bit"`` (block-quantized 8-bit moments, torchao's
    ``AdamW8bit``), ``master="bf16"`` (bf16 parameters are their own master,
    updated with stochastic rounding). Those settings follow torchao's AdamW
    math, not torch's: close to exact AdamW, not bitwise.

        >>> opt = tierd.optim.AdamW(model.parameters(), lr=1e-4, state="8bit",
        ...                         master="bf16")                           # doctest: +SKIP
    """

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 max_grad_norm: float | None = None, block_bytes: int = 64 << 20,
                 placement: str | None = None, fused: bool | None = None,
                 accumulation_steps: int | None = None, prefetch_bytes: int | None = None,
                 state: str = "fp32", master: str = "fp32") -> None:
        # an instance attribute before the base class sizes and makes the state
        self.compact = CompactState(state=state, master=master)
        #: the 8-bit quantization maps by device, then signedness (made once:
        #: a new device tensor per update would copy, and on CUDA wait)
        self._books: dict[torch.device, dict[bool, Codebook]] = {}
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        if eps < 0:
            raise ValueError(f"eps={eps} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas} must each be in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        maximize=maximize)
        super().__init__(params, defaults, max_grad_norm=max_grad_norm,
                         block_bytes=block_bytes, placement=placement, fused=fused,
                         accumulation_steps=accumulation_steps,
                         prefetch_bytes=prefetch_bytes)

    def _update(self, group: dict, state: dict, param: torch.Tensor, grad: torch.Tensor,
                moments: dict[str, torch.Tensor]) -> None:
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
        step = state["step"]
        if not self.compact.exact:
            self._compact_update(group, step, [param], [grad], [exp_avg], [exp_avg_sq])
            return
        if param.is_cuda:   # the kernel update_params uses there: both paths agree bitwise
            fused_adamw([param], [grad], [exp_avg], [exp_avg_sq], step=step, lr=lr,
                        beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        maximize=group["maximize"])
            return
        if group["maximize"]:
            grad = -grad
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)

    def update_params(self, group: dict, tps, params: list[torch.Tensor],
                      grads: list[torch.Tensor], moments: dict[str, list[torch.Tensor]]) -> None:
        """:meth:`_update` for parameters with one step count. On the CPU as
        foreach kernels: the same ops in the same order (torch runs them per
        tensor, so results stay bitwise those of the single-tensor path). On
        CUDA as torch's fused AdamW kernel, one pass over each tensor instead
        of nine (the optimizer was most of what a step with every unit
        resident added over the all-GPU step): bitwise
        ``torch.optim.AdamW(fused=True)``, within float rounding of the rest."""
        step = None
        for tp in tps:
            state = self.state[tp.outside]
            state["step"] = state.get("step", 0.0) + 1.0
            step = state["step"]
        lr, (beta1, beta2) = group["lr"], group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        exp_avgs, exp_avg_sqs = moments["exp_avg"], moments["exp_avg_sq"]
        if not self.compact.exact:
            self._compact_update(group, step, params, grads, exp_avgs, exp_avg_sqs)
            return
        if params and params[0].is_cuda:
            fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=eps,
                        maximize=group["maximize"])
            return
        foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=beta1,
                      beta2=beta2, weight_decay=weight_decay, eps=eps,
                      maximize=group["maximize"])

    def _compact_update(self, group: dict, step: float, params, grads, exp_avgs,
                        exp_avg_sqs) -> None:
        """Compact state's update, all tensors at once (:func:`tierd.optim.compact.adamw_step`)."""
        if not params:
            return
        lr, (beta1, beta2) = group["lr"], group["betas"]
        adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), step=step,
                   lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=group["maximize"],
                   books=self._books.setdefault(params[0].device, {}),
                   compiled=(compact_compiled.adamw_pieces
                             if compact_compiled.usable(params[0].device) else None))
