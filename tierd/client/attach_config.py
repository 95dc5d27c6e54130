"""How an attached model uses the tiers: one config, composed of its parts'.

The activation part is :class:`tierd.client.activations.ActivationConfig`;
the mover's part (:class:`tierd.client.mover.MoverConfig`) is derived from
the budgets here once the pool size is known.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from tierd.client.activations import POLICIES, ActivationConfig
from tierd.client.mover import MoverConfig
from tierd.client.registry import unit_parameters
from tierd.config import parse_size

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_PLACEMENTS = ("gpu-stream", "cpu", "auto")
_GPU_TIERS = ("replicated", "sharded")


@dataclass(frozen=True, kw_only=True)
class AttachConfig:
    """How an attached model uses the tiers. Every field has a working default;
    byte counts may be given as sizes such as ``"512MiB"`` (as ``tierd serve``
    reads them).

    Example:
        >>> AttachConfig(compute_dtype="bf16", gpu_budget_bytes=4 << 30).compute_dtype
        torch.bfloat16
    """

    #: Compute device; ``None`` picks the current CUDA device, else the CPU.
    device: str | torch.device | None = None
    #: dtype the parameters have on the compute device ("fp32", "bf16",
    #: "fp16" or a torch dtype). Below fp32, fp32 master weights are kept in
    #: tierd and the optimizer updates those.
    compute_dtype: str | torch.dtype = torch.float32
    #: Device memory the attached model may use in all (bytes, or a float in
    #: (0, 1]: that fraction of the device's memory). None: on CUDA the memory
    #: free at attach, on the CPU no placement; 0: nothing stays on the device
    #: (every unit streams). Within it, after a measured first step, units
    #: whose tensors fit stay on the device between steps
    #: ([Note: the GPU is the first tier] in ``tierd.client.placement``).
    #: Under torch.distributed every rank places within the smallest of the
    #: ranks' values ([Note: one plan for every rank] in ``tierd.client.placer``).
    gpu_memory_bytes: int | float | None = None
    #: Most bytes of streamed parameters on the compute device at once, for
    #: prefetch (the unit running now is always fetched, even above it).
    gpu_budget_bytes: int = 2 << 30
    #: Bytes of upcoming parameters for which pool leases are requested
    #: ahead of use (brings NVMe-resident ones into the pool in time).
    prefetch_bytes: int = 512 << 20
    #: The share (in [0, 1)) of the optimizer state that streams through the
    #: device for its update whose update waits for the next forward, which
    #: moves it while the forward computes instead of in the backward
    #: ([Note: updates before the next forward] in ``tierd.updates.forward``).
    #: None (the default): ``FORWARD_SHARE`` on a GPU, none on the CPU (no
    #: PCIe to use); 0: every update in the backward.
    forward_update_share: float | None = None
    #: When the model's values exceed the daemon's pool, tell the daemon the
    #: step's order of use so it reads the units it cannot keep from NVMe
    #: ahead of their use and evicts the one used farthest ahead ([Note: the
    #: job's access plan] in ``tierd.server.readahead``). Off under
    #: torch.distributed (the ranks' steps share keys).
    read_ahead: bool = True
    #: Parameters smaller than this stay on the compute device all the time,
    #: on a GPU with their optimizer state: see
    #: tierd.updates.fused, [Note: parameters resident for good keep their state on the device].
    resident_below_bytes: int = 0
    #: On a GPU, outside torch.distributed: trainable parameters with at most
    #: 1/64 of the elements of a frozen one of their unit (LoRA's adapters)
    #: stay on the device with their optimizer state (tierd.client.registry:
    #: see [Note: adapters stay on the device]).
    resident_adapters: bool = True
    #: Where ``tierd.optim`` updates master weights and moments: "gpu-stream"
    #: (per block on the compute device), "cpu" (every unit whose state is
    #: not resident on the device: in place in the pool, on host threads,
    #: overlapped with backward) or "auto" (placement chooses per unit by
    #: measured cost; [Note: choosing CPU updates] in tierd.client.placement).
    optimizer_placement: str = "gpu-stream"
    #: The compact setting the optimizer will keep its state in
    #: (``tierd.optim.CompactState(state="8bit", master="bf16")``), counted by
    #: the capacity check and the embedded daemon's sizes at attach, before
    #: the optimizer exists; None counts fp32 AdamW ([Note: what the store
    #: holds for a model] in tierd.client.capacity). The optimizer's setting
    #: is its own: this only sizes.
    optimizer_state: object = None
    #: Keep lasting pool leases on the model's keys (compute-dtype params,
    #: then optimizer states) while they take at most this fraction of the
    #: pool: no daemon request per use. Above it, keys are leased per use and
    #: may spill to NVMe. 0 disables holding.
    hold_fraction: float = 0.5
    #: Gradients are written to the pool in buckets of about this many bytes.
    grad_bucket_bytes: int = 32 << 20
    #: Key prefix in the daemon (a random one when None); must be unique.
    name: str | None = None
    #: Which modules are units, each fetched before its forward and released
    #: after as one ([Note: units are the model's blocks] in
    #: ``tierd.client.registry``): a predicate on a module, or module types.
    #: None: the children of every outermost ``nn.ModuleList`` or
    #: ``nn.Sequential`` (a transformer's blocks); the rest is one more unit.
    unit_modules: object = None
    #: Tier what autograd saves in forward: an :class:`ActivationConfig`, or
    #: its policy alone ("offload", "recompute", "auto"); None leaves
    #: activations alone. See ``tierd.client.activations``.
    activations: ActivationConfig | str | None = None
    #: Under torch.distributed, how the ranks of a node keep the units placement
    #: puts whole on their GPUs: "replicated" (DDP's way: every rank keeps the
    #: unit's weights, master and moments, and runs the same update) or
    #: "sharded" (each unit's master and moments on its owner's GPU only: the
    #: owner updates, the other ranks get the new weights from it over the
    #: interconnect; [Note: resident state sharded by unit] in
    #: ``tierd.client.sharded``). Needs a process group.
    gpu_tier: str = "replicated"
    #: On CUDA, the caching allocator's segments made from attach on are
    #: expandable (grown and shrunk by pages), which spares a step near the
    #: cap the allocator's synchronizing retries ([Note: expandable
    #: segments] in ``tierd.client.device_allocator``). None (the default):
    #: unless the process's allocator settings (``PYTORCH_CUDA_ALLOC_CONF``)
    #: already name them; True: always; False: the allocator as it is.
    expandable_segments: bool | None = None

    def __post_init__(self) -> None:
        dtype = self.compute_dtype
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"compute_dtype={dtype!r} is unknown; use one of "
                                 f"{sorted(_DTYPES)} or a torch dtype")
            dtype = _DTYPES[dtype]
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype={dtype} is not a float compute dtype; "
                             "use torch.float32, torch.bfloat16 or torch.float16")
        object.__setattr__(self, "compute_dtype", dtype)
        for f in ("gpu_budget_bytes", "prefetch_bytes", "resident_below_bytes",
                  "grad_bucket_bytes"):
            object.__setattr__(self, f, _bytes(f, getattr(self, f)))
        share = self.forward_update_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 <= share < 1):
            raise ValueError(f"forward_update_share={share!r} must be a number in [0, 1) "
                             "(or None: the default)")
        if isinstance(self.gpu_memory_bytes, str):
            object.__setattr__(self, "gpu_memory_bytes",
                               _bytes("gpu_memory_bytes", self.gpu_memory_bytes))
        if self.name is not None and not (isinstance(self.name, str) and self.name):
            raise ValueError(f"name={self.name!r} must be a non-empty string (or None)")
        for f in ("read_ahead", "resident_adapters"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f}={getattr(self, f)!r} must be True or False")
        if isinstance(self.hold_fraction, bool) or not isinstance(self.hold_fraction,
                                                                   (int, float)):
            raise ValueError(f"hold_fraction={self.hold_fraction!r} must be a number in [0, 1]")
        cap = self.gpu_memory_bytes
        if cap is not None and (cap < 0 or (isinstance(cap, float) and not 0 < cap <= 1.0)):
            raise ValueError(f"gpu_memory_bytes={cap} must be a byte count >= 0 (0: stream "
                             "everything) or a fraction in (0, 1]; None uses the device "
                             "memory free at attach")
        if not 0.0 <= self.hold_fraction <= 1.0:
            raise ValueError(f"hold_fraction={self.hold_fraction} must be in [0, 1]")
        state = self.optimizer_state
        if state is not None and not all(callable(getattr(state, m, None))
                                         for m in ("master_in_compute", "moment_nbytes")):
            raise ValueError(f"optimizer_state={state!r} is not a compact setting; pass "
                             "tierd.optim.CompactState(state=..., master=...) as given to "
                             "tierd.optim.AdamW, or None (fp32 AdamW)")
        if self.optimizer_placement not in _PLACEMENTS:
            raise ValueError(f"optimizer_placement={self.optimizer_placement!r}; "
                             f"use one of {_PLACEMENTS}")
        if not (self.expandable_segments is None or isinstance(self.expandable_segments, bool)):
            raise ValueError(f"expandable_segments={self.expandable_segments!r} must be True, "
                             "False or None (on unless PYTORCH_CUDA_ALLOC_CONF names them)")
        if self.gpu_tier not in _GPU_TIERS:
            raise ValueError(f"gpu_tier={self.gpu_tier!r}; use one of {_GPU_TIERS}")
        units = self.unit_modules
        if isinstance(units, type):
            units = (units,)
        if isinstance(units, (tuple, list)):
            if not all(isinstance(u, type) and issubclass(u, torch.nn.Module) for u in units):
                raise ValueError(f"unit_modules={self.unit_modules!r}: give nn.Module "
                                 "subclasses, or a predicate taking a module")
            object.__setattr__(self, "unit_modules", tuple(units))
        elif units is not None and not callable(units):
            raise ValueError(f"unit_modules={units!r}: give nn.Module subclasses, a "
                             "predicate taking a module, or None (the model's blocks)")
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))
        if isinstance(self.activations, str):
            if self.activations not in POLICIES:
                raise ValueError(f"activations={self.activations!r}; use one of {POLICIES} "
                                 "or an ActivationConfig")
            object.__setattr__(self, "activations", ActivationConfig(policy=self.activations))
        elif self.activations is not None and not isinstance(self.activations, ActivationConfig):
            raise ValueError(f"activations={self.activations!r}; use a policy name "
                             f"{POLICIES[:-1]}, an ActivationConfig or None")

    def mover(self, lease_cap: int) -> MoverConfig:
        """The mover's part; leases asked ahead stay within ``lease_cap``."""
        return MoverConfig(gpu_budget_bytes=self.gpu_budget_bytes,
                           prefetch_bytes=min(self.prefetch_bytes, lease_cap))

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _bytes(field: str, value) -> int:
    """A byte count: an int, or a size such as "512MiB" as ``tierd serve`` reads them."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{field}={value!r} must be a byte count (an int, or a size such "
                         "as '512MiB')")
    try:
        n = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{field}={value!r}: {exc}") from None
    if n < 0:
        raise ValueError(f"{field}={value} must be >= 0")
    return n


def resolve_cap(device: torch.device, requested: int | float | None, *,
                warn: bool = True, leaving: int = 0) -> int | None:
    """Device bytes the attached model may use in all (None: no placement).

    ``requested``: bytes, a fraction of the device's memory, or None (on
    CUDA: the memory free at attach, counting as free the ``leaving`` bytes
    of the model's parameters on the device, which attach moves to the
    store). Above what is free: a warning (unless not ``warn``), and what is
    free is used."""
    if requested == 0:
        return None   # stream everything
    if device.type != "cuda":
        if isinstance(requested, float):
            raise ValueError(f"gpu_memory_bytes={requested} is a fraction of the device's "
                             f"memory, and {device} has none to measure: pass bytes")
        return requested
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) + leaving
    if requested is None:
        return free
    cap = int(requested * total) if isinstance(requested, float) else int(requested)
    if cap > free:
        if warn:
            warnings.warn(f"gpu_memory_bytes={requested} asks for {cap} bytes but {free} are free "
                          f"on {device}; using {free}", stacklevel=4)
        return free
    return cap


def check_cap(model: torch.nn.Module, config: AttachConfig, cap: int | None) -> None:
    """ValueError, before anything is stored, where an explicit ``cap`` is
    below what one unit ([Note: units are the model's blocks] in
    ``tierd.client.registry``: its parameters not kept on the device anyway,
    a tied one in the first unit holding it) needs on the device at once:
    its compute copy and fp32 optimizer state."""
    if not cap or config.gpu_memory_bytes is None:
        return
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    need, name = 0, ""
    for root, params in unit_parameters(model, config.unit_modules):
        nbytes = sum(p.numel() * ((config.compute_dtype if p.is_floating_point() else p.dtype)
                                  .itemsize + 12 * p.requires_grad)
                     for p in params
                     if p.numel() * p.element_size() >= config.resident_below_bytes)
        if nbytes > need:
            need, name = nbytes, names[id(root)]
    if cap < need:
        raise ValueError(
            f"gpu_memory_bytes={cap} is below what unit {name!r} needs on the device at "
            f"once (its compute copy and fp32 optimizer state: {need} bytes); a cap must "
            f"be at least {need} bytes, and more by the step's activations")
