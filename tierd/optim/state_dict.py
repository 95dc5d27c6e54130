"""A tierd optimizer's ``state_dict()`` and ``load_state_dict()`` in torch's format.

[Note: optimizer state dicts]
torch's checkpoint contract (a Trainer's ``optimizer.pt``, accelerate's
``save_state``/``load_state`` and ``AcceleratedOptimizer``, which loads
``opt.state_dict()`` back when it wraps an optimizer) needs each
parameter's state in the dict: ``{"state": {index: {"step", "exp_avg",
"exp_avg_sq"}}, "param_groups": [...]}`` for AdamW, ``momentum_buffer`` for
SGD, indexed as torch indexes them (parameters in group order). That state
lives in tierd, so :func:`state_dict` reads it from the store (resident state
written back first, as a commit does) into new CPU tensors, and
:func:`load_state_dict` writes loaded values into the store through write
leases (in place, so a held key stays the view every update reads), after
resident state went back to the pool (its device copy would be stale). A
parameter without state in the dict gets none, as in torch: its moments are
zeroed and its step count dropped. Every entry is checked before anything is
written, so bad input changes nothing. A ``torch.optim.AdamW`` (or ``SGD``)
dict of the same model loads the same way, which moves a run from torch to
tierd. ``tierd.commit`` stays the fast path: it copies nothing through the
client.

[Note: compact state in a state dict]
A compact optimizer's dict ([Note: compact optimizer state] in
tierd.optim.compact) holds each moment in its stored form (a bf16 tensor, or
the packed uint8 codes and scales of an 8-bit one), so saving and loading
round-trips its bytes exactly, and the setting at the top level
(``"compact": {"state": ..., "master": ...}``). Loading it needs the same
setting (StateError otherwise: bytes of one format are not read as
another). A dict without the setting (torch's, or a default tierd
optimizer's: fp32 moments) loads into any setting, each moment converted to
this optimizer's form, as building a compact optimizer from an fp32 run.
"""

from __future__ import annotations

from itertools import chain

import torch

from tierd.errors import StateError
from tierd.optim.compact import CompactState


def _indexed(groups: list[dict]) -> list:
    """The parameters of ``groups`` in torch's state-dict order (first occurrence)."""
    return list(dict.fromkeys(chain.from_iterable(g["params"] for g in groups)))


def state_dict(opt, base: dict) -> dict:
    """``base`` (torch's ``state_dict()``: step counts and ``param_groups``)
    with each stepped parameter's state tensors read from tierd, and its
    step as torch stores it (a float32 scalar tensor)."""
    owned = set(opt._owned())
    stepped = {i: p.tiered for i, p in enumerate(_indexed(opt.param_groups))
               if opt.state.get(p, {}).get("step", 0.0) > 0 and p.tiered in owned}
    values: dict[str, torch.Tensor] = {}
    for session in opt._by_session(list(stepped.values())):
        session.settle()   # resident state written back ([Note: optimizer state dicts])
    for block in opt._blocks(list(stepped.values())):   # leased a block at a time
        values.update(block[0].session.read([opt.state_key(tp, n) for tp in block
                                             for n in opt.state_names]))
    state = {}
    for i, entry in base["state"].items():
        entry = {k: v for k, v in entry.items()}   # torch hands out self.state's own dicts
        if "step" in entry:
            entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
        if i in stepped:
            entry.update({n: values[opt.state_key(stepped[i], n)] for n in opt.state_names})
        state[i] = entry
    out = {"state": state, "param_groups": base["param_groups"]}
    if not opt.compact.exact:   # [Note: compact state in a state dict]
        out["compact"] = {"state": opt.compact.state, "master": opt.compact.master}
    return out


def _saved_setting(loaded: dict) -> CompactState:
    saved = loaded.get("compact")
    if saved is None:
        return CompactState()
    if not isinstance(saved, dict):
        raise StateError(f"the state dict's 'compact' is {type(saved).__name__}; a tierd "
                         "state dict has a dict {'state': ..., 'master': ...} there")
    try:
        return CompactState(state=saved.get("state", "fp32"), master=saved.get("master", "fp32"))
    except ValueError as exc:
        raise StateError(f"the state dict's compact setting is not one tierd knows: {exc}") \
            from None


def _moment(opt, tp, n: str, value, exact: bool, where: str) -> torch.Tensor:
    """A loaded moment in ``opt``'s stored form for ``tp`` (CPU), or StateError:
    with ``exact`` the dict holds that form already; else fp32 values, converted."""
    like = opt.state_like(tp, n)
    if exact:
        if not isinstance(value, torch.Tensor) or value.dtype != like.dtype \
                or value.shape != like.shape:
            what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                    if isinstance(value, torch.Tensor) else type(value).__name__)
            raise StateError(f"{n!r} of {where} in the state dict is {what}; with "
                             f"{opt.compact.text} it is a {like.dtype} tensor of shape "
                             f"{tuple(like.shape)}: it was saved for a different model")
        return value.detach().to("cpu")
    if not isinstance(value, torch.Tensor) or value.shape != tp.param.shape \
            or not value.is_floating_point():
        what = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor) else type(value).__name__)
        raise StateError(f"{n!r} of {where} in the state dict is {what}; it was saved for "
                         "a different model")
    value = value.detach().to("cpu", torch.float32)
    return opt.compact.encode(value, like, signed=n != "exp_avg_sq")


def _describe(tp, index: int) -> str:
    return f"parameter {index} ({tp.name!r}, shape {tuple(tp.param.shape)})"


def checked(opt, loaded: dict) -> dict:
    """The state ``loaded`` gives each parameter ({tp: (step, {name: CPU
    tensor in ``opt``'s stored form})}), or StateError naming what does not
    fit ``opt``; reads only."""
    if not isinstance(loaded, dict) or "param_groups" not in loaded or "state" not in loaded:
        got = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
        raise StateError(f"an optimizer state dict has the keys 'state' and 'param_groups'; "
                         f"got {got}. Pass what opt.state_dict() (or torch.save of it) gave")
    groups = loaded["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise StateError(f"the state dict has {len(groups)} parameter groups, this optimizer "
                         f"{len(opt.param_groups)}; build the optimizer with the same groups "
                         "as the run that saved it")
    for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise StateError(f"group {i} of the state dict has {len(saved['params'])} "
                             f"parameters, this optimizer's {len(mine['params'])}; load it into "
                             "an optimizer over the same model's parameters, in the same order")
        # (torch's __setstate__ adds "differentiable" to the defaults, unused here)
        missing = sorted(set(opt.defaults) - {"differentiable"} - set(saved))
        if missing:
            raise StateError(f"group {i} of the state dict lacks {missing}: it is not a "
                             f"{type(opt).__name__} state dict (it has {sorted(saved)})")
        if saved.get("amsgrad"):
            raise StateError(f"group {i} of the state dict is torch's AdamW with amsgrad=True, "
                             "which tierd.optim.AdamW does not implement")
    saved = _saved_setting(loaded)
    if not saved.exact and saved != opt.compact:
        raise StateError(f"the state dict was saved by an optimizer with {saved.text}; this "
                         f"one keeps {opt.compact.text}. Build it with {saved.text} to load "
                         "it ([Note: compact state in a state dict])")
    by_id = dict(zip(chain.from_iterable(g["params"] for g in groups),
                     chain.from_iterable(g["params"] for g in opt.param_groups)))
    owned = set(opt._owned())
    out = {}
    for index, entry in loaded["state"].items():
        if index not in by_id:
            raise StateError(f"the state dict has state for parameter {index!r}, which none "
                             f"of its groups lists (they list {len(by_id)} parameters)")
        tp = by_id[index].tiered
        if tp not in owned:
            raise StateError(f"the state dict has state for {_describe(tp, index)}, which "
                             "this optimizer keeps none for (it does not train, or another "
                             "rank owns it)")
        missing = [n for n in opt.state_names if n not in entry]
        if missing:
            raise StateError(f"the state of {_describe(tp, index)} lacks {missing} (it has "
                             f"{sorted(entry)}); it is not a {type(opt).__name__} state dict "
                             "with the same hyper-parameters")
        moments = {n: _moment(opt, tp, n, entry[n], not saved.exact, _describe(tp, index))
                   for n in opt.state_names}
        out[tp] = (opt.loaded_step(entry, tp.name), moments)
    return out


def load_state_dict(opt, loaded: dict, load_groups) -> None:
    """Check ``loaded`` whole, then ``load_groups`` (torch's loading of the
    hyper-parameters, with no state) and write each parameter's step count
    and state into tierd ([Note: optimizer state dicts])."""
    state = checked(opt, loaded)
    if state and any(tp.session.share is not None for tp in state):
        raise StateError("loading per-parameter optimizer state under torch.distributed is "
                         "not supported; checkpoint with tierd.commit(model, opt, step) and "
                         "resume with tierd.attach(model, job=..., resume=True)")
    if opt.has_unfinished_step():
        raise StateError("a fused update ran but opt.step() was not called yet; load the "
                         "state dict after opt.step() (or before the backward)")
    load_groups({"state": {}, "param_groups": loaded["param_groups"]})
    owned = opt._owned()
    for tp, (step, _) in state.items():
        opt.state[tp.outside]["step"] = step
    for session in opt._by_session(owned):
        session.settle()
        for f in opt._fused:
            if f.session is session:
                f.drop_resident()   # its device copy would be older than what is written
    for block in opt._blocks(owned):   # leased a block at a time
        session = block[0].session
        opt.unmade.ensure_stored([tp for tp in block if tp in state])
        values = {}
        for tp in block:
            moments = state[tp][1] if tp in state else {}
            for n in opt.state_names:
                key = opt.state_key(tp, n)
                if n in moments:
                    values[key] = moments[n]
                elif key not in opt.unmade:   # made before: no state now is zeros
                    values[key] = None
        if values:
            session.leases.acquire(list(values))
            try:
                for key, view in session.leases.views(list(values)).items():
                    if values[key] is None:
                        view.zero_()
                    else:
                        view.copy_(values[key].reshape(view.shape))
            finally:
                session.leases.release(list(values), written=True)
    opt._stepped.clear()
