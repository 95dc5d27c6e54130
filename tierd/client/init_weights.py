"""``tierd.attach(meta_model, init=True)``: the model's own initialization, unit by unit.

A model built on the meta device (``with torch.device("meta"):
LlamaForCausalLM(config)``) has no values. :func:`plan_init` checks that
every parameter has an initialization (a Hugging Face ``_init_weights``
above it, else its module's ``reset_parameters``) before anything is stored;
:meth:`InitPlan.store` then materializes one unit at a time on the compute
device, runs the model's init on it, stores it and frees it; the frozen
parameters of the units the first step's estimated plan keeps on the device
stay there instead, never stored ([Note: frozen weights kept only on the
device] in ``tierd.client.kept_frozen``). The session is then built over the
stored keys, as a resumed job's are.

[Note: initializing unit by unit]
The inits run in the order Hugging Face's ``initialize_weights`` runs them
(``smart_apply``: children before their parent, each module by the
``_init_weights`` of the nearest ``PreTrainedModel`` above it, itself
included), which is also the order in which torch constructors run
``reset_parameters`` (a module's children are built, and reset, before it).
In that order every block (a unit, [Note: units are the model's blocks] in
``tierd.client.registry``) is one run of modules ending with its root, so a
block is materialized when its first module comes, stored and freed after
its root's init. The rest is materialized module by module as they come and
stored at the end, after the root's init (which may touch its children):
at most the rest and one block are on the device at once. A peft LoRA
layer (``get_peft_model`` on the meta model) then initializes its adapters
with peft's ``reset_lora_parameters`` and their config's
``init_lora_weights``, as ``get_peft_model`` does on a model with values
(B zero: the adapted model starts as its base); inits that read the base
weights (PiSSA, OLoRA, ...) and other tuners are refused.

A tied parameter is initialized through its source (the holder not named a
tie target by Hugging Face's ``all_tied_weights_keys`` /
``_tied_weights_keys``, else the first holder in that order); its other
holders hold a scratch tensor during the inits. A plain model ties after
its inits, so those draws went into a tensor that is then dropped: the
scratch makes the same draws and drops them.

Two checks keep a wrong value from being stored silently. Floating
tensors are materialized NaN-filled, so a parameter whose unit's inits left
any of it unset (its value comes from ``__init__`` only) is an error before
its unit is stored (the version counter would not tell: writes through
``.data``, as transformers 4.x inits make them, do not move it). An init
that writes a parameter already stored (one outside its unit) writes a meta
tensor, whose version counter moves (unless written through ``.data``): an
error after the walk. Either way every stored key is deleted again.

[Note: init values and the plain model's]
With the same seed, the values equal the model's own init run on the whole
model in the same order, on the same device: for a model initialized by
``reset_parameters`` that is the plain model built under
``torch.manual_seed``. A plain Hugging Face model is not: its constructors
first draw torch's default inits (``nn.Linear.__init__``'s
``kaiming_uniform_``, ``nn.Embedding``'s ``normal_``), which
``post_init`` then draws over; a meta model never drew them, so the random
generator is elsewhere when ``_init_weights`` runs. Its values are those of
the plain model built with torch's constructor inits off, from the same
distributions as the plain model's; constants (norm weights, zero biases)
are equal. Matching the plain model would mean drawing every constructor's
init again, a whole second pass of the random generator, only to discard
it. On CUDA the values come from the device's generator.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tierd.client.keys import ModelKeys
from tierd.client.placement import Place, UnitBytes, plan_placement
from tierd.client.registry import unit_roots
from tierd.client.store import Store
from tierd.client.weights import ReplacedBuffers, listed

#: The rest of the model (everything outside the blocks) is unit 0 here.
_REST = 0


def _pretrained_base() -> type | None:
    """Hugging Face's ``PreTrainedModel`` when transformers is loaded (a
    model of it is then too), else None: tierd does not import it."""
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _reset(module: nn.Module) -> Callable[[], None] | None:
    """``module``'s own reset (``nn.MultiheadAttention`` and ``nn.Transformer``
    name theirs ``_reset_parameters``)."""
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn
    return None


#: peft's LoRA initializations that need nothing but the adapter's shape.
_LORA_INITS = (True, "gaussian")


def _adapter_names(module: nn.Module) -> list[str]:
    """The adapters of a peft LoRA layer (none for any other module)."""
    if not callable(getattr(module, "reset_lora_parameters", None)):
        return []
    return [*getattr(module, "lora_A", {}).keys(), *getattr(module, "lora_embedding_A", {}).keys()]


@dataclass(frozen=True, eq=False)
class _Call:
    """One init, in walk order: ``module``'s, by ``owner._init_weights`` (a
    Hugging Face model) or by its own reset; a peft LoRA layer's adapters
    then by peft's ``reset_lora_parameters`` with their config's
    ``init_lora_weights`` (``adapters``), as ``get_peft_model`` inits them."""

    module: nn.Module
    name: str
    owner: nn.Module | None
    unit: int
    adapters: dict | None = None   # adapter name -> its peft config

    def run(self) -> None:
        if self.owner is not None:
            self.owner._init_weights(self.module)
        elif (reset := _reset(self.module)) is not None:
            reset()
        for name in _adapter_names(self.module):
            self.module.reset_lora_parameters(name, self.adapters[name].init_lora_weights)

    def adapters_unsupported(self) -> str | None:
        """Why peft adapters of this module cannot be initialized here, if so."""
        names = _adapter_names(self.module)
        if not names:
            if getattr(self.module, "adapter_layer_names", None):
                return (f"{self.name} is a peft {type(self.module).__name__} layer: init=True "
                        "initializes LoRA adapters only")
            return None
        for name in names:
            config = (self.adapters or {}).get(name)
            if config is None:
                return f"{self.name}'s adapter {name!r} has no peft config above it"
            init = config.init_lora_weights
            if (init.lower() if isinstance(init, str) else init) not in _LORA_INITS:
                return (f"adapter {name!r} has init_lora_weights={init!r}; init=True "
                        f"initializes LoRA adapters as {_LORA_INITS} do (build the model on "
                        "the CPU for the others, which read the base weights)")
        return None


@dataclass(frozen=True, eq=False)
class _Holder:
    """A module attribute holding a parameter (``param``: the model's own, on meta)."""

    module: nn.Module
    attr: str
    name: str   # qualified
    unit: int
    param: nn.Parameter


def _tie_targets(model: nn.Module) -> set[str]:
    """Names (in ``model``) Hugging Face ties to another parameter after its inits."""
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        tied = getattr(model, attr, None)
        if tied:
            return {k for k in tied if isinstance(k, str)}
    return set()


def _walk(model: nn.Module, unit_of: dict[int, int]) -> tuple[list[_Call], set[str]]:
    """Every module's init in Hugging Face's ``smart_apply`` order ([Note:
    initializing unit by unit]), and the qualified names of tie targets."""
    base = _pretrained_base()
    calls: list[_Call] = []
    targets: set[str] = set()

    def visit(module: nn.Module, name: str, owner: nn.Module | None, unit: int,
              adapters: dict | None) -> None:
        if base is not None and isinstance(module, base):
            owner = module
            targets.update(f"{name}.{t}" if name else t for t in _tie_targets(module))
        config = getattr(module, "peft_config", None)
        adapters = config if isinstance(config, dict) else adapters
        unit = unit_of.get(id(module), unit)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, owner, unit, adapters)
        calls.append(_Call(module, name or "<root>", owner, unit, adapters))

    visit(model, "", None, _REST, None)
    return calls, targets


def _holders(model: nn.Module, calls: list[_Call],
             targets: set[str]) -> dict[int, list[_Holder]]:
    """id(param) -> its holders in walk order, its source first ([Note:
    initializing unit by unit])."""
    holders: dict[int, list[_Holder]] = {}
    seen: set[tuple[int, str]] = set()
    for call in calls:
        for attr, param in call.module._parameters.items():
            if param is None or (id(call.module), attr) in seen:
                continue
            seen.add((id(call.module), attr))
            name = f"{call.name}.{attr}" if call.module is not model else attr
            holders.setdefault(id(param), []).append(
                _Holder(call.module, attr, name, call.unit, param))
    for hs in holders.values():
        source = next((h for h in hs if h.name not in targets), hs[0])
        hs.sort(key=lambda h: h is not source)   # stable: the others keep their order
    return holders


def plan_init(model: nn.Module, unit_modules=None) -> "InitPlan":
    """Check that ``model`` (built on the meta device) can be initialized by
    its own init, unit by unit; ValueError naming what cannot, before anything
    is stored.

    Every parameter must be on the meta device (a model with values is
    attached without ``init=True``) and belong to a module with an init: a
    Hugging Face ``_init_weights`` above it, or its own ``reset_parameters``.
    """
    kind = type(model).__name__
    valued = [n for n, p in model.named_parameters() if not p.is_meta]
    if valued:
        raise ValueError(
            f"init=True initializes a model built on the meta device, and {kind} has "
            f"parameters with values ({listed(valued)}): attach it without init=True "
            "(its values are used), or build it under `with torch.device(\"meta\"):`")
    blocks = unit_roots(model, unit_modules)
    calls, targets = _walk(model, {id(b): i + 1 for i, b in enumerate(blocks)})
    first: dict[int, _Call] = {}
    for call in calls:
        seen = first.setdefault(id(call.module), call)
        if seen.unit != call.unit:
            raise ValueError(
                f"init=True: module {call.name!r} is also {seen.name!r}, in another unit; "
                "init=True initializes unit by unit: pass unit_modules= so that they are "
                "one unit")
    bare = [c.name for c in calls
            if c.owner is None and _reset(c.module) is None
            and any(p is not None for p in c.module._parameters.values())]
    if bare:
        raise ValueError(
            f"init=True: {kind} has no initialization for the parameters of {listed(bare)} "
            "(no Hugging Face _init_weights above them, no reset_parameters of their own); "
            "give those modules a reset_parameters, or build the model on the CPU, or "
            "pass weights=PATH")
    for call in calls:
        if (why := call.adapters_unsupported()) is not None:
            raise ValueError(f"init=True: {why}")
    names = {id(p): n for n, p in model.named_parameters()}
    meta_buffers = list({(id(m), attr): (m, attr, f"{mn}.{attr}" if mn else attr)
                         for mn, m in model.named_modules(remove_duplicate=False)
                         for attr, b in m._buffers.items()
                         if b is not None and b.is_meta}.values())
    return InitPlan(model, calls, _holders(model, calls, targets), names, meta_buffers)


@dataclass
class InitPlan:
    """How a meta model is initialized unit by unit; made by :func:`plan_init`.

    Example:
        >>> plan = plan_init(meta_model)                                      # doctest: +SKIP
        >>> plan.load_buffers()           # its meta buffers, on the CPU      # doctest: +SKIP
        >>> stored, kept = plan.store(store, keys, torch.bfloat16, torch.device("cuda"))  # doctest: +SKIP
    """

    model: nn.Module
    calls: list[_Call]                        # walk order
    holders: dict[int, list[_Holder]]         # id(param) -> its holders, the source first
    names: dict[int, str]                     # id(param) -> its name (as named_parameters)
    meta_buffers: list[tuple[nn.Module, str, str]]
    replaced: ReplacedBuffers = field(default_factory=ReplacedBuffers)
    #: units whose frozen parameters stay on the device (:func:`kept_units`)
    keep: frozenset[int] = frozenset()

    def load_buffers(self) -> None:
        """Give the meta buffers, on the CPU, the values the model's init
        computes ([Note: buffers of a meta model] in ``tierd.client.weights``);
        undone by :meth:`restore_buffers`."""
        if self.meta_buffers:
            by_module = {id(c.module): c for c in self.calls}
            self.replaced.recreate(self.model, self.meta_buffers,
                                   lambda module: by_module[id(module)].run())

    def restore_buffers(self) -> None:
        """Put back the buffers :meth:`load_buffers` replaced (a failed attach)."""
        self.replaced.restore()

    def store(self, client: Store, keys: ModelKeys, compute_dtype: torch.dtype,
              device: torch.device, *, keep: frozenset[int] = frozenset()
              ) -> tuple[frozenset[str], dict[nn.Parameter, torch.Tensor]]:
        """Initialize and store every parameter, unit by unit ([Note:
        initializing unit by unit]); returns the keys stored: each
        parameter's, in the compute dtype, and an fp32 master where the
        compute dtype is lower than the model's ([Note: masters made when
        first needed] in ``tierd.client.registry``); and the frozen
        parameters of the units ``keep`` (:func:`kept_units`), never stored:
        the model's meta parameter -> its value in the compute dtype, on
        ``device`` ([Note: frozen weights kept only on the device] in
        ``tierd.client.kept_frozen``). On any failure the keys stored are deleted
        and the model holds its meta parameters again."""
        walk = _Walk(self, client, keys, compute_dtype, device, keep)
        try:
            walk.run()
        except BaseException:
            walk.undo()
            raise
        return frozenset(walk.stored), walk.kept

    def unit_sizes(self, compute_dtype: torch.dtype) -> list[tuple[int, list]]:
        """Each unit with parameters (the rest first, then the blocks: the
        registry's units) and its parameters' sizes for
        :meth:`~tierd.client.placement.UnitBytes.sized`."""
        sizes: dict[int, list] = {}
        for hs in self.holders.values():
            p = hs[0].param
            dtype = compute_dtype if p.is_floating_point() else p.dtype
            sizes.setdefault(hs[0].unit, []).append(
                (p.numel() * dtype.itemsize, p.numel(), p.requires_grad,
                 p.requires_grad and dtype != torch.float32))
        return sorted(sizes.items())


def kept_units(plan: InitPlan, compute_dtype: torch.dtype, budget: int) -> frozenset[int]:
    """The units whose compute copies the first step's plan, estimated from
    sizes within ``budget`` device bytes, keeps on the device ([Note: the
    plan before a step is measured] in ``tierd.client.placer``): their frozen
    parameters are kept there at init, never stored."""
    sized = plan.unit_sizes(compute_dtype)
    units = [UnitBytes.sized(i, params) for i, (_, params) in enumerate(sized)]
    places = plan_placement(units, budget).places
    return frozenset(sized[i][0] for i, place in places.items() if place is not Place.STREAM)


class _Walk:
    """One run of :meth:`InitPlan.store`: which holders hold device tensors now."""

    def __init__(self, plan: InitPlan, client: Store, keys: ModelKeys,
                 compute_dtype: torch.dtype, device: torch.device,
                 keep: frozenset[int] = frozenset()) -> None:
        self.plan = plan
        self.keep = keep   # units whose frozen parameters stay on the device
        self.kept: dict[nn.Parameter, torch.Tensor] = {}
        self.client = client
        self.keys = keys
        self.compute_dtype = compute_dtype
        self.device = device
        self.stored: list[str] = []
        self.pending: list[str] = []   # a batch being put: some of it may be stored
        self.by_place = {(id(h.module), h.attr): h for hs in plan.holders.values() for h in hs}
        # a write to a meta parameter is a write lost ([Note: initializing unit by unit])
        self.versions = {pid: hs[0].param._version for pid, hs in plan.holders.items()}
        self.modules_of: dict[int, list[nn.Module]] = {}   # block -> its modules
        for call in plan.calls:
            if call.unit != _REST and call.module not in self.modules_of.get(call.unit, ()):
                self.modules_of.setdefault(call.unit, []).append(call.module)
        self.held: list[_Holder] = []   # holders holding a device tensor now

    def run(self) -> None:
        calls = self.plan.calls
        with torch.no_grad():
            for i, call in enumerate(calls):
                if call.unit == _REST:
                    self._materialize([call.module])
                elif i == 0 or calls[i - 1].unit != call.unit:   # a block begins
                    self._materialize(self.modules_of[call.unit])
                call.run()
                if call.unit != _REST and (i + 1 == len(calls) or calls[i + 1].unit != call.unit):
                    self._finish(call.unit)
            self._finish(_REST)
        moved = [self.plan.names[pid] for pid, hs in self.plan.holders.items()
                 if hs[0].param._version != self.versions[pid]]
        if moved:
            raise ValueError(
                f"init=True: {type(self.plan.model).__name__}'s init wrote parameters "
                f"{listed(moved)} while their unit was not on the device (an init of a "
                "module outside their unit); pass unit_modules= so that the module and the "
                "parameters it initializes are one unit")

    def _materialize(self, modules: list[nn.Module]) -> None:
        """Give the holders in ``modules`` device tensors, NaN where the dtype
        has it (what the init leaves NaN it did not set): a source the one to
        store, any other holder (a tie target) scratch."""
        for module in modules:
            for attr, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue   # held already
                value = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                if value.is_floating_point():
                    value.fill_(float("nan"))
                module._parameters[attr] = nn.Parameter(value, requires_grad=param.requires_grad)
                self.held.append(self.by_place[(id(module), attr)])

    def _finish(self, unit: int) -> None:
        """Store the parameters whose source is in ``unit``, then put the meta
        parameters back in its holders (the device tensors go)."""
        done = [h for h in self.held if h.unit == unit]
        values: dict[str, torch.Tensor] = {}
        dtypes: dict[str, torch.dtype] = {}
        floats: dict[str, torch.Tensor] = {}   # name -> value, checked for NaN
        kept: dict[nn.Parameter, torch.Tensor] = {}
        for holder in done:
            if self.plan.holders[id(holder.param)][0] is not holder:
                continue   # a tie target: its scratch goes
            value = holder.module._parameters[holder.attr]
            name = self.plan.names[id(holder.param)]
            if value.is_floating_point():
                floats[name] = value
            dtype = self.compute_dtype if value.is_floating_point() else value.dtype
            if unit in self.keep and not value.requires_grad:
                kept[holder.param] = value.detach().to(dtype)   # never stored
                continue
            values[self.keys.param(name)], dtypes[self.keys.param(name)] = value, dtype
            if value.requires_grad and dtype != torch.float32 and value.dtype != dtype:
                values[self.keys.master(name)] = value
                dtypes[self.keys.master(name)] = torch.float32
        unset = [n for n, bad in zip(floats, torch.stack(
            [v.isnan().any() for v in floats.values()]).tolist()) if bad] if floats else []
        if unset:
            raise ValueError(
                f"init=True: {type(self.plan.model).__name__}'s init leaves parameters "
                f"{listed(unset)} (all or part) unset (their values come from __init__ "
                "only); build the "
                "model on the CPU, or pass weights=PATH")
        if values:
            self.pending = list(values)
            self.client.put_many(values, dtypes=dtypes)
            self.stored.extend(self.pending)
            self.pending = []
        self.kept.update(kept)
        self._release(done)

    def _release(self, holders: list[_Holder]) -> None:
        for holder in holders:
            holder.module._parameters[holder.attr] = holder.param
        self.held = [h for h in self.held if h not in holders]

    def undo(self) -> None:
        """A failed walk: the meta parameters back in every holder, every key
        stored deleted (the batch being put one key at a time: a delete of an
        absent key fails)."""
        self._release(list(self.held))
        self.kept.clear()
        for keys in (self.stored, *([k] for k in self.pending)):
            if keys:
                with contextlib.suppress(Exception):   # the store may be what failed
                    self.client.delete(keys)
