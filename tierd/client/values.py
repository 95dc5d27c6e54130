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

from tierd.client.tiered_param import TieredParameter
from tierd.client.torch_internals import tree_flatten, tree_map


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
