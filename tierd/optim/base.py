"""What every tierd optimizer shares: blocks, leases, clipping, placement.

The fp32 master weights (the ``p`` key itself when the compute dtype is fp32),
the optimizer's moments and the accumulated gradients all live in tierd. A
step walks the parameters block by block (about ``block_bytes`` each): one
write lease for the block's keys, the update on the compute device
("gpu-stream") or in place in the pool ("cpu"), then one release. Subclasses
only write the per-parameter math (:meth:`StreamedOptimizer._update`), copied
from torch's single-tensor implementation so fp32 results are bitwise equal.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tierd.client.tiered_param import TieredParam, TieredParameter


class StreamedOptimizer(torch.optim.Optimizer):
    """Base class of ``tierd.optim.AdamW`` and ``tierd.optim.SGD``.

    ``max_grad_norm`` clips by the global L2 norm of all gradients exactly as
    ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)`` followed by
    ``step()`` would; the norm before clipping is kept in ``last_grad_norm``.
    ``placement`` overrides the attach config's ``optimizer_placement``.
    """

    #: names of the per-parameter state tensors this optimizer keeps in tierd
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params, defaults: dict[str, Any], *, max_grad_norm: float | None = None,
                 block_bytes: int = 64 << 20, placement: str | None = None) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, TieredParameter):
                    raise TypeError(
                        f"tierd.optim needs the parameters of an attached model; got a "
                        f"{type(p).__name__} of shape {tuple(p.shape)}. Call "
                        "tierd.attach(model) first and pass model.parameters() after it")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (or None: no clipping)")
        if placement not in (None, "gpu-stream", "cpu"):
            raise ValueError(f"placement={placement!r}; use 'gpu-stream', 'cpu' or None")
        self.max_grad_norm = max_grad_norm
        self.block_bytes = block_bytes
        self.placement = placement
        self.last_grad_norm: torch.Tensor | None = None

    # ------------------------------------------------------------- API
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients of this optimizer's parameters."""
        for session, tps in self._by_session(self._all()).items():
            session.zero_grad(tps)

    @torch.no_grad()
    def step(self, closure=None):
        """Update every parameter that has a gradient, block by block."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for session in self._by_session(self._all()):
            session.settle()
        coef = self._clip_coef()
        for group in self.param_groups:
            tps = [p.tiered for p in group["params"] if p.tiered.grad_in_pool]
            for block in self._blocks(tps):
                self._step_block(group, block, coef)
        return loss

    # ------------------------------------------------------------- helpers
    def _all(self) -> list[TieredParam]:
        return [p.tiered for g in self.param_groups for p in g["params"]]

    @staticmethod
    def _by_session(tps: list[TieredParam]) -> dict[Any, list[TieredParam]]:
        out: dict[Any, list[TieredParam]] = {}
        for tp in tps:
            out.setdefault(tp.session, []).append(tp)
        return out

    def _clip_coef(self) -> torch.Tensor | None:
        """The factor torch.nn.utils.clip_grad_norm_ would multiply every grad by."""
        if self.max_grad_norm is None:
            self.last_grad_norm = None
            return None
        norms = [tp.grad_norm for tp in self._all() if tp.grad_in_pool]
        if not norms:
            return None
        first = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        self.last_grad_norm = total
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    def _blocks(self, tps: list[TieredParam]) -> list[list[TieredParam]]:
        """Consecutive parameters whose leased bytes (master, grad, states, and
        the compute-dtype copy) stay under ``block_bytes`` and the session's cap."""
        blocks: list[list[TieredParam]] = []
        for session, session_tps in self._by_session(tps).items():
            limit = min(self.block_bytes, session.lease_cap)
            block: list[TieredParam] = []
            size = 0
            for tp in session_tps:
                leased = tp.param.numel() * 4 * (2 + len(self.state_names)) + tp.nbytes
                if block and size + leased > limit:
                    blocks.append(block)
                    block, size = [], 0
                block.append(tp)
                size += leased
            if block:
                blocks.append(block)
        return blocks

    def _state_key(self, tp: TieredParam, name: str) -> str:
        return f"{tp.session.prefix}/optim/{name}/{tp.name}"

    def _compute_device(self, tp: TieredParam) -> torch.device:
        placement = self.placement or tp.session.config.optimizer_placement
        device = tp.session.device
        return device if placement == "gpu-stream" else torch.device("cpu")

    def _step_block(self, group: dict, block: list[TieredParam],
                    coef: torch.Tensor | None) -> None:
        client = block[0].session.client
        fresh = {self._state_key(tp, n): torch.zeros(tp.param.shape, dtype=torch.float32)
                 for tp in block if not self.state[tp.param] for n in self.state_names}
        for tp in block:
            self.state[tp.param].setdefault("step", 0.0)
        if fresh:
            client.put_many(fresh)
        write = [k for tp in block for k in self._write_keys(tp, coef is not None)]
        read = [tp.grad_key for tp in block] if coef is None else []
        views = {lease.key: lease.tensor for lease in client.lease(write, write=True)}
        if read:
            views.update({lease.key: lease.tensor for lease in client.lease(read)})
        on_device = False
        for tp in block:
            on_device |= self._step_param(group, tp, views, coef)
        if on_device:
            # [Note: release after the event] in tierd.client.releases: the
            # copies back into the pool must land before the leases go.
            torch.cuda.current_stream(block[0].session.device).synchronize()
        client.release(write, written=True)
        if read:
            client.release(read)

    def _write_keys(self, tp: TieredParam, clip: bool) -> list[str]:
        keys = [tp.master_key] + [self._state_key(tp, n) for n in self.state_names]
        if tp.has_master:
            keys.append(tp.key)
        if clip:
            keys.append(tp.grad_key)
        return keys

    def _step_param(self, group: dict, tp: TieredParam, views: dict[str, torch.Tensor],
                    coef: torch.Tensor | None) -> bool:
        device = self._compute_device(tp)
        on_device = device.type != "cpu"
        names = {"param": tp.master_key, "grad": tp.grad_key,
                 **{n: self._state_key(tp, n) for n in self.state_names}}
        work = {n: (views[k].to(device, non_blocking=True) if on_device else views[k])
                for n, k in names.items()}
        if coef is not None:
            work["grad"].mul_(coef.to(work["grad"].device))
        state = self.state[tp.param]
        state["step"] += 1.0
        self._update(group, state, work["param"], work["grad"],
                     {n: work[n] for n in self.state_names})
        if on_device:
            written = ["param", *self.state_names] + (["grad"] if coef is not None else [])
            for n in written:
                views[names[n]].copy_(work[n], non_blocking=True)
        if tp.has_master:
            views[tp.key].copy_(work["param"].to(views[tp.key].dtype), non_blocking=on_device)
        if tp.resident:
            tp.session.refresh_resident(tp, work["param"])
        return on_device

    def _update(self, group: dict, state: dict, param: torch.Tensor, grad: torch.Tensor,
                moments: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError
