"""The hooks that drive an AttachSession: registered once per attach, handles kept.

Each hook body is one call into the :class:`~tierd.client.parts.StepEvents`
it is given (the attached session) and the registry; the reasoning about
*when* parameters move is [Note: units and when parameters are resident] in
``tierd.client.attached``. No torch function is patched; only public
``nn.Module`` / autograd hook APIs are used.

Hooks sit on the modules of units only ([Note: units are the model's
blocks] in ``tierd.client.registry``): the root module's pre-hook begins a
step; a unit's pre-hook fetches it and puts its compute tensors into its
modules, its post-hook puts the tensors for between uses back and registers
its pre-backward. A unit placed whole on the device has no hook at all
(:meth:`ModuleHooks.sync`): its modules hold plain parameters for good,
unless an optimizer update of it waits for its forward ([Note: updates
before the next forward] in ``tierd.updates.forward``): its pre-hook then waits
for that update and puts the parameters back.

[Note: hooks under torch.compile]
Hook bodies move storage, take leases and read clocks: dynamo cannot trace
them. So each hook first asks ``torch.compiler.is_compiling()`` (a constant
while dynamo traces, so the check costs no break) and, while traced, calls
its body through ``torch.compiler.disable``: a graph break at the unit's
boundary, then the body eagerly. Units are whole blocks, so a compiled
step breaks at block boundaries only, and a block's own code (compiled per
block, or as part of the model) sees its compute tensors, whose identity
never changes: no recompile after warm-up. A unit that placement keeps on
the device loses its hooks, so a model that fits compiles to one graph (the
root's begin-step hook, at the very start, is the only break).
Dynamo cannot resume after a break inside a loop: a model whose blocks run
in a loop (Hugging Face's ``for layer in self.layers``) and whose streamed
units have hooks runs that loop eagerly, one compiled frame per block, as
regional compile does. Dynamo marks the loop's function so for good, and
it does not guard on module hooks (``skip_nnmodule_hook_guards``: code runs
as first traced), so code traced with hooks that placement has removed
since (the first step's plan estimated from sizes, a plan changed) kept
that split, and code traced before hooks were added would not call them.
So every change of the units' hooks (:meth:`ModuleHooks.sync`, detach)
makes dynamo trace again (``forget_compiled_code``: every compiled frame of
the process is traced again once). Placement changes hooks while it
settles, when memory forces a new plan, and for inputs larger than any
measured (streamed to be measured, then placed: two traces).
``attach(torch.compile(m))`` is refused: the compiled wrapper hides the
model's modules behind ``_orig_mod``; compile after attaching.

[Note: hooks outside a block compiled in place]
A block compiled in place (``block.compile()``: regional compile) runs its
module hooks inside its compiled call, so tierd's broke its graph twice,
and each hooked block ran three compiled frames a forward instead of one
(on the CPU, a tiny Llama of 4 blocks whose updates wait for their
forward: 12 frames a warm step instead of 4; the 8B Llama capped at 100 GB
on the H200 ran 92 frames a step against all-GPU's 64, dd0fce3). There
the unit's hooks are not registered on the module: its compiled call is
wrapped (:class:`_HooksOutside`) to run them eagerly before and after it,
as the hooks of a module wrapped by ``torch.compile(block)`` run outside
its frame. A compiled call the user replaces later is wrapped again at the
next step's begin (:meth:`ModuleHooks.sync`). The modules whose hooks
begin a step (the root, the step's entry) keep module hooks: the step must
begin before their unit is entered.

[Note: a step begins where the model is entered]
A step begins at the root's forward. A wrapper's other methods may call the
model it wraps without its own forward: peft's ``PeftModelForCausalLM.generate``
calls the wrapped ``LlamaForCausalLM.generate``, which calls that model's
forward. Without a step begun, placement never measured one and every unit
streamed for every generated token. So the innermost module every forward
runs through (:func:`step_entry`: the lowest common ancestor of the modules
holding parameters) begins a step too when it is called while no forward of
the root runs; within the root's forward it does nothing (the root began
the step). Only a model whose entry is not the root has these hooks.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierd.client.parts import StepEvents
from tierd.client.registry import ParamRegistry, Unit
from tierd.client.optimizers import TierdOptimizer
from tierd.client.tiered_param import MOVED_ATTR, tiered_of
from tierd.client.torch_internals import (forget_compiled_code, is_compiled_module,
                                          tree_flatten, weak_hook)
from tierd.errors import StateError

def refuse_compiled(model: nn.Module) -> None:
    """``attach(torch.compile(m))`` is refused: see [Note: hooks under torch.compile]."""
    if is_compiled_module(model):
        raise TypeError(
            "tierd.attach got a torch.compile'd module; attach first, then compile: "
            "model = torch.compile(tierd.attach(model)) (tierd's hooks move parameters "
            "at block boundaries, which the compiled model must call out to)")


class ModuleHooks:
    """Owns every hook handle of one attached model; :meth:`remove` undoes them all.

    ``events`` gets one call per hook; ``counters.hook_seconds`` adds up the
    hooks' host time (the benchmark reports it as the overhead of a step).

    Example:
        >>> hooks = ModuleHooks(model, registry, session, session.counters)   # doctest: +SKIP
        >>> hooks.sync()                   # after placement: hooks on streamed units only  # doctest: +SKIP
        >>> hooks.remove()                 # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, registry: ParamRegistry, events: StepEvents,
                 counters) -> None:
        self._model = model
        self._events = events
        self._counters = counters
        self._registry = registry
        self._handles: list[Any] = []
        # unit index -> its hooks ([Note: hooks outside a block compiled in place])
        self._unit_handles: dict[int, _ModuleHooked | _HooksOutside] = {}
        self._depth: dict[int, int] = {}   # unit index -> forwards of it running now
        self._post_handles: list[Any] = []   # post-backward hooks of the step begun last
        self._loading: list[tuple[nn.Module, str]] = []   # holders swapped for a load
        self._handles.append(model.register_forward_pre_hook(self._begin_step, with_kwargs=True))
        entry = step_entry(model)
        self._begins = {id(model), id(entry)}   # modules whose hooks begin a step
        self._root_calls = 0   # forwards of the root running now
        #: whether the step begun last entered the model compiled whole
        #: (``torch.compile(model)``; [Note: a model compiled whole] in
        #: tierd.client.placer)
        self.compiled_whole = False
        if entry is not model:   # [Note: a step begins where the model is entered]
            self._handles += [
                model.register_forward_pre_hook(self._enter_root),
                model.register_forward_hook(self._leave_root, always_call=True),
                entry.register_forward_pre_hook(self._begin_entered_step, with_kwargs=True)]
        # what a traced hook calls out to, run eagerly (wrapped here, not at
        # import: torch.compiler.disable imports dynamo, ~1 s)
        self._begin_step_out = torch.compiler.disable(self._begin_step_body)
        self._enter_out = torch.compiler.disable(self._enter)
        self._leave_out = torch.compiler.disable(self._leave)
        self.sync()
        for module in model.modules():
            if any(p is not None for p in module._parameters.values()):
                self._handles.append(module.register_state_dict_post_hook(
                    self._state_dict_hook()))
                self._handles.append(module.register_load_state_dict_pre_hook(
                    self._load_pre_hook))
                self._handles.append(module.register_load_state_dict_post_hook(
                    self._load_post_hook))
            # an instance attribute, removed at detach: refuse conversions up front
            object.__setattr__(module, "_apply", _ConversionGuard(module))
        _refuse_other_optimizers()
        # before autograd accumulates into p.grad: take the views off
        # ([Note: gradients users touch] in tierd.client.grad_view)
        for tp in registry.params.values():
            if tp.param.requires_grad:
                for tensor in (tp.param, tp.outside):
                    self._handles.append(tensor.register_hook(weak_hook(self._gradient_arrives)))

    @property
    def hooked_units(self) -> int:
        """Units with hooks now: they stream something, or an update waits
        for their forward (:meth:`sync`)."""
        return len(self._unit_handles)

    def sync(self) -> set[int]:
        """Hooks on every unit that streams something, none on the others
        (placed whole on the device); code compiled before a change is traced
        again ([Note: hooks under torch.compile]). Returns the units hooked
        now."""
        changed, hooked_now = False, set()
        # a unit kept whole whose optimizer update waits for its forward
        # ([Note: updates before the next forward] in tierd.updates.forward)
        waits = self._events.forward_waits()
        for unit in self._registry.units:
            module = self._registry.unit_modules[unit.index]
            handles = self._unit_handles.get(unit.index)
            wanted = bool(unit.params) or unit.index in waits
            if handles is not None and not (wanted and handles.fits(module)):
                self._unit_handles.pop(unit.index).remove()
                changed = True
            if wanted and unit.index not in self._unit_handles:
                self._unit_handles[unit.index] = (
                    _HooksOutside(self, module) if _compiled_in_place(module)
                    and id(module) not in self._begins else _ModuleHooked(self, module))
                changed = True
                if handles is None:
                    hooked_now.add(unit.index)
        if changed:
            forget_compiled_code()
        return hooked_now

    def _drop_post_backward(self) -> None:
        """The last step's post-backward hooks off the tensors that outlive it
        (an input the caller passes again); a graph's own tensors drop theirs."""
        for handle in self._post_handles:
            handle.remove()
        self._post_handles.clear()

    def remove(self) -> None:
        self._drop_post_backward()
        for handle in self._handles:
            handle.remove()
        for handles in self._unit_handles.values():
            handles.remove()
        self._handles.clear()
        self._unit_handles.clear()
        for module in self._model.modules():
            module.__dict__.pop("_apply", None)
        forget_compiled_code()   # no compiled frame may call the hooks of a detached model

    # Hook entry points: what dynamo traces ([Note: hooks under torch.compile]).
    def _begin_step(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        if torch.compiler.is_compiling():   # the root traced: compiled whole
            self._begin_step_out(input_signature(args, kwargs), True)
        else:
            hooked_now = self._begin_step_body(input_signature(args, kwargs), False)
            unit = self._registry.unit_of.get(id(module))
            if unit is not None and unit.index in hooked_now:
                # streamed again (placement), the module that begins the step
                # got its hooks after torch took this call's list: enter it here
                self._pre_forward(module, args, kwargs)

    def _enter_root(self, module: nn.Module, args: Any) -> None:
        self._root_calls += 1

    def _leave_root(self, module: nn.Module, args: Any, output: Any) -> None:
        self._root_calls -= 1

    def _begin_entered_step(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        if self._root_calls == 0:   # called directly, not from the root's forward
            self._begin_step(module, args, kwargs)

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: dict | None = None) -> None:
        # kwargs None: the root's step hook just removed this hook (its unit
        # placed whole); torch still calls it, from the list it took before,
        # without kwargs
        if torch.compiler.is_compiling():
            self._enter_out(module)
        else:
            self._enter(module)
            self._register_post_backward(module, (args, kwargs or {}))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            self._leave_out(module, output)
        else:
            self._leave(module, output)

    # Every body adds its host time to counters.hook_seconds.
    def _begin_step_body(self, signature: tuple, compiled: bool) -> set[int]:
        t0 = time.perf_counter()
        self.compiled_whole = compiled
        self._drop_post_backward()
        self._events.begin_step(signature)
        hooked_now = self.sync()   # placement may have kept units whole, or streamed them again
        self._counters.hook_seconds += time.perf_counter() - t0
        return hooked_now

    def _enter(self, module: nn.Module) -> None:
        t0 = time.perf_counter()
        unit = self._registry.unit_of[id(module)]
        if self._events.waits_for_update(unit):
            self._events.update_before_forward(unit)
        if not unit.params:   # placed whole by this step's placement, its hook still called
            self._counters.hook_seconds += time.perf_counter() - t0
            return
        self._events.pre_forward(unit)
        depth = self._depth.get(unit.index, 0)
        if depth == 0:
            self._registry.install(unit, running=True)
        self._depth[unit.index] = depth + 1
        self._counters.hook_seconds += time.perf_counter() - t0

    def _leave(self, module: nn.Module, output: Any) -> None:
        t0 = time.perf_counter()
        unit = self._registry.unit_of[id(module)]
        if not unit.params:
            return
        depth = self._depth.get(unit.index, 1) - 1
        self._depth[unit.index] = depth
        if depth == 0:
            self._registry.install(unit, running=False)
        self._events.post_forward(unit)
        self._register_pre_backward(unit, output)
        self._counters.hook_seconds += time.perf_counter() - t0

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        self._events.gradient_arrives()

    def _pre_backward_of(self, unit: Unit) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            t0 = time.perf_counter()
            self._events.pre_backward(unit)
            self._counters.hook_seconds += time.perf_counter() - t0
        return hook

    def _post_backward_of(self, unit: Unit) -> Callable[[Any], None]:
        backwards = self._counters.backwards

        def hook(grads: Any) -> None:
            if self._counters.backwards != backwards:
                return   # a later backward reached an input kept since (a leaf reused)
            t0 = time.perf_counter()
            self._events.post_backward(unit)
            self._counters.hook_seconds += time.perf_counter() - t0
        return hook

    def _register_post_backward(self, module: nn.Module, inputs: Any) -> None:
        """[Note: frozen parameters freed after their unit's backward] in
        tierd.client.attached: only for units with frozen parameters streamed."""
        if not torch.is_grad_enabled():
            return
        unit = self._registry.unit_of[id(module)]
        if not unit.params or all(tp.param.requires_grad for tp in unit.params):
            return
        tensors = [t for t in tree_flatten(inputs)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # fires once per backward, when every input's gradient is computed,
            # i.e. after every backward node between the unit's outputs and inputs
            self._post_handles.append(torch.autograd.graph.register_multi_grad_hook(
                tensors, self._post_backward_of(unit), mode="all"))

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled() or not unit.params:
            return
        tensors = [t for t in _output_tensors(output) if t.requires_grad]
        if tensors:
            # fires once per backward, when the first output gradient arrives,
            # i.e. before any backward node inside the unit runs
            torch.autograd.graph.register_multi_grad_hook(
                tensors, self._pre_backward_of(unit), mode="any")

    def _state_dict_hook(self):
        # a fresh function per module: torch tags the hook object it is given
        def hook(module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: dict) -> None:
            self._events.fill_state_dict(module, state_dict, prefix)
        return hook

    # load_state_dict: torch copies each value into the tensor the module
    # holds; a resident parameter's module holds its device copy, so for the
    # load it holds the parameter's TieredParameter, whose copy_ writes every
    # copy of the value (tierd.client.values), and gets its device copy back after.
    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
        for attr, param in module._parameters.items():
            tp = tiered_of(param)
            if tp is not None:
                module._parameters[attr] = tp.outside
                self._loading.append((module, attr, tp))

    def _load_post_hook(self, module: nn.Module, incompatible: Any) -> None:
        for held in [h for h in self._loading if h[0] is module]:
            self._loading.remove(held)
            _, attr, tp = held
            param = module._parameters[attr]
            module._parameters[attr] = tp.between_uses
            if tiered_of(param) is None:   # load_state_dict(assign=True) put its own
                self._events.write_values({tp: param.detach()})


def _compiled_in_place(module: nn.Module) -> bool:
    """``module.compile()`` was called on it (a compiled call is set)."""
    return getattr(module, "_compiled_call_impl", None) is not None


class _ModuleHooked:
    """A unit's hooks registered on its module (not compiled in place)."""

    def __init__(self, hooks: ModuleHooks, module: nn.Module) -> None:
        self.handles = (
            module.register_forward_pre_hook(hooks._pre_forward, with_kwargs=True),
            module.register_forward_hook(hooks._post_forward, always_call=True))

    def fits(self, module: nn.Module) -> bool:
        return not _compiled_in_place(module)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _HooksOutside:
    """A unit compiled in place: its compiled call, with the unit's hooks
    run eagerly before and after it ([Note: hooks outside a block compiled
    in place])."""

    def __init__(self, hooks: ModuleHooks, module: nn.Module) -> None:
        self.hooks, self.module = hooks, module
        self.compiled = module._compiled_call_impl
        module._compiled_call_impl = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.hooks._pre_forward(self.module, args, kwargs)
        output = None
        try:
            output = self.compiled(*args, **kwargs)
        finally:   # as a forward hook registered with always_call
            self.hooks._post_forward(self.module, args, output)
        return output

    def fits(self, module: nn.Module) -> bool:
        return module._compiled_call_impl is self

    def remove(self) -> None:
        if self.module._compiled_call_impl is self:
            self.module._compiled_call_impl = self.compiled


class _ConversionGuard:
    """``module._apply`` of an attached model's modules (``.half()``,
    ``.double()``, ``.to(...)``, ``.cuda()``, ``.cpu()``): a conversion that
    would change a parameter's dtype or device raises StateError before
    anything changes; one that changes nothing runs (a Trainer moving the
    model to its device)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __call__(self, fn: Callable, recurse: bool = True):
        module = self._module
        tensors = list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse))
        for t in tensors:
            probe = torch.empty(0, dtype=t.dtype, device=t.device)
            with torch.no_grad():
                got = fn(probe)
            if isinstance(got, torch.Tensor) and (got.dtype != t.dtype or got.device != t.device):
                raise StateError(
                    f"{type(module).__name__}: converting an attached model to "
                    f"{got.dtype} on {got.device} (it is {t.dtype} on {t.device}); its "
                    "values live in tierd. Choose the dtype with attach(model, "
                    "compute_dtype=...) and the device with attach(model, device=...), "
                    "or tierd.detach(model) first")
        return nn.Module._apply(module, fn, recurse)


#: other optimizers seen: (param groups then, a message if it must not step)
_OTHER_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHECKING_OPTIMIZERS: list = []   # the global step pre-hook's handle, once registered


def _refuse_other_optimizers() -> None:
    """Once per process: a torch optimizer's step() over an attached model's
    parameters (their values live in tierd), or over the Parameters that
    attach replaced (an optimizer built before attach), raises StateError
    instead of doing nothing useful."""
    if not _CHECKING_OPTIMIZERS:
        _CHECKING_OPTIMIZERS.append(
            register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(opt, args, kwargs) -> None:
    if isinstance(opt, TierdOptimizer) or isinstance(getattr(opt, "optimizer", None),
                                                     TierdOptimizer):
        return   # a tierd optimizer, or a wrapper of one (accelerate's AcceleratedOptimizer)
    groups = len(opt.param_groups)
    known = _OTHER_OPTIMIZERS.get(opt)
    if known is None or known[0] != groups:
        known = (groups, _problem(opt))
        _OTHER_OPTIMIZERS[opt] = known
    if known[1]:
        raise StateError(known[1])


def _problem(opt) -> str | None:
    name = f"{type(opt).__module__}.{type(opt).__name__}"
    for p in (p for g in opt.param_groups for p in g["params"]):
        if tiered_of(p) is not None:
            return (f"{name} cannot update an attached model's parameters (their values "
                    "live in tierd); use tierd.optim.AdamW or tierd.optim.SGD, built after "
                    "tierd.attach")
        moved = getattr(p, MOVED_ATTR, None)
        if moved is not None:
            return (f"{name} was built before tierd.attach: it holds the model's old "
                    f"parameters (e.g. {moved!r}), which attach emptied, so its step() "
                    "would change nothing; build the optimizer after attaching: "
                    "opt = tierd.optim.AdamW(model.parameters(), ...)")
    return None


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output: in containers torch's pytree knows
    (tuples, dicts, Hugging Face ``ModelOutput``) and one level into the
    attributes of another object (a ``SimpleNamespace``, a plain dataclass)."""
    leaves = tree_flatten(output)[0]
    found = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not found:
        for leaf in leaves:
            fields = getattr(leaf, "__dict__", None)
            if isinstance(fields, dict):
                found += [t for t in tree_flatten(list(fields.values()))[0]
                          if isinstance(t, torch.Tensor)]
    return found


def step_entry(model: nn.Module) -> nn.Module:
    """The innermost module every forward of ``model`` runs through: the
    lowest common ancestor of the modules holding parameters (or the nearest
    above it with a forward of its own: a ``ModuleList`` has none). It is
    ``model`` for most models; for a wrapper such as peft's ``PeftModel``,
    the model it wraps ([Note: a step begins where the model is entered])."""
    paths = [name.split(".") if name else [] for name, m in model.named_modules()
             if any(p is not None for p in m._parameters.values())]
    if not paths:
        return model
    common = paths[0]
    for path in paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] == path[n]:
            n += 1
        common = common[:n]
    while common:
        module = model.get_submodule(".".join(common))
        if type(module).forward is not nn.Module.forward:
            return module
        common = common[:-1]
    return model


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor arguments: a change means a new batch or length."""
    return tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor))
