"""The parameter registry of one attached model: its TieredParams and units.

At attach every parameter is replaced by a :class:`TieredParam` whose bytes
are in the store, and the *units* are built; at detach the ordinary
parameters are put back. The registry owns the name -> TieredParam maps, the
units, the module -> unit map, and which of a parameter's two tensors each
module holds ([Note: the two tensors of a parameter] in
``tierd.client.tiered_param``); nothing else writes them.

[Note: units are the model's blocks]
A unit is fetched before its forward and released after it as one. The
units are the model's repeated blocks (the children of every outermost
``nn.ModuleList`` or ``nn.Sequential``: a transformer's layers), or the
modules ``AttachConfig.unit_modules`` picks, and one more for the
parameters of every module outside them (embeddings, final norm, head),
fetched for the whole root forward. Hooks sit on a unit's module only, so a
block's forward runs with plain parameters and no tierd code inside it (what
``torch.compile`` of a block or of the model sees), and a module that reads
a child's parameters without calling the child (``nn.MultiheadAttention``'s
``out_proj``) finds them on the device. A tied parameter held in two units
belongs to the first; the mover counts holds, so neither frees it under the
other.

[Note: masters made when first needed]
Below fp32 compute a trainable parameter has an fp32 master. When the value
attach stores is already in the compute dtype (a model built or loaded in
bf16), the master is exactly the compute copy cast up, so attach stores
none (``TieredParam.master_made`` is False): the first update makes it, on
the device for a resident unit, else in the store from the stored compute
copy (``UnmadeState.values`` in ``tierd.optim.state``). Attach
then writes 2 B/param instead of 6, and the first step, whose gradients
are all in the store before any plan exists, needs no room for masters:
an 8B model's first step needs 48 GB of store instead of 80. Values read
before (``state_dict``, detach) come from the compute copy, which is the
same number. A job resumed from a commit made before a parameter's first
update has no master for it: made the same way. Under torch.distributed
every rank reads its owner's master from the store, so attach stores it.

[Note: parameters added after attach]
Attach replaces every parameter of the model. One added later (peft's
``get_peft_model`` on an attached model adds LoRA adapters) would be a plain
tensor no part of tierd knows: not stored, not committed, refused by
tierd.optim. So while attached the registry watches the model through
torch's module and parameter registration hooks (process-wide; each
registry acts on its own model's modules only, and removes them at
detach): a module registered into the model has its plain parameters
stored as attach stores them, in the unit of the module it joins (which
then fetches them with the rest); a plain Parameter set where an attached
one is (peft casting its adapters to fp32) gives that parameter its value
and ``requires_grad``, and the module keeps tierd's tensor. What would
change what an attached parameter is raises a StateError naming the order
that works: an attached parameter placed somewhere new (tying after
attach), one replaced by another shape, a new one under a name attached
already (a replaced embedding), a module outside every unit, and any
addition under torch.distributed (the ranks agreed on the parameters at
attach). Keys are named where the parameter was added; a job resumed from a
commit that adds them the same way gets their committed values, as attach
gives a parameter its committed value.

[Note: adapters stay on the device]
A LoRA model is a frozen base with small trainable adapters beside it in
every block. Streamed with their unit, the adapters' fp32 masters and
moments crossed PCIe out and in every step and took pool room from the
base: on the 70B LoRA step capped at 24 GB, 0.79 GB of state each way and
38.9 GB read from NVMe a step (H100, 5829cd6); keeping them on the device
(``resident_below_bytes=1 MiB``, which picks the same parameters there)
read 35.5 GB, sent nothing out, and stepped at 1.04x its floor (H200,
dd0fce3). So on a device, outside torch.distributed, attach keeps for good,
as ``resident_below_bytes`` does, every trainable parameter with at most
1/``SMALL_SHARE`` of the elements of a frozen parameter of its unit, and
their state stays there too ([Note: parameters resident for good keep
their state on the device] in tierd.updates.fused). Parameters added after
attach (peft's ``get_peft_model`` on an attached model, which freezes the
base only after adding the adapters), or frozen and unfrozen since, are
judged again when an optimizer is built, when what trains is known
(``AttachSession.keep_late_adapters``). ``attach(resident_adapters=False)``
turns the rule off.

[Note: attach's write path]
Attach writes each stored byte once, from where the value is, converted to
the stored dtype on its way into the pool: a CUDA parameter is copied from
the device into the pinned pool (no pageable host copy between), a
checkpoint's tensor from a mapping of its file ([Note: reading a tensor] in
``tierd.client.weights``), in ``put_many`` batches. Every temporary between
(a converted CPU copy, a pageable staging copy) is new pages, faulted and
zeroed, and one more copy, in series with the write. The pages the pool
grows by are the daemon's to allocate, ahead and on threads of its own
([Note: segments made ahead] in ``tierd.backends.hostpool``), not on the
client's path.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from tierd.client.keys import ModelKeys
from tierd.client.optimizers import SMALL_SHARE
from tierd.client.store import Store
from tierd.client.tiered_param import (MOVED_ATTR, DeviceParameter, ParamState, TieredParam,
                                       tiered_of)
from tierd.client.torch_internals import weak_hook
from tierd.errors import StateError

#: Gives a parameter's value to store: a tensor on any device whose values,
#: converted to the parameter's dtype, are the parameter's (``WeightsPlan``
#: in ``tierd.client.weights`` reads it from a checkpoint). It is read once
#: per stored key, converted on the way into the pool.
ValueSource = Callable[[nn.Parameter], torch.Tensor]


def same_storage(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether ``a`` is a view of ``b``'s (allocated) storage."""
    return a is not None and a.device == b.device and b.untyped_storage().nbytes() > 0 \
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _own_value(param: nn.Parameter) -> torch.Tensor:
    # where it is: a CUDA parameter is copied straight into the pinned pool
    # (no pageable staging copy), see [Note: attach's write path]
    return param.detach()


@dataclass(frozen=True, eq=False)
class Unit:
    """A block of the model (or the rest of it), fetched and freed as one
    batch ([Note: units are the model's blocks])."""

    index: int
    name: str
    params: tuple[TieredParam, ...]   # the non-resident ones
    nbytes: int


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(param) -> every (module, attribute, qualified name) holding it, tied included."""
    holders: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                qual = f"{mod_name}.{attr}" if mod_name else attr
                holders.setdefault(id(param), []).append((module, attr, qual))
    return holders


def expected_keys(model: nn.Module, keys: ModelKeys, compute_dtype: torch.dtype, *,
                  masters: bool = True) -> list[str]:
    """The keys a job resuming ``model`` must have: its compute copies
    (``p/``), and with ``masters`` its fp32 masters (``master/``; without,
    a missing one is made from the compute copy: [Note: masters made when
    first needed])."""
    out = []
    for name, p in model.named_parameters():
        out.append(keys.param(name))
        dtype = compute_dtype if p.is_floating_point() else p.dtype
        if masters and dtype != torch.float32 and p.requires_grad:
            out.append(keys.master(name))
    return out


def keeps_adapters(session, distributed: bool) -> bool:
    """Whether attach keeps adapters on the device: where their state stays
    too (``keeps_small_state`` in tierd.updates.fused), unless turned off
    ([Note: adapters stay on the device])."""
    return session.config.resident_adapters and session.copy.on_device and not distributed


def adapters(params: Iterable[nn.Parameter]) -> set[int]:
    """ids of the trainable ``params`` (one unit's) with at most
    1/SMALL_SHARE of the elements of a frozen one, see
    [Note: adapters stay on the device]."""
    params = list(params)
    frozen = max((p.numel() for p in params if not p.requires_grad), default=0)
    return {id(p) for p in params if p.requires_grad and p.numel() * SMALL_SHARE <= frozen}


def unit_parameters(model: nn.Module,
                    unit_modules=None) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Each unit's module and parameters ([Note: units are the model's
    blocks]): the rest's (under the model) first, then each block's; a
    parameter held in two units is the first's."""
    blocks = unit_roots(model, unit_modules)
    inside = {id(m) for b in blocks for m in b.modules()}
    rest = [m for m in model.modules() if id(m) not in inside]
    seen: set[int] = set()
    out = []
    for root, modules in [(model, rest)] + [(b, list(b.modules())) for b in blocks]:
        params = [p for m in modules for p in m._parameters.values()
                  if p is not None and id(p) not in seen]
        params = list({id(p): p for p in params}.values())
        seen.update(id(p) for p in params)
        out.append((root, params))
    return out


def unit_roots(model: nn.Module, unit_modules=None) -> list[nn.Module]:
    """The modules that are units besides the rest ([Note: units are the
    model's blocks]), outermost only, in module order."""
    def picked(module: nn.Module, parent: nn.Module | None) -> bool:
        if unit_modules is None:
            return isinstance(parent, (nn.ModuleList, nn.Sequential))
        if isinstance(unit_modules, tuple):
            return isinstance(module, unit_modules)
        return bool(unit_modules(module))

    roots: list[nn.Module] = []

    def visit(module: nn.Module, parent: nn.Module | None) -> None:
        if module is not model and picked(module, parent):
            roots.append(module)
            return
        for child in module.children():
            visit(child, module)

    visit(model, None)
    return list(dict.fromkeys(roots))


class ParamRegistry:
    """Every managed parameter of one model, by name, and its units.

    Built by taking the model's parameters: values whose keys are not in
    ``stored`` are uploaded (one batch per module); resident parameters
    whose keys are stored take the stored value (a resumed run).

    Example:
        >>> reg = ParamRegistry(model, session, store=store, stored=frozenset())  # doctest: +SKIP
        >>> reg.units[0].name, reg.params["weight"].state                          # doctest: +SKIP
        ('<root>', <ParamState.HOST: 'host'>)
    """

    def __init__(self, model: nn.Module, session, *, store: Store,
                 stored: frozenset[str], on_grad: Callable | None = None,
                 source: ValueSource | None = None,
                 kept: Mapping[nn.Parameter, torch.Tensor] | None = None,
                 distributed: bool = False) -> None:
        self.model = model
        self.params: dict[str, TieredParam] = {}     # canonical name -> param
        self.aliases: dict[str, TieredParam] = {}    # every name (tied too)
        self.units: list[Unit] = []
        self._originals: dict[TieredParam, nn.Parameter] = {}   # the caller's, by param
        self.unit_of: dict[int, Unit] = {}           # id(module) -> unit
        self.buffer_devices: dict[tuple[int, str], torch.device] = {}
        # every parameter of each unit, resident ones included (by unit index)
        self._members: list[tuple[TieredParam, ...]] = []
        # (module, attribute, param) of every parameter each unit's modules hold
        self._unit_holders: list[list[tuple[nn.Module, str, TieredParam]]] = []
        self.unit_modules: list[nn.Module] = []   # the module of each unit, by index
        self._names = {id(m): name or "<root>" for name, m in model.named_modules()}
        # [Note: parameters added after attach]: what adopting one needs
        self._session, self._store, self._on_grad = session, store, on_grad
        #: a resumed job's keys: their committed values win
        self.resumed_keys = stored
        self._qualnames: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._unit_index: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
        self._watch_handles: list = []
        # frozen parameters whose compute copy (on the device) is their only
        # copy ([Note: frozen weights kept only on the device] in tierd.client.kept_frozen)
        self._kept = kept or {}
        # [Note: adapters stay on the device]: on, the ids of those attach keeps
        self._keep_adapters = keeps_adapters(session, distributed)
        self._adapters = set().union(*(adapters(ps) for _, ps in unit_parameters(
            model, session.config.unit_modules))) if self._keep_adapters else set()
        self._take(session, store, stored, on_grad, source)

    # ------------------------------------------------------------- attach
    def _take(self, session, store: Store, stored: frozenset[str], on_grad,
              source: ValueSource | None) -> None:
        """Replace every parameter, uploading one module at a time; on any
        failure undo it all (:meth:`_undo`) and re-raise."""
        holders = _holders(self.model)
        resumed: list[TieredParam] = []   # resident ones whose value is in the store
        taken: list[tuple[nn.Parameter, TieredParam]] = []
        put: list[str] = []
        # each batch sent to the store: its keys and the slice of ``taken`` it stores
        sent: list[tuple[list[str], int, int]] = []
        published: list[int] = []   # batches stored, in order

        def batches():
            """One batch per module, made when the store asks for it (a
            checkpoint's values are read only then): [Note: pipelined puts]
            in tierd.client.connection."""
            for module in dict.fromkeys(self.model.modules()):
                uploads: dict[str, torch.Tensor] = {}   # key -> value to store
                dtypes: dict[str, torch.dtype] = {}     # key -> dtype it is stored in
                first = len(taken)
                for param in list(module._parameters.values()):
                    if param is None or tiered_of(param) is not None:
                        continue   # replaced already through a tied holder
                    hs = holders[id(param)]
                    tp = self._make(session, param, hs[0][2], (uploads, dtypes), stored,
                                    on_grad, source or _own_value, self._kept.get(param),
                                    adapter=id(param) in self._adapters)
                    taken.append((param, tp))
                    if tp.resident and tp.key in stored:
                        resumed.append(tp)
                    for holder, attr, qual in hs:
                        holder._parameters[attr] = tp.between_uses
                        self.aliases[qual] = tp
                    self.params[tp.name] = tp
                if uploads:
                    sent.append((list(uploads), first, len(taken)))
                    yield uploads, dtypes
                elif source is None:
                    self._empty(taken[first:])

        def stored_batch(i: int) -> None:
            keys, first, last = sent[i]
            put.extend(keys)
            published.append(i)
            if source is None:   # the caller's old Parameters keep no bytes alive
                self._empty(taken[first:last])

        try:
            store.put_batches(batches(), stored_batch)
            if source is not None:   # with a checkpoint, kept until nothing can fail
                self._empty(taken)
            if resumed:
                values = store.get_many([tp.key for tp in resumed])
                with torch.no_grad():
                    for tp in resumed:
                        tp.compute.copy_(values[tp.key])
        except BaseException:
            # batches sent and not known stored: some of their keys may be
            self._undo(store, holders, taken, put,
                       [k for keys, _, _ in sent[len(published):] for k in keys])
            raise
        self._originals = {tp: param for param, tp in taken}   # emptied; refilled at detach
        for module in self.model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    self.buffer_devices[(id(module), name)] = buf.device
                    module._buffers[name] = buf.to(session.device)
        self._build_units(session.config.unit_modules)
        for name, module in self.model.named_modules():
            self._qualnames[module] = name
        self._watch_handles = [
            register_module_module_registration_hook(weak_hook(self._module_added)),
            register_module_parameter_registration_hook(weak_hook(self._parameter_added))]

    @staticmethod
    def _empty(taken: list[tuple[nn.Parameter, TieredParam]]) -> None:
        for param, tp in taken:
            # an optimizer built before attach holds these: its step() is refused
            param.__dict__[MOVED_ATTR] = tp.name
            if param.numel() and not param.is_meta:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _undo(self, store: Store, holders, taken: list[tuple[nn.Parameter, TieredParam]],
              put: list[str], pending: list[str]) -> None:
        """A failed attach: the model's own Parameters back (values of emptied
        ones read back from the store), and every key it put deleted."""
        emptied = [(p, tp) for p, tp in taken
                   if p.numel() == 0 and tp.param.numel() and tp.value_key in put]
        if emptied:
            with contextlib.suppress(Exception):   # the store may be what failed
                got = store.get_many([tp.value_key for _, tp in emptied])
                for p, tp in emptied:
                    p.data = got[tp.value_key].to(tp.orig_dtype).to(tp.orig_device)
        for param, _ in taken:
            param.__dict__.pop(MOVED_ATTR, None)
            for holder, attr, _ in holders[id(param)]:
                holder._parameters[attr] = param
        self.params.clear()
        self.aliases.clear()
        # the failed batch one key at a time: a delete of an absent key fails
        for keys in (put, *([k] for k in pending)):
            with contextlib.suppress(Exception):
                store.delete(keys)

    @staticmethod
    def _make(session, param: nn.Parameter, name: str,
              uploads: tuple[dict[str, torch.Tensor], dict[str, torch.dtype]],
              stored: frozenset[str], on_grad, source: ValueSource,
              kept: torch.Tensor | None = None, *, adapter: bool = False) -> TieredParam:
        cfg = session.config
        dtype = cfg.compute_dtype if param.is_floating_point() else param.dtype
        nbytes = param.numel() * param.element_size()
        for_good = kept is None and (adapter or nbytes < cfg.resident_below_bytes)
        resident = kept is not None or for_good
        data = torch.empty(param.shape, dtype=dtype, device=session.device) \
            if kept is None else kept
        new = DeviceParameter(data, requires_grad=param.requires_grad)
        # a meta model's parameters come back (detach) on the CPU
        orig_device = torch.device("cpu") if param.is_meta else param.device
        tp = TieredParam(name=name, keys=session.keys, param=new, orig_dtype=param.dtype,
                         orig_device=orig_device, resident=resident, session=session)
        tp.resident_for_good = for_good
        if kept is not None:   # frozen, its device copy its only one: nothing stored
            tp.in_store = False
            return tp
        master_missing = tp.has_master and tp.master_key not in stored
        # resuming a job whose master was never made: the stored compute copy is its value
        from_stored = master_missing and tp.key in stored and session.lazy_masters
        need = (tp.key not in stored or (master_missing and not from_stored)
                or (resident and tp.key not in stored))
        value = source(param) if need else None   # resuming: the committed value wins
        values, dtypes = uploads   # converted while copied into the pool: no temporaries
        if tp.key not in stored:
            values[tp.key], dtypes[tp.key] = value, dtype
        if master_missing:
            if from_stored or (session.lazy_masters and value.dtype == dtype):
                tp.master_made = False   # [Note: masters made when first needed]
            else:
                values[tp.master_key], dtypes[tp.master_key] = value, torch.float32
        if new.requires_grad and on_grad is not None:
            # outside too: a submodule called on its own runs on it
            for tensor in (new, tp.outside):
                tensor.register_post_accumulate_grad_hook(weak_hook(on_grad))
        if resident:
            if value is not None:
                with torch.no_grad():
                    tp.compute.copy_(value)
        else:
            new.untyped_storage().resize_(0)
        return tp

    def _build_units(self, unit_modules) -> None:
        """[Note: units are the model's blocks]: the rest first, then the
        blocks in module order, each with the (module, attribute, param)
        holders of its modules."""
        blocks = unit_roots(self.model, unit_modules)
        inside = {id(m) for b in blocks for m in b.modules()}
        rest = [m for m in self.model.modules() if id(m) not in inside]
        taken: set[TieredParam] = set()
        for root, modules in [(self.model, rest)] + [(b, list(b.modules())) for b in blocks]:
            holders = [(m, attr, p.tiered) for m in modules
                       for attr, p in m._parameters.items() if p is not None]
            members = tuple(dict.fromkeys(tp for _, _, tp in holders if tp not in taken))
            taken.update(members)
            if not members:
                continue
            params = tuple(tp for tp in members if not tp.resident)
            unit = Unit(index=len(self.units), name=self._names[id(root)], params=params,
                        nbytes=sum(tp.nbytes for tp in params))
            self.units.append(unit)
            self._members.append(members)
            self._unit_holders.append(holders)
            self.unit_of[id(root)] = unit
            self.unit_modules.append(root)
            for module in modules:
                self._unit_index[module] = unit.index

    def module_groups(self, unit: Unit) -> list[tuple[TieredParam, ...]]:
        """``unit``'s streamed parameters grouped by the module holding them,
        in module order (the optimizer's buckets)."""
        groups: dict[int, list[TieredParam]] = {}
        seen: set[TieredParam] = set()
        for module, _, tp in self._unit_holders[unit.index]:
            if tp in unit.params and tp not in seen:
                seen.add(tp)
                groups.setdefault(id(module), []).append(tp)
        return [tuple(g) for g in groups.values()]

    def install(self, unit: Unit, *, running: bool) -> None:
        """Put into ``unit``'s modules the compute tensors of its streamed
        parameters (``running``: its forward begins) or their tensors for
        between uses ([Note: the two tensors of a parameter])."""
        for module, attr, tp in self._unit_holders[unit.index]:
            if not tp.resident:
                module._parameters[attr] = tp.param if running else tp.outside

    def holders(self, unit: Unit) -> dict[TieredParam, list[tuple[nn.Module, str]]]:
        """Where ``unit``'s modules hold each of its streamed parameters."""
        out: dict[TieredParam, list[tuple[nn.Module, str]]] = {}
        for module, attr, tp in self._unit_holders[unit.index]:
            if not tp.resident:
                out.setdefault(tp, []).append((module, attr))
        return out

    def reinstall(self, tps: list[TieredParam]) -> None:
        """Put into every module holding one of ``tps`` its tensor for between
        uses (``TieredParam.between_uses``: it changed)."""
        changed = set(tps)
        for holders in self._unit_holders:
            for module, attr, tp in holders:
                if tp in changed:
                    module._parameters[attr] = tp.between_uses

    def members(self, unit: Unit) -> tuple[TieredParam, ...]:
        """Every parameter of ``unit``, resident ones included."""
        return self._members[unit.index]

    def set_resident(self, tps: list[TieredParam], resident: bool,
                     values: dict[str, torch.Tensor] | None = None) -> None:
        """Make ``tps`` resident (their stored bytes ``values`` by key, copied
        in) or streamed again, and rebuild the units they are in: a unit's
        ``params`` are its non-resident ones. Units keep their index and module."""
        for tp in tps:
            if resident:
                tp.make_resident(values[tp.key])
            else:
                tp.make_streamed()
        self.reinstall(tps)
        changed = set(tps)
        for unit in list(self.units):
            if changed.intersection(self._members[unit.index]):
                self._rebuild(unit.index)

    def _rebuild(self, index: int) -> None:
        """Unit ``index`` again from its members: its ``params`` are the
        non-resident ones. It keeps its index and module."""
        unit, params = self.units[index], tuple(tp for tp in self._members[index]
                                                if not tp.resident)
        new = Unit(index=index, name=unit.name, params=params,
                   nbytes=sum(tp.nbytes for tp in params))
        self.units[index] = new
        self.unit_of[id(self.unit_modules[index])] = new

    # ------------------------------------------------ added after attach
    def _module_added(self, parent: nn.Module, name: str, sub: nn.Module | None) -> None:
        """torch registers ``sub`` as ``parent.name``: in this model, its new
        parameters become tierd's ([Note: parameters added after attach]).
        Not while compiling: a forward's temporary container (Llama slices its
        ``ModuleList`` of layers in every forward) is no new part of the model,
        and a traced call here was a graph break in every compiled forward."""
        if torch.compiler.is_compiling() or sub is None or parent not in self._qualnames:
            return
        prefix = f"{self._qualnames[parent]}.{name}".lstrip(".")
        index = self._unit_index.get(parent)
        new: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
        fresh = []   # modules not in the model before
        for path, module in sub.named_modules(prefix=prefix, remove_duplicate=False):
            if module not in self._qualnames:
                fresh.append((path, module))
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                if tiered_of(param) is None:
                    new.setdefault(id(param), (param, []))[1].append((module, attr,
                                                                      f"{path}.{attr}"))
                else:
                    self._check_held(module, attr, param)
        if new:
            self._adopt(list(new.values()), index)
        for path, module in fresh:
            self._qualnames.setdefault(module, path)
            if index is not None:
                self._unit_index.setdefault(module, index)

    def _parameter_added(self, module: nn.Module, name: str,
                         param: nn.Parameter) -> torch.Tensor | None:
        """torch registers ``param`` as ``module.name``; returns the tensor the
        module holds instead ([Note: parameters added after attach])."""
        if module not in self._qualnames:
            return None
        if tiered_of(param) is not None:
            self._check_held(module, name, param)
            return None
        held = tiered_of(module._parameters.get(name))
        if held is None:   # a new parameter
            qual = f"{self._qualnames[module]}.{name}".lstrip(".")
            return self._adopt([(param, [(module, name, qual)])],
                               self._unit_index.get(module), install=False)[0]
        if tuple(param.shape) != tuple(held.param.shape):
            raise StateError(
                f"replacing attached parameter {held.name!r} of shape "
                f"{tuple(held.param.shape)} with one of shape {tuple(param.shape)}: tierd "
                f"stores it under its name and shape; make such changes before tierd.attach "
                f"(or tierd.detach(model) first)")
        # a new Parameter object for an attached one (peft casting its adapters
        # to fp32): its value, flag and dtype (what detach gives back); the
        # module keeps the tensor tierd gave it
        self._session.write_values({held: param.detach()})
        held.set_requires_grad(param.requires_grad)
        held.orig_dtype = param.dtype
        return module._parameters[name]

    def _state_dict_hook(self):
        def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
            self._session.fill_state_dict(module, state_dict, prefix)
        return hook   # a function per module: torch tags the hook object it is given

    def _check_held(self, module: nn.Module, attr: str, param: torch.Tensor) -> None:
        """An attached parameter placed where it was already held passes
        (``tie_weights()`` on a tied model); anywhere else it is refused."""
        tp = tiered_of(param)
        if tp.session is self._session and any(
                m is module and a == attr and t is tp
                for holders in self._unit_holders for m, a, t in holders):
            return
        raise StateError(
            f"placing attached parameter {tp.name!r} at {type(module).__name__}.{attr} "
            f"after tierd.attach (tying or moving parameters): tierd holds each "
            f"parameter where attach found it; tie or move them before tierd.attach")

    def _adopt(self, new: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]],
               index: int | None, *, install: bool = True) -> list[torch.Tensor]:
        """Store ``new`` parameters (each with its holders: module, attribute,
        qualified name) as attach stores one, in unit ``index``; with
        ``install`` the holders hold them now. Returns the tensor each holder
        holds between uses, by parameter."""
        session = self._session
        names = [holders[0][2] for _, holders in new]
        if session.share is not None or index is None or any(n in self.aliases for n in names):
            why = ("under torch.distributed the ranks agreed on the parameters at attach"
                   if session.share is not None else
                   "its module is in no unit of the model" if index is None else
                   "a parameter of that name is attached already")
            raise StateError(
                f"parameters added to an attached model ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): {why}. Add them before tierd.attach, "
                f"e.g. tierd.attach(get_peft_model(model, config))")
        uploads: dict[str, torch.Tensor] = {}
        dtypes: dict[str, torch.dtype] = {}
        made = [(param, holders, self._make(session, param, holders[0][2], (uploads, dtypes),
                                            self.resumed_keys, self._on_grad, _own_value))
                for param, holders in new]
        if uploads:
            self._store.put_many(uploads, dtypes=dtypes)
        resumed = [tp for _, _, tp in made if tp.resident and tp.key in self.resumed_keys]
        if resumed:   # as attach: a resident one takes the committed value
            values = self._store.get_many([tp.key for tp in resumed])
            with torch.no_grad():
                for tp in resumed:
                    tp.compute.copy_(values[tp.key])
        for param, holders, tp in made:
            if tp.param.requires_grad:   # what ModuleHooks hooks at attach
                tp.hook_gradient_arrival()
            for module, attr, qual in holders:
                if install:
                    module._parameters[attr] = tp.between_uses
                self.aliases[qual] = tp
                self._unit_holders[index].append((module, attr, tp))
            self.params[tp.name] = tp
            self._originals[tp] = param
        for module in dict.fromkeys(m for _, holders, _ in made for m, _, _ in holders):
            # what ModuleHooks registers at attach: state_dict() gives values
            self._watch_handles.append(module.register_state_dict_post_hook(
                self._state_dict_hook()))
        self._members[index] += tuple(tp for _, _, tp in made)
        self._empty([(param, tp) for param, _, tp in made])
        self._rebuild(index)
        return [tp.between_uses for _, _, tp in made]

    def resident(self) -> list[TieredParam]:
        return [tp for tp in self.params.values() if tp.resident]

    def late_adapters(self) -> list[TieredParam]:
        """The adapters the rule picks now that are not on the device: added
        after attach, or frozen and unfrozen since ([Note: adapters stay on
        the device])."""
        if not self._keep_adapters:
            return []
        out = []
        for members in self._members:
            picked = adapters(tp.param for tp in members)
            out += [tp for tp in members if id(tp.param) in picked and not tp.resident]
        return list(dict.fromkeys(out))

    def restore(self, values: dict[TieredParam, torch.Tensor]) -> None:
        """Put the model's own Parameters back, holding ``values`` (original
        dtype and device; a new Parameter for one that was on the meta
        device), and its buffers (original device)."""
        for handle in self._watch_handles:
            handle.remove()
        fresh = {}
        for tp, value in values.items():
            param = self._originals.get(tp)
            value = value.to(tp.orig_device)
            if param is None or param.is_meta:
                param = nn.Parameter(value, requires_grad=tp.param.requires_grad)
            else:
                param.data = value
                param.requires_grad_(tp.param.requires_grad)
                param.__dict__.pop(MOVED_ATTR, None)
            fresh[tp] = param
        for module in self.model.modules():
            for attr, param in module._parameters.items():
                if tiered_of(param) in fresh:
                    module._parameters[attr] = fresh[tiered_of(param)]
            for name, buf in module._buffers.items():
                device = self.buffer_devices.get((id(module), name))
                if buf is not None and device is not None:
                    module._buffers[name] = buf.to(device)
        for tp in self.params.values():   # (a value given back as it was keeps its storage)
            if tp.state is ParamState.DEVICE and not same_storage(values.get(tp), tp.compute):
                tp.param.untyped_storage().resize_(0)
