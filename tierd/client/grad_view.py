"""``p.grad`` of an attached parameter: the gradient in the pool, seen through torch.

[Note: gradients users touch]
tierd sums gradients into the pool, not into ``param.grad`` (the compute
device never holds them all). Training loops still read and change
``p.grad`` between ``backward()`` and ``step()``: ``clip_grad_norm_`` (called
by Hugging Face Trainer, accelerate, Lightning) computes per-tensor norms
and then multiplies every gradient in place; ``model.zero_grad()`` sets
``p.grad = None``. With ``p.grad`` None, clipping returned 0 and clipped
nothing, silently.

So after each outermost backward every parameter whose gradient is in the
pool gets a :class:`PoolGrad` as ``p.grad``: a tensor with no storage whose
ops are answered from the pool:

- ``torch.linalg.vector_norm`` (the per-tensor norm clipping takes) answers
  from the L2 norm kept at each flush (``TieredParam.grad_norm``), which is
  the norm of the bits torch would hold; other orders read the pool.
- An in-place op whose other arguments are numbers or 0-dim tensors (the
  clipping factor, an unscale, ``clamp_``) is *recorded*, not run: the
  optimizer's ``step()`` replays the ops, in order, on the gradient it reads
  from the pool, then writes the result back (torch's ``p.grad`` stays
  clipped too). Replaying the same ops on the same fp32 values is bitwise
  torch's result.
- Any other op reads the gradient (recorded ops applied) and runs on a real
  tensor; other in-place ops raise, naming what is supported.

Removing the view (``p.grad = None``, ``model.zero_grad()``) forgets the
gradient, as in torch. Before autograd accumulates a gradient (a hook on each
parameter) tierd takes the views off and keeps the gradients; after the
backward they are shown again. Ops recorded and not yet replayed when a
forward begins are applied to the pool then. A parameter whose update already ran
inside backward (the fused path) shows a *consumed* view: torch would have a
gradient there, but clipping it now cannot change the update, so every op on
it raises, naming ``max_grad_norm``; except zeroing it in place
(``zero_grad(set_to_none=False)``), which drops it as ``p.grad = None``
does. The fused update cannot wait for a clip it does not know of, so the
first window is always updated in
``step()``: an optimizer that finds ops recorded there updates in ``step()``
from then on (``StreamedOptimizer._stop_fusing``). Under torch.distributed a
rank's pool holds its share's gradients only, so a norm read here raises,
naming ``max_grad_norm`` (whose norm is summed over the node).

Why a view and not the gradient itself: the gradients of the whole model on
the device are what tierd exists to avoid; and ``clip_grad_norm_`` is not
patched (no torch function is), it runs as written on these tensors.
"""

from __future__ import annotations

import torch

from tierd.client.grads import grad_norm
from tierd.client.leases import LeaseTable
from tierd.client.parts import PoolGradients
from tierd.client.tiered_param import TieredParam
from tierd.errors import StateError

_aten = torch.ops.aten

_FUSED_HINT = (
    "the optimizer update of {name!r} already used its gradient (tierd's fused update, "
    "inside backward, or the first step()), and tierd freed it, so it can no longer be "
    "read or changed. To clip, "
    "pass tierd.optim.AdamW(..., max_grad_norm=...) (or SGD), or call clip_grad_norm_ "
    "from the first step on (tierd then keeps the update in step()), or pass fused=False; "
    "to log the gradient norm, max_grad_norm keeps it in opt.last_grad_norm, and "
    "fused=False keeps every p.grad readable until zero_grad()")


class PoolGrad(torch.Tensor):
    """``p.grad`` of an attached parameter (see [Note: gradients users touch]).

    Example:
        >>> model(x).sum().backward()                                        # doctest: +SKIP
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)          # doctest: +SKIP
        >>> type(next(model.parameters()).grad).__name__                     # doctest: +SKIP
        'PoolGrad'
    """

    tp: TieredParam
    ops: list
    consumed: bool

    @staticmethod
    def __new__(cls, tp: TieredParam, *, consumed: bool = False) -> PoolGrad:
        p = tp.param
        view = torch.Tensor._make_wrapper_subclass(cls, p.shape, dtype=p.dtype, device=p.device)
        view.tp = tp
        view.ops = []        # (op, other args, kwargs) to replay at step()
        view.consumed = consumed
        view.zeroed = False  # consumed, then zeroed in place: dropped at the next sync
        return view

    def __repr__(self) -> str:
        state = "consumed by the fused update" if self.consumed else f"{len(self.ops)} ops"
        return f"PoolGrad({self.tp.name!r}, shape={tuple(self.shape)}, {state})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        views = [a for a in args if isinstance(a, PoolGrad)]
        views += [t for a in args if isinstance(a, (list, tuple))
                  for t in a if isinstance(t, PoolGrad)]
        if func in (_aten.zero_.default, _aten._foreach_zero_.default) \
                and any(v.consumed for v in views):
            return _zero_consumed(func, args)
        for view in views:
            if view.consumed:
                raise StateError(_FUSED_HINT.format(name=view.tp.name))
        if func in (_aten.detach.default, _aten.detach_.default, _aten.alias.default):
            return args[0]
        if func is _aten.linalg_vector_norm.default and isinstance(args[0], PoolGrad):
            return args[0].norm_from_pool(*args[1:], **kwargs)
        if func is _aten._foreach_norm.Scalar:   # (tensors, ord=2, dtype=None)
            ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2.0)
            dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
            return [v.norm_from_pool(ord_, dtype=dtype) for v in args[0]]
        first = args[0] if args else None
        if func._schema.is_mutable and (isinstance(first, PoolGrad) or (
                isinstance(first, (list, tuple)) and any(isinstance(t, PoolGrad) for t in first))):
            return _record(func, args, kwargs)
        return func(*[_real(a) for a in args], **{k: _real(v) for k, v in kwargs.items()})

    def norm_from_pool(self, ord: float = 2.0, dim=None, keepdim: bool = False, *,
                       dtype=None) -> torch.Tensor:
        """``torch.linalg.vector_norm`` of the gradient, from the kept norm if it can be."""
        if self.tp.session.share is not None:
            raise StateError(
                f"the norm of {self.tp.name!r}'s gradient: under torch.distributed each rank "
                "holds the gradients of its share only, so a norm summed here would not be "
                "the global one; clip with tierd.optim.AdamW(..., max_grad_norm=...) (or SGD)")
        norm = self.tp.grad_norm
        if norm is not None and float(ord) == 2.0 and dim is None and dtype is None \
                and not self.ops:
            return norm.to(self.device)
        return torch.linalg.vector_norm(self.value(), ord, dim, keepdim, dtype=dtype)

    def value(self) -> torch.Tensor:
        """The gradient as a real tensor (a read from the pool, recorded ops applied)."""
        tp = self.tp
        grad = tp.session.read([tp.grad_key])[tp.grad_key]
        with torch.no_grad():
            replay(self.ops, grad)
        return grad.to(device=self.device, dtype=self.dtype)


def _real(arg):
    if isinstance(arg, PoolGrad):
        return arg.value()
    if isinstance(arg, (list, tuple)):
        return type(arg)(_real(a) for a in arg)
    return arg


def _zero_consumed(func, args):
    """``zero_grad(set_to_none=False)`` zeroes ``p.grad`` in place: a view
    whose gradient the update used has nothing left to zero, so it is only
    marked and then dropped at the next sync, as ``p.grad = None`` is (torch
    would show zeros; the next backward adds to nothing either way). Other
    tensors of a ``_foreach_zero_`` are zeroed (views: recorded) as before."""
    targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    for t in targets:
        if isinstance(t, PoolGrad) and t.consumed:
            t.zeroed = True
        elif isinstance(t, PoolGrad):
            _record(_aten.zero_.default, (t,), {})
        else:
            t.zero_()
    return args[0] if func is _aten.zero_.default else None


def _record(func, args, kwargs):
    """An in-place op on views: kept to replay at ``step()``; see the Note."""
    name = func.overloadpacket.__name__
    targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    if name.startswith("_foreach_"):
        single = getattr(_aten, name[len("_foreach_"):])   # _foreach_mul_ -> mul_
        per = [[a[i] if isinstance(a, (list, tuple)) else a for a in args[1:]]
               for i in range(len(targets))]
    else:
        single, per = func.overloadpacket, [list(args[1:])]
    for view, rest in zip(targets, per):
        if not isinstance(view, PoolGrad) or not all(_scalar_like(a) for a in rest) \
                or not all(_scalar_like(v) for v in kwargs.values()):
            what = f"of {view.tp.name!r}" if isinstance(view, PoolGrad) else "of a tensor"
            raise StateError(
                f"{func} changes the gradient {what} in place with tensor arguments; tierd "
                "keeps the gradients of an attached model in its pool and replays only "
                "in-place ops by numbers or 0-dim tensors (clip_grad_norm_, unscaling, "
                "clamp_). Read gradients with tierd.session_of(model).gradients() instead")
        view.ops.append((single, rest, dict(kwargs)))
    return args[0] if func._schema.returns else None   # _foreach_*_ return nothing


def _scalar_like(arg) -> bool:
    return not isinstance(arg, torch.Tensor) or (arg.dim() == 0 and not isinstance(arg, PoolGrad))


def replay(ops: list, grad: torch.Tensor) -> None:
    """Apply recorded in-place ops to ``grad`` (an fp32 gradient) in order."""
    for op, rest, kwargs in ops:
        rest = [a.to(grad.device) if isinstance(a, torch.Tensor) else a for a in rest]
        op(grad, *rest, **kwargs)


class GradViews:
    """Which parameters of one session show a :class:`PoolGrad` (see the Note).

    ``pool`` settles copies before the pool's gradients change in place
    through ``leases``.

    Example:
        >>> views = GradViews(session, session.leases)   # doctest: +SKIP
        >>> views.show(pooled, consumed)                 # doctest: +SKIP
        >>> views.hide()                       # before the next forward  # doctest: +SKIP
    """

    def __init__(self, pool: PoolGradients, leases: LeaseTable) -> None:
        self._pool = pool
        self._leases = leases
        self._shown: dict[TieredParam, PoolGrad] = {}
        # hidden by tierd for a forward or backward; the gradient stays
        # (value: True when it was consumed by a fused update)
        self._kept: dict[TieredParam, bool] = {}

    def show(self, pooled, consumed=()) -> None:
        """After an outermost backward: a view on every parameter with a gradient,
        in the pool or consumed by a fused update (this backward or before)."""
        self.hide()
        consumed = set(consumed) | {tp for tp, c in self._kept.items() if c}
        for tp in dict.fromkeys([*pooled, *self._kept, *consumed]):
            if tp.has_gradient or tp in consumed:
                view = PoolGrad(tp, consumed=not tp.has_gradient)
                view.holder = tp.between_uses   # the tensor the model shows now
                view.holder.grad = view
                self._shown[tp] = view
        self._kept.clear()

    def hide(self) -> None:
        """Before autograd accumulates (a hook on every parameter, and the
        backward's start): take the views off, keeping the gradients of those
        still there and forgetting those the user removed."""
        if not self._shown:
            return
        self.sync()
        for tp, view in self._shown.items():
            if view.ops:
                raise StateError(
                    f"the gradient of {tp.name!r} was changed in place, then a backward "
                    "began with no forward in between; tierd applies such changes at "
                    "step() or at the next forward: call opt.step() first")
            view.holder.grad = None
            self._kept[tp] = view.consumed
        self._shown.clear()

    def apply_ops(self) -> None:
        """A forward begins: in-place changes recorded since the backward go
        into the pool now, so the next backward adds to the changed gradient
        (as in torch, which would add to the clipped ``p.grad``)."""
        changed = [tp for tp, view in self._shown.items() if view.ops]
        if changed:
            self._apply_now(changed)

    def sync(self) -> None:
        """Forget the gradients whose view the user removed (``p.grad = None``)."""
        for tp, view in list(self._shown.items()):
            if view.zeroed and view.holder.grad is view:
                view.holder.grad = None   # [Note: gradients users touch]: consumed, zeroed
            if view.holder.grad is not view:
                tp.to_no_gradient()
                del self._shown[tp]

    def consume(self, tps) -> None:
        """The update used these gradients and they are gone: their views
        raise from now on, naming why ([Note: gradients freed as they are used]
        in ``tierd.optim.base``)."""
        for tp in tps:
            view = self._shown.get(tp)
            if view is not None:
                view.consumed = True

    def drop(self, tps) -> None:
        """``zero_grad``: no view, no gradient kept."""
        for tp in tps:
            view = self._shown.pop(tp, None)
            if view is not None and view.holder.grad is view:
                view.holder.grad = None
            self._kept.pop(tp, None)

    def has_gradient(self, tps) -> bool:
        """Some of ``tps`` still have a gradient torch would hold (shown or kept)."""
        self.sync()
        return any(tp in self._shown or tp in self._kept for tp in tps)

    def ops(self, tp: TieredParam) -> list:
        """The in-place ops recorded on ``tp``'s view since it was shown."""
        view = self._shown.get(tp)
        return [] if view is None else view.ops

    def applied(self, tp: TieredParam, grad: torch.Tensor) -> None:
        """``step()`` replayed ``tp``'s ops into the pool: they are done, and
        the kept norm is that of ``grad`` (the changed gradient)."""
        view = self._shown.get(tp)
        if view is not None:
            view.ops = []
        tp.to_gradient_in_pool(grad_norm(grad))

    def any_ops(self) -> bool:
        return any(view.ops for view in self._shown.values())

    def _apply_now(self, tps: list[TieredParam]) -> None:
        self._pool.settle(write_resident=False)   # gradients only
        self._pool.grads.spill(tps)   # changed in the pool from here
        keys = [tp.grad_key for tp in tps]
        self._leases.acquire(keys)
        try:
            views = self._leases.views(keys)
            with torch.no_grad():
                for tp in tps:
                    replay(self._shown[tp].ops, views[tp.grad_key])
                    self.applied(tp, views[tp.grad_key])
        finally:
            self._leases.release(keys, written=True)
