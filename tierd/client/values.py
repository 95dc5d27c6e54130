"""Ops on an attached parameter between uses: reads from the tiers, writes into them.

A :class:`~tierd.client.tiered_param.TieredParameter` (what a module holds
between uses, [Note: the two tensors of a parameter]) sends every aten op
here. The op runs on real tensors holding the parameters' current values
(:meth:`AttachSession.current_values`: the device copy of a resident one,
else the value in the tiers), so a read gives exactly what the detached
model would hold. An op that writes one of its parameter arguments (in place
or ``out=``) writes the result back (:meth:`AttachSession.write_values`:
the stored compute copy, the fp32 master, the device copies), so
``p.data.copy_(v)``, ``model.load_state_dict(sd)`` and ``p.mul_(0.5)`` change
the parameter as they would in torch.

Example:
    >>> model = tierd.attach(model)                              # doctest: +SKIP
    >>> norms = [p.norm() for p in model.parameters()]           # doctest: +SKIP
    >>> torch._foreach_lerp_(ema, list(model.parameters()), 0.01)  # one read  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from tierd.client.torch_internals import tree_flatten, tree_map
from tierd.errors import StateError

_aten = torch.ops.aten


def refuse_data_assignment(name: str) -> StateError:
    return StateError(
        f"assigning .data of {name!r} while it is attached: its values live "
        "in tierd and the assignment would be lost. Set values before tierd.attach (or "
        "with attach(model, weights=PATH)), copy them in with p.data.copy_(value) or "
        "model.load_state_dict(...), or tierd.detach(model) first")


def assigns_itself(tp: "TieredParam", value: torch.Tensor) -> bool:
    """``p.data = value`` changes nothing: ``value`` is a tensor of the same
    parameter, whose in-place op has already written into tierd
    (``module.to()`` where nothing moves; peft's ``merge_and_unload``:
    ``weight.data += delta``, which assigns ``weight.data`` back)."""
    return isinstance(value, TieredParameter) and value.tiered is tp


#: Tensor methods that hand the bytes to something torch does not dispatch
#: (numpy, Python lists): they get the value read from the tiers.
_READ_OUT = frozenset({torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.__array__,
                       torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__})

#: ``p.requires_grad = flag`` and ``p.requires_grad_(flag)``
_SETS_REQUIRES_GRAD = frozenset({torch.Tensor.requires_grad.__set__, torch.Tensor.requires_grad_})


class TieredParameter(torch.Tensor):
    """A parameter of an attached model between uses (``isinstance(p,
    nn.Parameter)`` holds): a tensor with no storage of its own whose every
    op reads the true value from tierd's tiers, and whose in-place ops write
    the new value into them ([Note: the two tensors of a parameter]).

    ``detach()`` and ``.data`` give another view of the same parameter (not
    a parameter), so ``p.data.copy_(v)`` writes too.

    Example:
        >>> import torch, tierd
        >>> model = tierd.attach(torch.nn.Linear(4, 4))   # doctest: +SKIP
        >>> model.weight.sum()                            # read from the tiers  # doctest: +SKIP
        >>> ema.lerp_(model.weight, 0.01)                 # doctest: +SKIP
        >>> model.weight.data.mul_(0.5)                   # written into the tiers  # doctest: +SKIP
    """

    tiered: "TieredParam"   # tierd.client.tiered_param (which imports this module)

    @staticmethod
    def __new__(cls, tp: "TieredParam", *, parameter: bool) -> "TieredParameter":
        like = tp.param
        view = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device,
            requires_grad=parameter and like.requires_grad)
        view.tiered = tp
        if parameter:
            view._is_param = True   # what nn.Parameter(subclass) sets: isinstance works
        return view

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"TieredParameter({self.tiered.name!r}, in tierd between uses):\n"
                f"{read_now([self])[0]!r}")

    @property
    def data(self) -> torch.Tensor:
        return TieredParameter(self.tiered, parameter=False)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not assigns_itself(self.tiered, value):
            raise refuse_data_assignment(self.tiered.name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SETS_REQUIRES_GRAD and getattr(args[0], "_is_param", False):
            # freezing or unfreezing the parameter: both its tensors
            args[0].tiered.set_requires_grad(args[1] if len(args) > 1
                                             else kwargs.get("requires_grad", True))
            return args[0] if func is torch.Tensor.requires_grad_ else None
        if func in _READ_OUT:
            return func(read_now([args[0]])[0], *args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (_aten.detach.default, _aten.alias.default):
            return TieredParameter(args[0].tiered, parameter=False)
        return run_op(func, args, kwargs or {})




def read_now(views: list[TieredParameter], *, to_write: bool = False) -> list[torch.Tensor]:
    """The current values of ``views``, one real tensor each (the same tensor
    for two views of one parameter). With ``to_write`` each is a tensor of
    its own that nothing else holds, which an op may change."""
    by_session: dict[int, tuple] = {}
    for v in views:
        session = v.tiered.session
        by_session.setdefault(id(session), (session, []))[1].append(v.tiered)
    got = {}
    for session, tps in by_session.values():
        got.update(session.current_values(list(dict.fromkeys(tps)), to_write=to_write))
    return [got[v.tiered] for v in views]


def run_op(func, args: tuple, kwargs: dict):
    """Run aten op ``func`` with every TieredParameter replaced by its value;
    write back the values of those the op writes; see the module docstring."""
    if func is _aten.copy_.default and not isinstance(args[1], TieredParameter):
        # the source as it is: an fp32 value sets the fp32 master exactly
        # (load_state_dict into a bf16-compute model), not its bf16 rounding
        target = args[0]
        target.tiered.session.write_values({target.tiered: args[1].expand(target.shape)})
        return target
    views = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, TieredParameter)]
    written = _written(func, args, kwargs)
    values = dict(zip((v.tiered for v in views), read_now(views, to_write=bool(written))))
    real = tree_map(lambda a: values[a.tiered] if isinstance(a, TieredParameter) else a,
                    (args, kwargs))
    out = func(*real[0], **real[1])
    if not written:
        return out
    for view in written:
        view.tiered.session.write_values({view.tiered: values[view.tiered]})
    # an in-place op returns its first argument: the view, not the value read
    by_value = {id(values[v.tiered]): v for v in written}
    return tree_map(lambda o: by_value.get(id(o), o) if isinstance(o, torch.Tensor) else o, out)


def _written(func, args: tuple, kwargs: dict) -> list[TieredParameter]:
    """The TieredParameter arguments ``func`` writes (its schema's mutable ones)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in tree_flatten(value)[0]:
            if isinstance(t, TieredParameter):
                out.append(t)
    return list({id(v.tiered): v for v in out}.values())
