"""Moving a model's parameters into the daemon at attach, and back at detach."""

from __future__ import annotations

from torch import nn

import torch

from tierd.client.attached import Session, Unit
from tierd.client.planner import PrefetchPlanner
from tierd.client.tiered_param import ParamState, TieredParam, TieredParameter


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(param) -> every (module, attribute, qualified name) holding it, tied included."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            qual = f"{mod_name}.{attr}" if mod_name else attr
            owners.setdefault(id(param), []).append((module, attr, qual))
    return owners


def take_parameters(session: Session) -> None:
    """Replace every parameter with an empty :class:`TieredParameter` whose bytes
    are in the daemon; build the units. Uploads one batch per module."""
    cfg, model = session.config, session.model
    owners = _owners(model)
    by_id: dict[int, TieredParam] = {}
    resumed: list[TieredParam] = []   # resident ones whose value is in the store
    for module in dict.fromkeys(m for m in model.modules()):
        uploads: dict[str, torch.Tensor] = {}
        for attr, param in list(module._parameters.items()):
            if param is None or isinstance(param, TieredParameter):
                continue   # replaced already through a tied holder
            holders = owners[id(param)]
            tp = _make(session, param, holders[0][2], uploads)
            if tp.resident and tp.key in session.resumed_keys:
                resumed.append(tp)
            by_id[id(param)] = tp
            for holder, hattr, qual in holders:
                holder._parameters[hattr] = tp.param
                session.aliases[qual] = tp
            session.params[tp.name] = tp
            # the caller's old Parameter object keeps no bytes alive
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if uploads:
            session.client.put_many(uploads)
    if resumed:
        stored = session.client.get_many([tp.key for tp in resumed])
        with torch.no_grad():
            for tp in resumed:
                tp.param.data.copy_(stored[tp.key])
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                session.buffer_devices[(id(module), name)] = buf.device
                module._buffers[name] = buf.to(session.device)
    _build_units(session, model, by_id)


def _make(session: Session, param: nn.Parameter, name: str,
          uploads: dict[str, torch.Tensor]) -> TieredParam:
    cfg = session.config
    value = param.detach()
    dtype = cfg.compute_dtype if value.is_floating_point() else value.dtype
    resident = value.numel() * value.element_size() < cfg.resident_below_bytes
    data = torch.empty(value.shape, dtype=dtype, device=session.device)
    new = TieredParameter(data, requires_grad=param.requires_grad)
    tp = TieredParam(name=name, prefix=session.prefix, param=new, orig_dtype=value.dtype,
                     orig_device=value.device, resident=resident, session=session)
    cpu = value.to("cpu")
    stored = session.resumed_keys   # resuming: the committed value wins
    if tp.key not in stored:
        uploads[tp.key] = cpu.to(dtype)
    if tp.has_master and tp.master_key not in stored:
        uploads[tp.master_key] = cpu.to(torch.float32)
    if new.requires_grad:
        new.register_post_accumulate_grad_hook(session.on_grad_of)
    if resident:
        with torch.no_grad():
            new.data.copy_(cpu.to(dtype))
    else:
        new.untyped_storage().resize_(0)
    return tp


def _build_units(session: Session, model: nn.Module, by_id: dict[int, TieredParam]) -> None:
    for mod_name, module in model.named_modules():
        tps = tuple(dict.fromkeys(p.tiered for p in module._parameters.values()
                                  if p is not None and not p.tiered.resident))
        if not tps:
            continue
        unit = Unit(index=len(session.units), name=mod_name or "<root>", params=tps,
                    nbytes=sum(tp.nbytes for tp in tps))
        session.units.append(unit)
        session.unit_of[id(module)] = unit


def fold_into(session: Session, module: nn.Module, name: str,
              tps: list[TieredParam]) -> Unit:
    """Make ``tps`` part of ``module``'s unit (a new unit if it has none) and
    return that unit; see [Note: parameters read without a call] in hooks.py.
    The unit keeps its index, so the planner's trace stays valid; its byte
    count changes, so call :func:`replan` before the planner follows a trace."""
    old = session.unit_of.get(id(module))
    if old is None:
        unit = Unit(index=len(session.units), name=name, params=tuple(tps),
                    nbytes=sum(tp.nbytes for tp in tps))
        session.units.append(unit)
    else:
        added = tuple(tp for tp in dict.fromkeys(tps) if tp not in old.params)
        unit = Unit(index=old.index, name=old.name, params=old.params + added,
                    nbytes=old.nbytes + sum(tp.nbytes for tp in added))
        session.units[old.index] = unit
    session.unit_of[id(module)] = unit
    return unit


def replan(session: Session) -> None:
    """A fresh planner over the current units (it learns a trace again).
    Its window is the one ``Session.start`` gives the first planner."""
    session.planner = PrefetchPlanner({u.index: u.nbytes for u in session.units},
                                      min(session.config.prefetch_bytes, session.lease_cap))


def restore_parameters(session: Session) -> None:
    """Put ordinary parameters (original dtype and device) back into the model."""
    session.settle()
    values = session.read_values(list(session.params.values()))
    fresh: dict[TieredParam, nn.Parameter] = {}
    for tp, value in values.items():
        fresh[tp] = nn.Parameter(value.to(tp.orig_device), requires_grad=tp.param.requires_grad)
    for mod_name, module in session.model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if isinstance(param, TieredParameter) and param.tiered in fresh:
                module._parameters[attr] = fresh[param.tiered]
    for module in session.model.modules():
        for name, buf in module._buffers.items():
            device = session.buffer_devices.get((id(module), name))
            if buf is not None and device is not None:
                module._buffers[name] = buf.to(device)
    for tp in session.params.values():
        if tp.state is ParamState.DEVICE:
            tp.param.data = torch.empty(0, dtype=tp.param.dtype, device=tp.param.device)
