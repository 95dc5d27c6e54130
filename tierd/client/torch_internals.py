"""Every private torch API tierd relies on, behind one named function each.

torch gives no public way to do these things, and a torch release may change
any of them. Keeping them here means one file to read when upgrading torch,
and ``tests/client/test_torch_internals.py`` fails loudly (naming the API)
when a release breaks one, instead of a training step failing somewhere deep.

What each is for:
- ``current_graph_task``: tells a forward re-run inside backward (activation
  checkpointing) from an ordinary forward, and groups the work of one
  backward pass.
- ``queue_engine_callback``: runs code when the current backward pass ends
  (FSDP2 uses the same engine call for its post-backward).
- ``storage_id``: identity of a tensor's ``StorageImpl``; views and ``.data``
  of a tensor share it, so it finds parameters and saved activations by
  their bytes.
- ``checkpoint_without_reentrant``: the generator behind
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, driven from
  module hooks so a block is recomputed without wrapping its ``forward``.
- ``tree_flatten`` / ``tree_map``: the tensors inside an op's (nested)
  arguments, found or replaced (a parameter read between uses,
  ``tierd.client.values``).
- ``StorageRef``: a weak reference to a storage that says when it is freed.
- ``fused_adamw``: the one-pass AdamW kernel behind
  ``torch.optim.AdamW(fused=True)``; the update of parameters whose state is
  on a CUDA device, in one read and one write of each tensor.
  ``foreach_adamw``: torch's single-tensor AdamW as ``torch._foreach_*``
  kernels, the same ops in the same order (bitwise on the CPU).
- ``is_compiled_module``: tells a ``torch.compile``'d module (attach refuses it).
- ``dynamo_reset`` / ``dynamo_graph_breaks`` / ``dynamo_frames_compiled``: the
  benchmarks count graph breaks, and the frames compiled after warm-up
  (recompiles). ``compiled_regions_run``: the compiled frames one call runs
  (a forward split at every block runs one per block).
- ``forget_compiled_code``: dynamo does not guard on module hooks, so code
  traced before tierd changed a unit's hooks must be traced again
  ([Note: hooks under torch.compile] in ``tierd.client.hooks``).
- ``free_pinned_host_cache``: gives the caching host allocator's pinned
  memory back (the activation benchmark measures host memory).
- ``allocator_settings`` / ``set_allocator_settings``: the caching
  allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``'s syntax), read and
  changed while the process runs ([Note: expandable segments] in
  ``tierd.client.device_allocator``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.utils.checkpoint
from torch.multiprocessing.reductions import StorageWeakRef as StorageRef
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["StorageRef", "allocator_settings", "checkpoint_without_reentrant", "compiled_regions_run",
           "current_graph_task", "dynamo_frames_compiled", "dynamo_graph_breaks", "dynamo_reset",
           "foreach_adamw", "forget_compiled_code", "free_pinned_host_cache", "fused_adamw",
           "in_backward", "in_torch_machinery", "is_compiled_module", "queue_engine_callback",
           "set_allocator_settings", "storage_id", "tree_flatten", "tree_map"]


def current_graph_task() -> int:
    """Id of the autograd graph task running on this thread; -1 outside backward."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """True inside a backward pass (a forward run now is a checkpoint's re-run)."""
    return current_graph_task() != -1


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished all its nodes.

    Only valid inside backward (from a hook that autograd runs)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_torch_machinery() -> bool:
    """Dynamo is tracing, or a torch dispatch mode is active (fake tensors,
    AOT autograd's checks): code of torch's own, which expects plain tensors."""
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def weak_hook(method: Callable) -> Callable:
    """A tensor hook that calls the bound ``method`` without keeping its
    object alive. torch holds a tensor's hooks from C++, out of the garbage
    collector's sight, so a hook whose object holds the tensor (an attach
    session holds its parameters) made a cycle never collected: a model
    dropped without ``detach`` stayed in memory with its session. (A plain
    ``weakref.ref`` of the object, not a ``WeakMethod``: dynamo traces the
    former, and a module hook runs inside compiled forwards.)"""
    owner, func = weakref.ref(method.__self__), method.__func__

    def hook(*args):
        target = owner()
        return None if target is None else func(target, *args)
    return hook


def storage_id(t: torch.Tensor) -> int:
    """Identity of ``t``'s StorageImpl (the same for its views and ``.data``)."""
    return t.untyped_storage()._cdata


def checkpoint_without_reentrant(module: torch.nn.Module, *args: Any,
                                 **kwargs: Any) -> Generator[None, None, None]:
    """Start non-reentrant checkpointing of one call of ``module``: call
    ``next()`` on the result before the call runs and again after it returns.
    Activations saved in between are dropped and recomputed in backward."""
    return torch.utils.checkpoint._checkpoint_without_reentrant_generator(
        module, True, torch.utils.checkpoint.noop_context_fn, "default",
        False, True, *args, **kwargs)


def fused_adamw(params: list[torch.Tensor], grads: list[torch.Tensor],
                exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                step: float, lr: float, beta1: float, beta2: float, weight_decay: float,
                eps: float, maximize: bool) -> None:
    """One AdamW step of every tensor in place, as ``torch.optim.AdamW(fused=True)``
    takes it at step count ``step`` (already counted): bitwise that optimizer's.

    The step count is made on the device by a fill kernel: ``torch.tensor(step,
    device=cuda)`` copies from pageable memory, which waits for the compute
    stream, and this runs inside backward once per bucket (that wait starved
    the GPU of backward kernels: 23 ms of a 0.26 s GPT-2 1.3B step)."""
    steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)]
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps * len(params),
                        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=maximize)


def foreach_adamw(params: list[torch.Tensor], grads: list[torch.Tensor],
                  exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor], *,
                  step: float, lr: float, beta1: float, beta2: float, weight_decay: float,
                  eps: float, maximize: bool) -> None:
    """One AdamW step in place as foreach kernels, op for op
    ``torch.optim.AdamW(foreach=False)``'s line (bitwise it on the CPU)."""
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def is_compiled_module(module: Any) -> bool:
    """``module`` is what ``torch.compile(m)`` returned (an OptimizedModule)."""
    dynamo = sys.modules.get("torch._dynamo")   # imported by anything compiled
    return dynamo is not None and isinstance(module, dynamo.eval_frame.OptimizedModule)


def dynamo_reset() -> None:
    """Forget every compiled graph and dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()


def dynamo_graph_breaks() -> int:
    """Graph breaks dynamo counted since :func:`dynamo_reset`."""
    from torch._dynamo.utils import counters
    return sum(counters["graph_break"].values())


def dynamo_frames_compiled() -> int:
    """Frames dynamo was asked to compile since :func:`dynamo_reset`.

    Dynamo is asked only when a frame has no cached code whose guards pass:
    its first call, or a recompile (a guard failed). Once a loop is warm, a
    rise in this count is a recompile (or a frame never run before), each a
    compile paid inside a step. torch keeps no counter of recompiles as such
    (``counters["frames"]["total"]`` is the count of these requests)."""
    from torch._dynamo.utils import counters
    return counters["frames"]["total"]


def forget_compiled_code() -> None:
    """Make dynamo trace every frame again at its next call: the code it
    compiled, and the frames it marked to run eagerly (a graph break inside a
    loop marks the loop's whole function so, for good). Dynamo does not guard
    on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``, on
    by default): code traced before a hook was added or removed runs as
    traced. Does nothing where dynamo was never imported (nothing compiled)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset_code_caches()


#: the profiler's name for a run of a dynamo-compiled frame ("... 3/0")
_COMPILED_REGION = "Torch-Compiled Region: "


def compiled_regions_run(fn: Callable[[], Any]) -> int:
    """Call ``fn`` once under the profiler (host events only) and count the
    dynamo-compiled frames it ran: 1 for a model compiled into one graph,
    about one per block for a forward split at its blocks."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith(_COMPILED_REGION))


def free_pinned_host_cache() -> bool:
    """Give the caching host allocator's unused pinned memory back to the OS
    (False where this torch has no call for it, or there is no CUDA)."""
    if not torch.cuda.is_available():
        return False
    for owner, name in ((getattr(torch, "accelerator", None), "empty_host_cache"),
                        (torch._C, "_host_emptyCache")):
        fn = getattr(owner, name, None)
        if fn is not None:
            fn()
            return True
    return False


def allocator_settings() -> str | None:
    """The caching allocator's settings as ``PYTORCH_CUDA_ALLOC_CONF`` spells
    them (those changed while running included); None where this torch
    cannot say."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return get() if get is not None else None


def set_allocator_settings(settings: str) -> None:
    """Change the caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``'s
    syntax, e.g. ``"expandable_segments:True"``) while the process runs; the
    segments it makes from then on follow them."""
    set_ = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_ is None:   # torch before the accelerator-wide allocator config
        set_ = torch.cuda.memory._set_allocator_settings
    set_(settings)
