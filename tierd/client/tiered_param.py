"""One managed parameter: where its bytes are, and the only ways that may change.

A :class:`TieredParam` has two tensors, as an FSDP2 parameter has a sharded
and an unsharded one ([Note: the two tensors of a parameter]):

- ``param``, a :class:`DeviceParameter`: a plain parameter on the compute
  device, what a unit's modules hold while the unit runs (and for good while
  it is resident). Its identity never changes (autograd, hooks and compiled
  code keep pointing at it); only its *storage* is allocated and freed.
- ``outside``, a :class:`TieredParameter`: what the modules hold between
  uses. It has no storage: any op on it reads the true value from the
  tiers, and an in-place op writes the new value into them.

[Note: the two tensors of a parameter]
Between uses the bytes of a streamed parameter are in the daemon, so the
tensor a module holds then cannot be the compute tensor with an empty
storage: any read of it (an EMA, a logged norm, ``print``) would read freed
memory and crash the process. So a unit's pre-forward puts ``param`` into
its modules (``module._parameters[name]``) and its post-forward puts
``outside`` back (FSDP2: ``to_unsharded()`` / ``to_sharded()``). Compiled
code and autograd only ever see ``param``; users between steps see
``outside``, whose ops go through ``__torch_dispatch__`` to the values
(``tierd.client.values``). A resident parameter's modules hold ``param`` for
good: its unit needs no hook, and its values are on the device anyway.

[Note: writes to a resident parameter]
A resident parameter's modules hold ``param`` itself, a plain tensor, so a
user's in-place op on it (``p.mul_(0.5)`` under no_grad) changes the device
copy only. tierd's own writes go through ``compute`` (``.data``: a version
counter of its own), so ``param._version`` moves only for a user's write;
:meth:`AttachSession.settle` compares it with ``seen_version`` and writes a
changed value into the store (and the fp32 master) before anything reads or
updates it. ``p.data`` of a resident parameter is its TieredParameter view
(``.data`` has a version counter of its own, so a write through it would go
unseen): the write goes to every copy at once.

[Note: frozen parameters]
A parameter that does not require grad (a LoRA base model, a frozen
embedding) costs its compute copy only: attach stores no fp32 master for it
and hooks no gradient, so no gradient key is made for it; an optimizer keeps
no state for it (as torch, which makes state on a gradient only); capacity
and placement count it at the compute dtype. ``requires_grad`` is one flag
for both tensors of the parameter: set on either (``p.requires_grad =
False``, ``p.requires_grad_()``, ``model.requires_grad_()``, peft's
``get_peft_model``), :meth:`TieredParam.set_requires_grad` sets both, so
the compute tensor a unit runs with never computes a gradient the user
froze. Frozen after attach, it keeps what it has (a made master holds its
exact value); attached frozen and then unfrozen, it gets the gradient
hooks then, and below fp32 compute a master made at its first update from
the stored compute copy, which is its exact value (or, resumed, the master
its commit holds). An optimizer built while
a parameter was frozen keeps no state for it: build the optimizer after
unfreezing, as torch's would only update it once it has a gradient.

[Note: why resize the storage instead of swapping ``.data``]
Autograd saves parameters (or views of them, e.g. ``weight.t()``) for the
backward pass. Those saved tensors share the parameter's ``StorageImpl``.
Freeing with ``untyped_storage().resize_(0)`` and refilling the *same* storage
before the backward op runs makes every saved view valid again, which is what
lets activation checkpointing recompute (and save) views of a parameter that
we evict right after. Swapping ``.data`` would leave the saved views pointing
at the old, freed tensor. FSDP2 frees its unsharded parameters the same way.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from tierd.client.keys import ModelKeys
from tierd.client.torch_internals import in_torch_machinery, weak_hook
from tierd.client.values import TieredParameter, assigns_itself, refuse_data_assignment
from tierd.errors import StateError

if TYPE_CHECKING:
    from tierd.client.copy_stream import CopyStream, InflightCopy


class GradState(enum.Enum):
    """Where a parameter's accumulated gradient is, on tierd's side (``p.grad``
    is a view of it: [Note: gradients users touch] in tierd.client.grad_view).

    NONE: no gradient since the last ``zero_grad``, or the update used it up
        (the pool's bytes under ``grad_key``, if the key exists, mean nothing).
    IN_POOL: the gradient summed over this window's backwards is in the pool
        under ``grad_key``; ``grad_norm`` is its L2 norm.
    ON_DEVICE: that sum is ``device_grad``, on the compute device, and not in
        the pool (the measuring step's kept units: [Note: the measuring step
        keeps its gradients on the device] in tierd.client.held_grads).
    """

    NONE = "none"
    IN_POOL = "in_pool"
    ON_DEVICE = "on_device"


class ParamState(enum.Enum):
    """Where a parameter's bytes live on the client side.

    HOST: the bytes are only in the daemon (pool or NVMe); the parameter's
        compute-device storage is freed (size 0).
    H2D_INFLIGHT: a copy pool -> compute device is queued on the copy stream;
        the storage is allocated but may not hold the bytes yet; the pool lease
        is held until the copy's event has completed.
    DEVICE: the storage holds the bytes; modules may use the parameter.
    """

    HOST = "host"
    H2D_INFLIGHT = "h2d_inflight"
    DEVICE = "device"


#: Set on a Parameter that attach replaced (the caller's old object, emptied):
#: the name of the parameter that took its place.
MOVED_ATTR = "_tierd_attached_as"


class DeviceParameter(nn.Parameter):
    """The compute tensor of a parameter: what a unit's modules hold while it
    runs ([Note: the two tensors of a parameter]); ``tiered`` is its manager.

    An ordinary parameter on the compute device (autograd accumulates its
    ``.grad``); between uses its storage is empty, and the modules hold the
    parameter's :class:`TieredParameter` instead.
    """

    tiered: "TieredParam"

    @property
    def data(self) -> torch.Tensor:
        # a resident one is what the model shows: writes through .data must
        # reach the store too ([Note: writes to a resident parameter])
        # ... but torch's own machinery (dynamo tracing, a dispatch mode such
        # as AOT autograd's check of a compiled graph's first call, which
        # reads a Parameter's .data) gets the plain tensor it expects
        if self.tiered.resident and not in_torch_machinery():
            return TieredParameter(self.tiered, parameter=False)
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value is not self and not assigns_itself(self.tiered, value):
            raise refuse_data_assignment(self.tiered.name)

    def requires_grad_(self, requires_grad: bool = True) -> "DeviceParameter":
        self.tiered.set_requires_grad(requires_grad)   # both tensors: [Note: frozen parameters]
        return self

    def __setattr__(self, name: str, value) -> None:
        if name == "requires_grad" and "tiered" in self.__dict__:
            self.tiered.set_requires_grad(value)
        else:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        if self.untyped_storage().nbytes() or not self.numel():
            return super().__repr__()
        return (f"DeviceParameter({self.tiered.name!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}: freed between uses)")


def tiered_of(tensor) -> "TieredParam | None":
    """The TieredParam behind either tensor of an attached parameter, else None."""
    if isinstance(tensor, (DeviceParameter, TieredParameter)):
        return tensor.tiered
    return None


class TieredParam:
    """Bookkeeping for one parameter: its keys, its state, its storage.

    Its keys (``tierd.client.keys``): ``key`` the value in compute dtype
    (what is copied in), ``master_key`` the fp32 master weights when the
    compute dtype is lower precision (the optimizer updates it, then
    refreshes ``key``; the same key in fp32), ``grad_key`` the gradient
    accumulated across backwards (created when first written to the pool) in
    ``grad_dtype`` ([Note: the stored gradient's dtype]).

    [Note: the stored gradient's dtype]
    A gradient is stored in its master's dtype, as torch keeps ``p.grad`` in
    ``p``'s: fp32, or bf16 where the bf16 compute copy is the master
    (``tierd.optim.AdamW(..., master="bf16")``, which sets ``grad_dtype`` when
    it is built). The first (measuring) step sums every trainable gradient in
    the store ([Note: placing before the first update] in
    tierd.client.placer), so this halves the largest thing a compact model
    stores: 2 + 2 B per parameter there instead of 2 + 4. The form is chosen
    while no gradient key exists and kept while one does; readers take the
    dtype from the stored key.
    """

    def __init__(self, *, name: str, keys: ModelKeys, param: DeviceParameter,
                 orig_dtype: torch.dtype, orig_device: torch.device,
                 resident: bool, session) -> None:
        self.name = name
        self.session = session   # the AttachSession that owns it
        self.param = param
        self.orig_dtype = orig_dtype
        self.orig_device = orig_device
        self.resident = resident
        # resident for good, for its size (``resident_below_bytes``) or as an
        # adapter ([Note: adapters stay on the device] in tierd.client.registry),
        # not by a plan ([Note: parameters resident for good keep their state
        # on the device] in tierd.updates.fused)
        self.resident_for_good = False
        self.key = keys.param(name)
        self.grad_key = keys.grad(name)
        # attach hooked its gradients (the registry and ModuleHooks hook every
        # parameter that requires grad then): it may train ([Note: frozen parameters])
        self.grad_hooked = param.requires_grad
        self.has_master = param.dtype != torch.float32 and param.requires_grad
        self.master_key = keys.master(name) if self.has_master else self.key
        # False while the fp32 master is the compute copy's exact upcast and was
        # not stored ([Note: masters made when first needed] in tierd.client.registry)
        self.master_made = True
        self.nbytes = param.numel() * param.element_size()
        self.grad_state = GradState.NONE
        # The grad key exists in the daemon (made on first use, see grads.py).
        self.grad_created = False
        self.grad_dtype = torch.float32   # [Note: the stored gradient's dtype]
        # Resident: the store's compute copy is older than the device's until
        # written back ([Note: kept weights are written when the store is read]
        # in tierd.updates.resident).
        self.stale_in_store = False
        # False: resident, and its device copy is its only copy ([Note: frozen
        # weights kept only on the device] in tierd.client.kept_frozen)
        self.in_store = True
        # resident, and an optimizer update of it waits for its unit's next
        # forward: its modules hold ``outside`` meanwhile ([Note: updates
        # before the next forward] in tierd.updates.forward)
        self.update_waits = False
        # IN_POOL, ON_DEVICE: the 0-dim L2 norm of the gradient (global clipping)
        self.grad_norm: torch.Tensor | None = None
        # ON_DEVICE: the summed gradient itself
        self.device_grad: torch.Tensor | None = None
        # Graph task that materialized it in backward (see Mover.free_task).
        self.backward_task = -1
        self._inflight: InflightCopy | None = None
        self.state = ParamState.DEVICE if resident else ParamState.HOST
        param.tiered = self
        self.outside = TieredParameter(self, parameter=True)
        # param's version counter when tierd last knew its values were stored
        self.seen_version = param._version

    @property
    def grad_nbytes(self) -> int:
        """Bytes of the stored gradient ([Note: the stored gradient's dtype])."""
        return self.param.numel() * self.grad_dtype.itemsize

    # ------------------------------------------------------------- training
    def set_requires_grad(self, requires_grad: bool) -> None:
        """Freeze or unfreeze the parameter: ``p.requires_grad = flag`` or
        ``p.requires_grad_(flag)`` on either of its tensors (peft freezes a base
        model that way) lands here, and both tensors take the flag
        ([Note: frozen parameters])."""
        requires_grad = bool(requires_grad)
        unfrozen = requires_grad and not self.grad_hooked
        if unfrozen and not self.in_store:
            raise StateError(
                f"making {self.name!r} trainable: init=True kept it frozen on the GPU "
                "only, with no copy in the store to make its fp32 master from "
                "([Note: frozen weights kept only on the device] in tierd.client.kept_frozen); "
                "set requires_grad before tierd.attach")
        if unfrozen and self.session.share is not None:
            raise StateError(
                f"making {self.name!r} trainable after tierd.attach under torch.distributed: "
                "the ranks agreed at attach on which parameters train (gradient "
                "reduction, owners); set requires_grad before tierd.attach on every rank")
        for tensor in (self.param, self.outside):
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.requires_grad.__set__(tensor, requires_grad)
        if unfrozen:
            self._make_trainable()

    def _make_trainable(self) -> None:
        """A parameter attached frozen starts to train: it gets the gradient
        hooks attach gives a trainable one and, below fp32 compute, an fp32
        master made from the stored compute copy at its first update (which
        is its exact value: [Note: masters made when first needed] in
        tierd.client.registry)."""
        session = self.session
        for tensor in (self.param, self.outside):
            tensor.register_post_accumulate_grad_hook(weak_hook(session.on_grad))
        self.hook_gradient_arrival()
        if self.param.dtype != torch.float32:
            self.has_master = True
            self.master_key = session.keys.master(self.name)
            # a resumed job's commit may hold the master the earlier run made
            self.master_made = self.master_key in session.registry.resumed_keys
        self.grad_hooked = True

    def hook_gradient_arrival(self) -> None:
        """Before autograd accumulates a gradient of either tensor, the session
        hears of it (what ModuleHooks hooks at attach for a trainable one:
        [Note: gradients users touch] in tierd.client.grad_view)."""
        for tensor in (self.param, self.outside):
            tensor.register_hook(weak_hook(self._gradient_arrives))

    def _gradient_arrives(self, grad: torch.Tensor) -> None:
        self.session.gradient_arrives()

    @property
    def compute(self) -> torch.Tensor:
        """``param``'s storage as a tensor of its own (``.data``): what tierd
        copies values into and out of, unseen by autograd and by
        ``seen_version`` ([Note: writes to a resident parameter])."""
        return torch.Tensor.data.__get__(self.param)

    @property
    def between_uses(self) -> torch.Tensor:
        """The tensor the modules hold between uses: ``param`` when resident
        and no update of it waits for the next forward ([Note: updates before
        the next forward] in tierd.updates.forward), else ``outside`` ([Note:
        the two tensors of a parameter])."""
        return self.param if self.resident and not self.update_waits else self.outside

    @property
    def value_key(self) -> str:
        """The key with its most precise stored value: the fp32 master once made."""
        return self.master_key if self.master_made else self.key

    def __repr__(self) -> str:
        return f"TieredParam({self.name!r}, {self.state.name}, {self.nbytes} B)"

    def _expect(self, *accepted: ParamState, action: str) -> None:
        if self.state not in accepted:
            names = "/".join(s.name for s in accepted)
            raise StateError(
                f"cannot {action} parameter {self.name!r}: it is {self.state.name}, "
                f"{action} needs {names}")

    # ----------------------------------------------------------- transitions
    def start_swap_in(self, source: torch.Tensor, keys: tuple[str, ...],
                      stream: CopyStream) -> InflightCopy:
        """HOST -> H2D_INFLIGHT: allocate the storage and queue the copy in.

        ``source`` is the leased pool view (or the fp32 master the optimizer
        fetched, see tierd.updates.fused); the returned copy keeps it (and the
        lease's keys) alive until :meth:`finish_swap_in`.
        """
        self._expect(ParamState.HOST, action="swap in")
        stream.allocate_for_copy_in(self.compute, self.nbytes)
        self._inflight = stream.copy_in_many([(self.compute, source)], keys)
        self.state = ParamState.H2D_INFLIGHT
        return self._inflight

    def finish_swap_in(self, stream: CopyStream) -> None:
        """H2D_INFLIGHT -> DEVICE: the compute stream waits on the copy's event."""
        self._expect(ParamState.H2D_INFLIGHT, action="finish swap-in of")
        stream.wait(self._inflight)
        self._inflight = None
        self.state = ParamState.DEVICE

    def adopt(self, value: torch.Tensor) -> None:
        """HOST -> DEVICE with ``value`` (already on the compute device, the
        same as the stored bytes), copied on the current stream."""
        self._expect(ParamState.HOST, action="adopt a value into")
        self.param.untyped_storage().resize_(self.nbytes)
        self.compute.copy_(value)
        self.state = ParamState.DEVICE

    def free(self) -> None:
        """DEVICE -> HOST: drop the compute-device storage; the pool has the bytes."""
        self._expect(ParamState.DEVICE, action="free")
        if self.resident:
            raise StateError(f"parameter {self.name!r} is resident; it is never freed")
        self.param.untyped_storage().resize_(0)
        self.backward_task = -1
        self.state = ParamState.HOST

    def make_resident(self, value: torch.Tensor) -> None:
        """HOST -> DEVICE for good (placement, [Note: the GPU is the first tier]):
        ``value`` (the stored bytes, in the pool) is copied in on the current
        stream and the storage stays between steps."""
        self._expect(ParamState.HOST, action="make resident")
        self.param.untyped_storage().resize_(self.nbytes)
        with torch.no_grad():
            self.compute.copy_(value)
        self.resident = True
        self.state = ParamState.DEVICE

    def make_streamed(self) -> None:
        """DEVICE (resident) -> HOST: the pool holds the current bytes again."""
        self._expect(ParamState.DEVICE, action="stream")
        if not self.resident:
            raise StateError(f"parameter {self.name!r} is not resident; nothing to stream")
        if self.stale_in_store or not self.in_store:
            raise StateError(f"parameter {self.name!r}: the store has an older value or none; "
                             "settle the session (write it back) before streaming it")
        self.resident = False
        self.free()

    # ------------------------------------------------------ gradient changes
    def to_gradient_in_pool(self, norm: torch.Tensor) -> None:
        """NONE/IN_POOL/ON_DEVICE -> IN_POOL: the pool holds the summed gradient
        (a bucket's write of it, its in-place changes replayed, or the device's
        sum written there), of L2 ``norm``."""
        self._drop_device_grad()
        self.grad_state = GradState.IN_POOL
        self.grad_norm = norm

    def to_gradient_on_device(self, grad: torch.Tensor, norm: torch.Tensor) -> None:
        """NONE/ON_DEVICE -> ON_DEVICE: ``grad`` (on the compute device) is the
        summed gradient, of L2 ``norm``; nothing of it is in the pool."""
        if self.grad_state is GradState.IN_POOL:
            raise StateError(f"the gradient of {self.name!r} is summed in the pool; "
                             "its later deliveries are summed there too")
        self.device_grad = grad
        self.grad_state = GradState.ON_DEVICE
        self.grad_norm = norm

    def to_no_gradient(self) -> None:
        """-> NONE: the update used the gradient, or ``zero_grad`` / ``p.grad =
        None`` forgot it."""
        self._drop_device_grad()
        self.grad_state = GradState.NONE
        self.grad_norm = None

    def _drop_device_grad(self) -> None:
        """Free an ON_DEVICE sum; the session's gradients hear of the bytes
        once they are free (the placer's peak reading counts them)."""
        if self.device_grad is None:
            return
        self.device_grad = None
        self.session.grads.dropped(self.grad_nbytes)

    @property
    def grad_in_pool(self) -> bool:
        """The summed gradient is in the pool (:attr:`GradState.IN_POOL`)."""
        return self.grad_state is GradState.IN_POOL

    @property
    def grad_on_device(self) -> bool:
        """The summed gradient is ``device_grad`` (:attr:`GradState.ON_DEVICE`)."""
        return self.grad_state is GradState.ON_DEVICE

    @property
    def has_gradient(self) -> bool:
        """tierd holds a summed gradient of this window, in the pool or on the device."""
        return self.grad_state is not GradState.NONE

    # ------------------------------------------------------------- queries
    @property
    def storage_bytes(self) -> int:
        """Bytes the parameter's own storage holds right now (0 when evicted)."""
        return self.param.untyped_storage().nbytes()
