"""The hooks that drive an AttachSession: registered once per attach, handles kept.

Each hook body is one call into :class:`tierd.client.attached.AttachSession`; the
reasoning about *when* parameters move is in the Note there. No torch
function is patched; only public ``nn.Module`` / autograd hook APIs are used,
and for the first forward a dispatch mode (below).

[Note: parameters read without a call]
A unit's parameters are made resident by its own module's hooks. Some modules
read a child's parameters without calling the child: ``nn.MultiheadAttention``
hands ``out_proj.weight`` and ``.bias`` to ``F.multi_head_attention_forward``,
and ``nn.TransformerEncoderLayer``'s inference fast path hands the weights of
all its children to one fused op. The child's hooks never fire, its storage
is still empty when the op runs, and torch fails ("storage of size 0").

So the first root forward runs under a dispatch mode (:class:`UseProbe`) that
looks at the tensor arguments of every aten op. An op given a non-resident
parameter (or a view or ``.data`` of one: same storage) that is not on the
device is a read no running unit holds: in forward a unit's parameters are
on the device exactly while a forward of that unit runs. The probe folds that
parameter into the unit of the innermost module running (making a unit if the
module owns no parameter; ``ParamRegistry.fold_into``) and makes the unit resident
before the op runs. From then on that module's pre-forward, its pre-backward
(the first gradient of its outputs arrives before any backward node inside
it, among them the ones that read the folded parameter) and its forward
re-run by activation checkpointing bring the folded parameters with its own,
and its post-forward frees them with its own. A child that is also called
keeps its own unit; the mover counts holds, so neither frees the other's.

Why this way:
- Which child's forward is never called cannot be known before a forward
  runs. Folding every child not called in the first forward, without watching
  the reads, would also fold children that are merely unused then: an MoE
  expert no token was routed to would be fetched with its layer every step.
  Watching reads folds only what is read (MultiheadAttention: out_proj's
  weight and bias; a module applying ``child.weight`` alone leaves
  ``child.bias`` in the child's unit).
- Watching costs a Python call per aten op, so it lasts one forward. Until
  then every module has forward hooks (any may turn out to read a child);
  at the next root forward the hooks of modules that are no unit are
  removed, and the hot path is what it was: hooks on units only.
- The planner learned from units whose byte counts changed (its window keeps
  leases under a quarter of the pool), so if anything was folded it is
  rebuilt at that next root forward and learns again over that step.
Limits: a read only on a code path the first root forward did not take, or
only when a submodule is called directly, fails as before. A folded
parameter stays on the device for the whole forward of the module it was
folded into (for the root: the whole forward).
"""

from __future__ import annotations

import contextlib
import enum
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierd.client.registry import Unit
from tierd.client.tiered_param import ParamState, TieredParam, TieredParameter
from tierd.client.torch_internals import (DispatchMode, is_compiled_module, storage_id,
                                          tree_flatten, weak_hook)
from tierd.errors import StateError


class ProbeState(enum.Enum):
    """Where the first-forward probe is (see [Note: parameters read without a call]).

    ARMED: attached, no root forward yet; every module has forward hooks.
    PROBING: inside the first root forward; the probe's dispatch mode is on
        the mode stack and folds reads that no running unit holds.
    DONE: the first root forward ended; the next one rebuilds the planner if
        anything was folded and removes the hooks of modules that are no unit.
    """

    ARMED = "armed"
    PROBING = "probing"
    DONE = "done"


class _ReadWatch(DispatchMode):
    """Hands the arguments of every aten op to the probe before the op runs."""

    def __init__(self, probe: UseProbe) -> None:
        super().__init__()
        self._probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._probe.on_op(args, kwargs)
        return func(*args, **kwargs)


class UseProbe:
    """Watches the first root forward for parameters read outside their unit
    and folds them into the unit of the module reading them.

    Example:
        >>> probe = UseProbe(session); probe.start()   # doctest: +SKIP
        >>> probe.enter(model); model.forward(x); probe.leave(model)   # doctest: +SKIP
        >>> probe.state, probe.folded                  # doctest: +SKIP
        (<ProbeState.DONE: 'done'>, 2)
    """

    def __init__(self, session) -> None:
        self._session = session
        self._names = {id(m): name or "<root>" for name, m in session.model.named_modules()}
        self._by_storage: dict[int, TieredParam] = {}
        self._running: list[nn.Module] = []   # modules whose forward runs, innermost last
        self._mode = _ReadWatch(self)
        self._paused = False
        self.folded = 0   # folds made (none: the units and the planner are unchanged)
        self.state = ProbeState.ARMED

    def start(self) -> None:
        """ARMED -> PROBING: the first root forward begins."""
        if self.state is not ProbeState.ARMED:
            raise StateError(f"the first-forward probe cannot start: it is {self.state.name}, "
                             "start needs ARMED")
        # keyed by StorageImpl: views and .data of a parameter share it
        self._by_storage = {storage_id(tp.param): tp
                            for tp in self._session.params.values() if not tp.resident}
        self._mode.__enter__()
        self.state = ProbeState.PROBING

    def skip(self) -> None:
        """ARMED -> DONE: the first root forward is compiled (see [Note: hooks
        under torch.compile]); nothing is watched, nothing folded."""
        if self.state is not ProbeState.ARMED:
            raise StateError(f"the first-forward probe cannot be skipped: it is "
                             f"{self.state.name}, skip needs ARMED")
        self.state = ProbeState.DONE

    def stop(self) -> None:
        """PROBING -> DONE (at the end of the root forward, or at detach)."""
        if self.state is not ProbeState.PROBING:
            return
        self._mode.__exit__(None, None, None)
        self._running.clear()
        self._by_storage = {}
        self.state = ProbeState.DONE

    def enter(self, module: nn.Module) -> None:
        if self.state is ProbeState.PROBING:
            self._running.append(module)

    def leave(self, module: nn.Module) -> None:
        if self.state is not ProbeState.PROBING:
            return
        assert self._running and self._running[-1] is module, "unbalanced forward hooks"
        self._running.pop()
        if not self._running:
            self.stop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run by tierd itself (copies into parameters) are not reads."""
        self._paused, was = True, self._paused
        try:
            yield
        finally:
            self._paused = was

    def on_op(self, args: tuple, kwargs: dict) -> None:
        if self._paused or not self._running:
            return
        t0 = time.perf_counter()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                tp = self._by_storage.get(storage_id(t))
                if tp is not None and tp.state is not ParamState.DEVICE:
                    self._fold(tp)
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _fold(self, tp: TieredParam) -> None:
        module = self._running[-1]
        unit = self._session.registry.fold_into(module, self._names[id(module)], [tp])
        self.folded += 1
        # Inside the dispatch handler the mode is off: these copies are not seen.
        self._session.mover.require(unit)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (children of an ``nn.ModuleList``, outermost only),
    where hooks sit under torch.compile (see [Note: hooks under torch.compile])."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        for child in module.children():
            blocks.append(child)
            inside.update(id(m) for m in child.modules())
    return blocks


def refuse_compiled(model: nn.Module) -> None:
    """``attach(torch.compile(m))`` is refused: see [Note: hooks under torch.compile]."""
    if is_compiled_module(model):
        raise TypeError(
            "tierd.attach got a torch.compile'd module; attach first, then compile: "
            "model = torch.compile(tierd.attach(model)) (tierd's hooks move parameters "
            "at block boundaries, which the compiled model must call out to)")


class ModuleHooks:
    """Owns every hook handle of one attached model; :meth:`remove` undoes them all.

    [Note: hooks under torch.compile]
    Hook bodies move storage, take leases and read clocks: dynamo cannot trace
    them, and a hook it cannot trace breaks the graph where it is called. So
    every body runs behind ``torch.compiler.disable`` (a break, then the body
    eagerly), and where the break happens is chosen, as FSDP2 does with
    per-block compile: each hook first asks ``torch.compiler.is_compiling()``
    (a constant while dynamo traces, so the check itself costs no break).
    While traced, the hooks of units inside a repeated block (a child of an
    ``nn.ModuleList``) do nothing; the block's own hooks, at its boundary,
    make all of its units resident before it and release them after it, and
    register the pre-backward of them all. A compiled step thus breaks at
    block boundaries and at units outside blocks (embeddings, the head), never
    inside a block. Eager runs are unchanged (per-unit hooks; block hooks
    return at once). The first-forward probe is a dispatch mode, which dynamo
    does not trace through: a compiled first forward skips it (a block holds
    all of its parameters anyway). ``attach(torch.compile(m))`` is refused:
    the compiled wrapper hides the model's modules behind ``_orig_mod`` and
    would trace the probe's first forward. Not supported: compiling a module
    inside a block on its own (its units' hooks are traced away while its
    block, run eagerly, holds nothing); compile the model or whole blocks.

    Example:
        >>> hooks = ModuleHooks(session)   # doctest: +SKIP
        >>> hooks.remove()                 # doctest: +SKIP
    """

    def __init__(self, session) -> None:
        self._session = session
        self._handles: list[Any] = []
        self._forward_handles: dict[int, tuple[Any, ...]] = {}   # id(module) -> its forward hooks
        self._probe: UseProbe | None = UseProbe(session)
        model = session.model
        # The root's one pre-hook begins the step, then makes the root's unit
        # resident (if it has one: looked up per call, as folding may make one).
        self._handles.append(model.register_forward_pre_hook(self._begin_step, with_kwargs=True))
        for module in model.modules():
            # every module until the first forward has shown which are units
            handles = (module.register_forward_hook(self._post_forward, always_call=True),)
            if module is not model:
                handles += (module.register_forward_pre_hook(self._pre_forward),)
            self._forward_handles[id(module)] = handles
        # what a compiled forward calls out to: the bodies, run eagerly (wrapped
        # here, not at import: torch.compiler.disable imports dynamo, ~1 s)
        self._begin_step_out = torch.compiler.disable(self._begin_step_body)
        self._pre_forward_out = torch.compiler.disable(self._pre_forward_body)
        self._post_forward_out = torch.compiler.disable(self._post_forward_body)
        self._block_out = torch.compiler.disable(self._block_body)
        self._compiled_step = False   # the root's forward is traced by dynamo
        self._in_block: set[int] = set()   # id(module) of every module inside a block
        for block in _blocks(model):
            self._in_block.update(id(m) for m in block.modules())
            self._handles += [block.register_forward_pre_hook(self._block_pre_forward),
                              block.register_forward_hook(self._block_post_forward,
                                                          always_call=True)]
        for module in model.modules():
            if any(p is not None for p in module._parameters.values()):
                self._handles.append(module.register_state_dict_post_hook(
                    self._state_dict_hook()))
            # on every module: the outermost one loaded refuses before any copy
            self._handles.append(module.register_load_state_dict_pre_hook(_refuse_load))
        _refuse_other_optimizers()
        # before autograd accumulates into p.grad: take the views off
        # ([Note: gradients users touch] in tierd.client.grad_view)
        for tp in session.params.values():
            if tp.param.requires_grad:
                self._handles.append(tp.param.register_hook(weak_hook(self._gradient_arrives)))

    def remove(self) -> None:
        if self._probe is not None:
            self._probe.stop()
        for handle in self._handles:
            handle.remove()
        for handles in self._forward_handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        self._forward_handles.clear()

    # Hook entry points: what dynamo traces ([Note: hooks under torch.compile]).
    # Eagerly each calls its body directly (no wrapper on the hot path).
    def _begin_step(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            self._begin_step_out(module, True, input_signature(args, kwargs))
        else:
            self._begin_step_body(module, False, input_signature(args, kwargs))

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self._pre_forward_body(module)
        elif id(module) not in self._in_block:
            self._pre_forward_out(module)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling():
            self._post_forward_body(module, output)
        elif id(module) not in self._in_block:
            self._post_forward_out(module, output)

    def _block_pre_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            self._block_out(module, None, True, entering=True)
        else:
            self._block_body(module, None, False, entering=True)

    def _block_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            self._block_out(module, output, True, entering=False)
        else:
            self._block_body(module, output, False, entering=False)

    # Every body adds its host time to session.counters.hook_seconds (the
    # benchmark reports it as the overhead share of a step).
    def _begin_step_body(self, module: nn.Module, compiled: bool, signature: tuple) -> None:
        t0 = time.perf_counter()
        self._compiled_step = compiled
        self._end_probe()
        self._session.begin_step(signature)
        if self._probe is not None and self._probe.state is ProbeState.ARMED:
            if compiled:   # dynamo does not trace through a dispatch mode
                self._probe.skip()
            else:
                self._probe.start()
        self._enter(module)
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _pre_forward_body(self, module: nn.Module) -> None:
        t0 = time.perf_counter()
        self._enter(module)
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _post_forward_body(self, module: nn.Module, output: Any) -> None:
        t0 = time.perf_counter()
        self._leave(module, output)
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _block_body(self, block: nn.Module, output: Any, compiled: bool, *,
                    entering: bool) -> None:
        # compiled: this hook was traced; or the whole step is (the hook's own
        # frame may have been left to run eagerly, the block's body still traced)
        if not (compiled or self._compiled_step):
            return
        t0 = time.perf_counter()
        unit_of = self._session.registry.unit_of
        units = list(dict.fromkeys(unit_of[id(m)] for m in block.modules() if id(m) in unit_of))
        for unit in units:
            if entering:
                self._session.pre_forward(unit)
            else:
                self._finish_forward(unit, output)
        self._session.counters.hook_seconds += time.perf_counter() - t0

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        self._session.grad_views.hide()

    def _pre_backward_of(self, unit: Unit):
        def hook(grad: Any) -> None:
            t0 = time.perf_counter()
            # unwatched: a backward may run inside the probed forward (autograd.grad)
            self._unwatched(self._session.pre_backward, unit)
            self._session.counters.hook_seconds += time.perf_counter() - t0
        return hook

    # ------------------------------------------------------------- bodies
    def _enter(self, module: nn.Module) -> None:
        if self._probe is not None:
            self._probe.enter(module)
        unit = self._session.registry.unit_of.get(id(module))
        if unit is not None and unit.params:   # a unit placed whole on the GPU needs nothing
            self._unwatched(self._session.pre_forward, unit)

    def _leave(self, module: nn.Module, output: Any) -> None:
        if self._probe is not None:
            self._probe.leave(module)   # the root's leave ends the probing
        unit = self._session.registry.unit_of.get(id(module))   # after folds in this forward
        if unit is not None and unit.params:
            self._unwatched(self._finish_forward, unit, output)

    def _finish_forward(self, unit: Unit, output: Any) -> None:
        self._session.post_forward(unit)
        self._register_pre_backward(unit, output)

    def _unwatched(self, action: Callable[..., None], *args: Any) -> None:
        """Run ``action`` with the probe's dispatch mode looking away."""
        probe = self._probe
        if probe is None or probe.state is not ProbeState.PROBING:
            action(*args)
            return
        with probe.paused():
            action(*args)

    def _end_probe(self) -> None:
        """After the first root forward: replan if anything was folded, keep
        forward hooks on units only (see [Note: parameters read without a call])."""
        probe = self._probe
        if probe is None or probe.state is not ProbeState.DONE:
            return
        if probe.folded:
            self._session.mover.replan()
        for key in [k for k in self._forward_handles if k not in self._session.registry.unit_of]:
            for handle in self._forward_handles.pop(key):
                handle.remove()
        self._probe = None

    def _register_pre_backward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            # fires once per backward, when the first output gradient arrives,
            # i.e. before any backward node inside the unit runs
            torch.autograd.graph.register_multi_grad_hook(
                tensors, self._pre_backward_of(unit), mode="any")

    def _state_dict_hook(self):
        # a fresh function per module: torch tags the hook object it is given
        def hook(module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: dict) -> None:
            self._session.fill_state_dict(module, state_dict, prefix)
        return hook


def _refuse_load(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    where = f"{type(module).__name__} {prefix}".strip()
    raise StateError(
        f"load_state_dict on an attached model ({where}): its parameters' values live in "
        "tierd. Load them before tierd.attach, attach a meta model with weights=PATH, or "
        "tierd.detach(model) first")


#: other optimizers seen: (param groups then, whether they hold an attached parameter)
_OTHER_OPTIMIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHECKING_OPTIMIZERS: list = []   # the global step pre-hook's handle, once registered


def _refuse_other_optimizers() -> None:
    """Once per process: a torch optimizer's step() over an attached model's
    parameters (their storage is empty between uses) raises StateError
    instead of writing through an empty storage."""
    if not _CHECKING_OPTIMIZERS:
        _CHECKING_OPTIMIZERS.append(
            register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(opt, args, kwargs) -> None:
    from tierd.optim.base import StreamedOptimizer   # tierd.optim imports this package
    if isinstance(opt, StreamedOptimizer) or isinstance(getattr(opt, "optimizer", None),
                                                        StreamedOptimizer):
        return   # a tierd optimizer, or a wrapper of one (accelerate's AcceleratedOptimizer)
    groups = len(opt.param_groups)
    known = _OTHER_OPTIMIZERS.get(opt)
    if known is None or known[0] != groups:
        known = (groups, next((p for g in opt.param_groups for p in g["params"]
                               if isinstance(p, TieredParameter)), None) is not None)
        _OTHER_OPTIMIZERS[opt] = known
    if known[1]:
        raise StateError(
            f"{type(opt).__module__}.{type(opt).__name__} cannot update an attached model's "
            "parameters (their values live in tierd); use tierd.optim.AdamW or "
            "tierd.optim.SGD, built after tierd.attach")


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor arguments: a change means a new batch or length."""
    return tuple(tuple(t.shape) for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor))
