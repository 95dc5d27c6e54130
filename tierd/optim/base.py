"""What every tierd optimizer shares: fused or deferred updates, leases, clipping.

The fp32 master weights (the ``p`` key itself when the compute dtype is fp32),
the optimizer's moments and the accumulated gradients all live in tierd;
``tierd.optim.AdamW(state=..., master=...)`` keeps moments and masters in
fewer bytes ([Note: compact optimizer state] in tierd.optim.compact).
Two ways to update, same math (:meth:`StreamedOptimizer._update`, copied from
torch's single-tensor implementation so fp32 results are bitwise equal):

- *fused* (the default where possible): during the backward that ends the
  accumulation window, each unit's parameters are updated on the compute
  device as soon as their gradients are final; ``step()`` then only closes
  the window. See [Note: fused update] in ``tierd.updates.fused``.
- *deferred*: gradients are summed into the pool during backward and
  ``step()`` walks the parameters block by block (about ``block_bytes``): one
  lease for the block's keys, the update on the compute device ("gpu-stream")
  or in place in the pool ("cpu"), then one release. Used for the first step
  (while the fused path learns the order), with ``max_grad_norm`` (the global
  norm needs every gradient first), with ``placement="cpu"`` under
  torch.distributed and with ``fused=False``. Fused with ``placement="cpu"``,
  the update runs on host threads in the pool, overlapped with backward
  ([Note: CPU updates overlapped with backward] in ``tierd.updates.cpu_update``).

[Note: gradients freed as they are used]
The first window is updated in ``step()`` with every gradient summed in the
store (fp32, 4 B/param), and its update makes the streamed units' masters and
moments (12 B/param). Kept until ``zero_grad`` as torch keeps ``p.grad``,
the gradients would sit in the store next to all that new state: at 15B
parameters 60 GB more than any later step needs, which is what bounded the
largest model. So where no later backward writes a gradient key (the fused
path consumes gradients inside backward: a window of one, not CPU-updated,
not under torch.distributed, no clipping through ``p.grad``), each block's
gradients are deleted as soon as its update has used them, and the streamed
blocks' state is made block by block just before its update. ``p.grad`` then
shows a consumed view until ``zero_grad``, as after every later (fused)
step. The price: a store too small for the state may fail part-way through
that first update rather than before it (placement refuses beforehand a plan
the store cannot hold, counting the freed gradients less an eighth kept as
working room: [Note: placement within the store] in tierd.client.placement);
the same ``step()`` again, with room, updates only the parameters whose
gradients are still there.

[Note: one block landing]
An update in ``step()`` goes block by block: lease its keys, copy them in,
update, copy the new state back into the pool, release once those copies
have landed. Done in series, the device idled while the host made the next
block's state and leased it, and the host idled while the device copied:
on an H100 the first update of GPT-2 1.3B capped at 48 GB took 1.41 s over
192 blocks, 0.73 s of it in synchronizes and ~0.7 s in round trips to the
daemon. So the next block is leased and queued while the last one's copies
out land (one block landing), and the state the streamed blocks lack is
made before the first update, in requests of up to ``_MAKE_BYTES``, where
the pool has room for it beside the gradients. Else the blocks go in
series, their state made block by block as the Note above says, and so do
two blocks whose leases together would pin more of the pool than the
session's ``lease_cap`` (what one block may pin): a lease that must wait
for pool room never waits on leases this loop holds. Moments made as
zeros are made on the device, not copied in. A block's copies back go on
the copy-out stream ([Note: two copy streams] in tierd.client.copy_stream):
on the compute stream, the next block's copies in queued behind them, and
PCIe carried one direction at a time (the 13B first update moved 67 GB in
and 78 GB out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tierd.client.grads import free_grads, unused_grads
from tierd.client.grad_view import replay
from tierd.client.optimizers import TierdOptimizer
from tierd.client.tiered_param import TieredParam, TieredParameter, tiered_of
from tierd.errors import CapacityError, StateError
from tierd.updates.cpu_update import overlapped
from tierd.updates.fused import FusedUpdates
from tierd.optim import state_dict as optim_state_dict
from tierd.optim.compact import CompactState
from tierd.optim.state import (UnmadeState, check_capacity, check_compact, format_key,
                               set_grad_forms)


def _nbytes(like: torch.Tensor) -> int:
    return like.numel() * like.element_size()


#: state made ahead of ``step()``'s first update a request at a time ([Note: one block landing])
_MAKE_BYTES = 1 << 30

#: the order of ``step()``'s blocks: resident with gradients on the device,
#: other resident, streamed
_HELD, _PINNED, _STREAMED = 0, 1, 2


@dataclass
class _Landing:
    """A block whose update :meth:`StreamedOptimizer._begin_block` queued:
    its leased keys, its parameters' resident state, and the event after its
    copies back into the pool and its reads (None: updated on the CPU)."""

    block: list[TieredParam]
    keys: list[str]
    resident: dict
    event: torch.cuda.Event | None
    nbytes: int   # what its leases may pin in the pool


def _release_landed(session, keys: list[str], on_device: bool) -> None:
    """Release ``keys`` once the copies into them queued so far have landed."""
    if on_device:
        torch.cuda.current_stream(session.device).synchronize()
        session.copy.synchronize()
    session.leases.release(keys, written=True)


def _resident_work(fused: list[FusedUpdates], tp: TieredParam) -> dict | None:
    """The device tensors of ``tp``'s state when placement keeps it on the
    GPU ([Note: resident optimizer state] in tierd.updates.resident); None when it streams."""
    for f in fused:
        work = f.resident_work(tp)
        if work is not None:
            return work
    return None


def _pinned(fused: list[FusedUpdates], tp: TieredParam) -> bool:
    """``tp``'s state is kept on the device by placement."""
    return any(f.bucket_of[tp].pinned for f in fused if tp in f.bucket_of)


def _on_host(fused: list[FusedUpdates], tp: TieredParam) -> bool:
    """``tp``'s state is updated on the CPU ([Note: CPU updates overlapped with
    backward] in tierd.updates.cpu_update)."""
    return any(f.bucket_of[tp].cpu for f in fused if tp in f.bucket_of)


def _ensure_stored(opt, tps: list[TieredParam]) -> frozenset[str]:
    """The state of streamed ``tps`` not made yet, stored for the update in
    ``opt.step()`` (``_step_param``): masters cast there, and the moments of
    those updated on the device made there; the moments put as zeros are
    returned."""
    return opt.unmade.ensure_stored(
        tps, cast_masters=True,
        on_device=frozenset(tp for tp in tps if _update_device(opt, tp).type != "cpu"))


def _update_device(opt, tp: TieredParam) -> torch.device:
    """Where ``opt.step()`` updates streamed ``tp``: on its compute copy's
    device where that is its master, else where updates run."""
    return tp.compute.device if opt.master_on_device(tp) else opt._compute_device(tp)


def _unregister(f: FusedUpdates) -> None:
    """Stop ``f`` fusing its optimizer's updates into backward."""
    f.host.close()      # CPU updates still running end first
    f.drop_resident()   # device-resident state goes back to the pool first
    f.settle()
    f.session.optimizers.remove(f)
    f.opt._fused.remove(f)


def _between_uses(params) -> list:
    """``params`` (tensors, or param groups) with each attached parameter as
    its TieredParameter, whichever of its two tensors the model showed
    ([Note: the two tensors of a parameter] in tierd.client.tiered_param):
    the optimizer's groups and state are keyed by it."""
    def one(p):
        tp = tiered_of(p)
        return p if tp is None else tp.outside
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=[one(p) for p in (
            [g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"])])
            for g in params]
    return [one(p) for p in params]


class StreamedOptimizer(torch.optim.Optimizer, TierdOptimizer):
    """Base class of ``tierd.optim.AdamW`` and ``tierd.optim.SGD``.

    ``max_grad_norm`` clips by the global L2 norm of all gradients exactly as
    ``torch.nn.utils.clip_grad_norm_(params, max_grad_norm)`` followed by
    ``step()`` would; the norm before clipping is kept in ``last_grad_norm``.
    Clipping uses the deferred path (correct, slower: gradients go through
    the pool). ``placement`` overrides the attach config's ``optimizer_placement``.

    ``fused`` (default: whenever there is no clipping, and for placement
    "cpu" not under torch.distributed) updates inside backward (with "cpu",
    on host threads). The window (backwards per step) is
    ``accumulation_steps``, or by default the length of the first window; a
    shorter window (the last of an epoch) is updated in ``step()``. Contract:
    no window is longer than that, and gradients are zeroed after ``step()``
    (``opt.zero_grad()`` or ``model.zero_grad()``); breaking it raises
    StateError rather than training wrong. A loop that changes gradients
    through ``p.grad`` (``torch.nn.utils.clip_grad_norm_``) from its first
    step on gets torch's result: tierd then updates in ``step()`` (see
    [Note: gradients users touch] in ``tierd.client.grad_view``).
    ``prefetch_bytes`` bounds the fp32 state kept in flight on the device
    (default: the attach config's ``gpu_budget_bytes``; at most a quarter of
    the pool, at least one unit).

    Example:
        >>> opt = tierd.optim.AdamW(model.parameters(), lr=1e-4)   # doctest: +SKIP
        >>> for i, batch in enumerate(loader):                     # doctest: +SKIP
        ...     (model(**batch).loss / 4).backward()
        ...     if (i + 1) % 4 == 0:
        ...         torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ...         opt.step(); opt.zero_grad()
    """

    #: names of the per-parameter state tensors this optimizer keeps in tierd
    state_names: ClassVar[tuple[str, ...]] = ()
    #: how moments and masters are kept ([Note: compact optimizer state] in
    #: tierd.optim.compact); exact fp32 unless a subclass is asked otherwise
    compact: CompactState = CompactState()

    def __init__(self, params, defaults: dict[str, Any], *, max_grad_norm: float | None = None,
                 block_bytes: int = 64 << 20, placement: str | None = None,
                 fused: bool | None = None, accumulation_steps: int | None = None,
                 prefetch_bytes: int | None = None) -> None:
        super().__init__(_between_uses(params), defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not isinstance(p, TieredParameter):
                    raise TypeError(
                        f"tierd.optim needs the parameters of an attached model; got a "
                        f"{type(p).__name__} of shape {tuple(p.shape)}. Call "
                        "tierd.attach(model) first and pass model.parameters() after it")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (or None: no clipping)")
        if placement not in (None, "gpu-stream", "cpu", "auto"):
            raise ValueError(f"placement={placement!r}; use 'gpu-stream', 'cpu', 'auto' or None")
        if accumulation_steps is not None and accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps} must be >= 1 "
                             "(or None: learned from the first window)")
        if fused and max_grad_norm is not None:
            raise ValueError("fused=True cannot clip by the global norm before every "
                             "gradient exists; leave fused=None (deferred when clipping)")
        self.max_grad_norm = max_grad_norm
        self.block_bytes = block_bytes
        self.placement = placement
        self.accumulation_steps = accumulation_steps
        #: gradients stay in the store every step, not only in the first
        #: ([Note: gradients freed as they are used])
        self.keeps_gradients = (max_grad_norm is not None or fused is False
                                or (accumulation_steps or 1) > 1)
        self.last_grad_norm: torch.Tensor | None = None
        self.needs_zero_grad = False
        # updated by a step() that then failed: the backward count they were
        # updated after (a retry before the next backward skips them)
        self._stepped: dict[TieredParam, int] = {}
        self._fused: list[FusedUpdates] = []
        #: its state not made yet ([Note: state made when first needed] in tierd.optim.state)
        self.unmade = UnmadeState(self)
        check_compact(self)    # before anything is read as this setting's format
        check_capacity(self)   # before an earlier optimizer is retired or a state written
        self._retire_earlier()
        set_grad_forms(self)
        self.unmade.create(self._owned())
        for session, tps in self._by_session(self._owned()).items():
            # "cpu" fuses too (on host threads) where they overlap backward
            can_fuse = (placement or session.config.optimizer_placement) != "cpu" \
                or overlapped(session)
            use = fused if fused is not None else max_grad_norm is None and can_fuse
            if use or can_fuse:   # not fusing: the buckets placement may keep resident
                self._register(session, tps, prefetch_bytes, fusing=bool(use))

    def step_counts(self, session) -> dict[str, torch.Tensor]:
        """Every parameter's step count of ``session`` as tensors to store at a
        commit, and a compact optimizer's setting ([Note: compact state on
        resume] in tierd.optim.compact)."""
        counts = {session.keys.step_count(tp.name):
                  torch.tensor(self.state[tp.outside].get("step", 0.0), dtype=torch.float64)
                  for tp in self._owned() if tp.session is session}
        if not self.compact.exact:
            counts[format_key(session)] = torch.tensor(list(self.compact.record.encode()),
                                                       dtype=torch.uint8)
        return counts

    def has_unfinished_step(self) -> bool:
        """A fused update ran in backward and ``step()`` has not closed the window."""
        return any(f.updated or f.active for f in self._fused)

    def _register(self, session, tps: list[TieredParam], prefetch_bytes: int | None, *,
                  fusing: bool) -> None:
        session.keep_late_adapters()   # before the buckets are made: theirs are small ones
        mine = set(tps)
        groups = [(g, [p.tiered for p in g["params"] if p.tiered in mine])
                  for g in self.param_groups]
        depth = session.config.gpu_budget_bytes if prefetch_bytes is None else prefetch_bytes
        depth = min(depth, session.lease_cap)   # leases in flight pin pool space
        fused = FusedUpdates(self, session, groups, depth, fusing=fusing)
        session.optimizers.append(fused)
        self._fused.append(fused)

    # ------------------------------------------------------------- API
    def state_dict(self) -> dict:
        """torch's format, with each parameter's state (moments, step count)
        read from tierd into new CPU tensors ([Note: optimizer state dicts]
        in tierd.optim.state_dict). ``tierd.commit`` checkpoints without
        copying it through this process."""
        self._check_attached()
        return optim_state_dict.state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` (or ``torch.optim.AdamW``/``SGD`` of the
        same model) returned: hyper-parameters as torch loads them, each
        parameter's state written into tierd. Checked whole first: a dict that
        does not fit raises StateError and changes nothing."""
        self._check_attached()
        optim_state_dict.load_state_dict(self, state_dict, super().load_state_dict)

    def loaded_step(self, entry: dict, name: str) -> float:
        """The step count of one parameter's entry in a loaded state dict."""
        if "step" not in entry:
            raise StateError(f"the state of {name!r} in the state dict has no 'step' (it has "
                             f"{sorted(entry)}); it is not a {type(self).__name__} state dict")
        return float(entry["step"])

    def _check_attached(self) -> None:
        detached = [tp for tp in self._all() if tp.session.closed]
        if detached:
            raise StateError(
                f"the model of this optimizer's parameters ({detached[0].name!r}...) was "
                "detached (tierd.detach): their values and state left tierd. Attach the "
                "model again and build a new tierd.optim optimizer on its parameters")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the accumulated gradients of this optimizer's parameters."""
        for session, tps in self._by_session(self._all()).items():
            session.zero_grad(tps)
        self.needs_zero_grad = False
        self._stepped.clear()
        for f in self._fused:   # the window starts again (after a step() that failed, say)
            if not f.active:
                f.backwards = 0

    @torch.no_grad()
    def step(self, closure=None):
        """Close the window: nothing left to do after a fused backward,
        otherwise update every parameter that has a gradient, block by block."""
        self._check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sessions = self._by_session(self._all())
        for session in sessions:
            session.grad_views.sync()   # a gradient whose p.grad was set to None is gone
        if any(f.updated for f in self._fused):
            for f in self._fused:
                f.after_step()
            self.needs_zero_grad = True
            self._finish_update()
            return loss
        # gradients changed through p.grad (clip_grad_norm_): the update must
        # stay in step() from now on ([Note: gradients users touch])
        touched = any(session.grad_views.any_ops() for session in sessions)
        frees = {} if touched else {s: set(unused_grads(s, tps)) for s, tps in sessions.items()}
        for session in sessions:
            # [Note: placing before the first update] in tierd.client.placer
            session.placer.before_update(list(frees.get(session, ())))
            # the update reads resident state on the device, not in the pool
            session.settle(write_resident=False)
        # (not the gradients of units placement just put on the CPU: written every step)
        frees = {s: set(unused_grads(s, list(tps))) for s, tps in frees.items()}
        for session, tps in sessions.items():   # kept after the update: from the pool
            session.grads.spill(tp for tp in tps if tp not in frees.get(session, ()))
        coef = self._clip_coef()
        # resident blocks first: their values leave the store, which makes room for
        # the state the streamed ones make ([Note: state made when first needed] in
        # tierd.optim.state); first of all those whose gradients the device holds,
        # their state made as those go ([Note: held gradients at the first update]
        # in tierd.client.held_grads)
        work = []
        for group in self.param_groups:
            tps = [p.tiered for p in group["params"] if p.tiered.has_gradient
                   and self._stepped.get(p.tiered) != p.tiered.session.counters.backwards]
            pinned = [tp for tp in tps if _pinned(self._fused, tp)]
            held = [tp for tp in pinned if tp.grad_on_device]
            work += [(_HELD, group, block) for block in self._blocks(held)]
            work += [(_PINNED, group, block) for block in self._blocks(
                [tp for tp in pinned if not tp.grad_on_device])]
            work += [(_STREAMED, group, block) for block in self._blocks(
                [tp for tp in tps if tp not in set(pinned)])]
        work.sort(key=lambda w: w[0])
        # before any update: resident state onto the device (its store keys go),
        # then what the others lack is made, so a store too full for it fails
        # with nothing updated; unless gradients go as they are used, which
        # needs less room ([Note: gradients freed as they are used])
        ahead = self._state_ahead(work, frees)
        zeroed: set[str] = set()   # state keys put as zeros by this step()
        try:
            making: list[TieredParam] = []
            for kind, _, block in work:
                if kind == _STREAMED and ahead:
                    making += block
                    if self.unmade.nbytes(making) >= _MAKE_BYTES:
                        zeroed |= _ensure_stored(self, making)
                        making = []
                elif kind == _PINNED:
                    for tp in block:
                        _resident_work(self._fused, tp)
            zeroed |= _ensure_stored(self, making)
        except BaseException as exc:   # nothing updated, nor any master stored without bytes
            self.unmade.forget_unwritten()
            if not isinstance(exc, CapacityError):
                raise
            if not self.keeps_gradients:
                exc.add_note(
                    "tierd: this first update makes the optimizer state while every gradient "
                    "stays in the store (a window of several backwards, clip_grad_norm_ or CPU "
                    "updates keep them); pass accumulation_steps=N (or max_grad_norm) to the "
                    "optimizer so that its construction checks the room, or give the daemon more")
            raise
        landing = None   # the block whose copies out are in flight ([Note: one block landing])
        try:
            try:
                for _, group, block in work:
                    if landing is not None and not (
                            ahead and landing.nbytes + self._leased_bytes(block)
                            <= block[0].session.lease_cap):
                        done, landing = landing, None
                        self._end_block(done, frees)
                    done, landing = landing, self._begin_block(group, block, coef, zeroed)
                    if done is not None:
                        self._end_block(done, frees)
            finally:
                if landing is not None:
                    self._end_block(landing, frees)
        except BaseException:   # masters stored without bytes and not written go
            self.unmade.forget_unwritten()
            raise
        self._stepped.clear()
        for f in self._fused:
            f.after_step()
        if touched:
            self._stop_fusing()
        self._finish_update()
        return loss

    def _stop_fusing(self) -> None:
        """Update in ``step()`` (deferred) from now on: the loop changes gradients
        between backward and step, which a fused update would run before."""
        for f in self._fused:
            f.fusing = False

    def _retire_earlier(self) -> None:
        """A new optimizer over parameters an earlier one fuses into backward
        replaces it there (as a new torch optimizer replaces the old one in a
        loop): the earlier one would otherwise consume their gradients."""
        mine = set(self._owned())
        for session in self._by_session(list(mine)):
            for f in list(session.optimizers):
                if isinstance(f, FusedUpdates) and f.opt is not self \
                        and not mine.isdisjoint(f.bucket_of):
                    _unregister(f)

    def _finish_update(self) -> None:
        """Under torch.distributed, every rank's next forward must see the
        new weights ([Note: when an update is visible])."""
        for session in self._by_session(self._all()):
            session.finish_update()

    def state_keys(self, tp: TieredParam) -> list[str]:
        """The master key (:meth:`master_key`), then one key per state name."""
        return [self.master_key(tp)] + [self.state_key(tp, n) for n in self.state_names]

    # ------------------------------------------------------------- state forms
    def master_in_compute(self, tp: TieredParam) -> bool:
        """``tp`` has a lower-precision compute copy that is its master here
        (``master="bf16"``): no fp32 master key ([Note: compact optimizer state])."""
        return tp.has_master and self.compact.master_in_compute(tp.param)

    def master_key(self, tp: TieredParam) -> str:
        """The key this optimizer updates as ``tp``'s master: the fp32 master,
        or the compute copy where that is the master (fp32, or ``master="bf16"``)."""
        return tp.key if self.master_in_compute(tp) else tp.master_key

    def separate_master(self, tp: TieredParam) -> bool:
        """``tp``'s master is a key of its own, cast into the compute copy after an update."""
        return tp.has_master and not self.master_in_compute(tp)

    def master_on_device(self, tp: TieredParam) -> bool:
        """``tp``'s master is its device copy: a resident parameter whose
        compute copy is its master under ``master="bf16"`` (the store's copy
        may be older: [Note: kept weights are written when the store is read]
        in tierd.updates.resident)."""
        return tp.resident and self.master_in_compute(tp)

    def master_like(self, tp: TieredParam) -> torch.Tensor:
        dtype = tp.param.dtype if self.master_in_compute(tp) else torch.float32
        return torch.empty(tp.param.shape, dtype=dtype, device="meta")

    def grad_dtype(self, tp: TieredParam) -> torch.dtype:
        """The dtype ``tp``'s gradient is stored in: its master's ([Note: the
        stored gradient's dtype] in tierd.client.tiered_param)."""
        return self.master_like(tp).dtype

    def state_like(self, tp: TieredParam, name: str) -> torch.Tensor:
        """A meta tensor with the dtype and shape of ``tp``'s stored state ``name``."""
        return self.compact.moment_like(tp.param)

    def master_nbytes(self, tp: TieredParam) -> int:
        """Bytes of the master an update reads and writes."""
        return tp.param.numel() * (tp.param.element_size() if self.master_in_compute(tp)
                                   else 4)

    def moment_nbytes(self, tp: TieredParam) -> int:
        """Bytes of all of ``tp``'s stored states."""
        return sum(_nbytes(self.state_like(tp, n)) for n in self.state_names)

    def state_nbytes(self, tp: TieredParam) -> int:
        """Bytes of ``tp``'s master and states (what an update moves in and out)."""
        return self.master_nbytes(tp) + self.moment_nbytes(tp)

    def update_params(self, group: dict, tps: list[TieredParam], params: list[torch.Tensor],
                      grads: list[torch.Tensor], moments: dict[str, list[torch.Tensor]]) -> None:
        """One step of several parameters that share a step count; subclasses
        may use foreach kernels with the same per-element math."""
        for i, tp in enumerate(tps):
            self.update_param(group, tp, params[i], grads[i],
                              {n: m[i] for n, m in moments.items()})

    def update_param(self, group: dict, tp: TieredParam, param: torch.Tensor,
                     grad: torch.Tensor, moments: dict[str, torch.Tensor]) -> None:
        """One step of ``tp``: ``param`` (fp32 master) and ``moments`` in place."""
        state = self.state[tp.outside]
        state["step"] = state.get("step", 0.0) + 1.0
        self._update(group, state, param, grad, moments)

    # ------------------------------------------------------------- helpers
    def _all(self) -> list[TieredParam]:
        return [p.tiered for g in self.param_groups for p in g["params"]]

    def _owned(self) -> list[TieredParam]:
        """The parameters whose state this rank keeps (all without torch.distributed);
        frozen ones (``requires_grad=False``) never get a gradient, so, as in
        torch, they get no state (and no fused bucket)."""
        return [tp for tp in dict.fromkeys(self._all())
                if tp.param.requires_grad and tp.session.owns(tp)]

    @staticmethod
    def _by_session(tps: list[TieredParam]) -> dict[Any, list[TieredParam]]:
        out: dict[Any, list[TieredParam]] = {}
        for tp in tps:
            out.setdefault(tp.session, []).append(tp)
        return out

    def _clip_coef(self) -> torch.Tensor | None:
        """The factor torch.nn.utils.clip_grad_norm_ would multiply every grad by."""
        if self.max_grad_norm is None:
            self.last_grad_norm = None
            return None
        norms = [tp.grad_norm for tp in self._all() if tp.has_gradient]
        ranks = next((s.share.ranks for s in self._by_session(self._all()) if s.share), None)
        if ranks is not None:
            # each owner has the norms of its shard: sum the squares over the node
            local = (torch.stack([n.double() for n in norms]).square().sum().cpu() if norms
                     else torch.zeros((), dtype=torch.float64))   # one device sync
            total = ranks.node_sum(local).sqrt().to(torch.float32)
            if norms:
                total = total.to(norms[0].device)
        elif not norms:
            return None
        else:
            first = norms[0].device
            total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        self.last_grad_norm = total
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)

    def _blocks(self, tps: list[TieredParam]) -> list[list[TieredParam]]:
        """Consecutive parameters whose leased bytes (master, grad, states, and
        the compute-dtype copy) stay under ``block_bytes`` and the session's cap."""
        blocks: list[list[TieredParam]] = []
        for session, session_tps in self._by_session(tps).items():
            limit = min(self.block_bytes, session.lease_cap)
            block: list[TieredParam] = []
            size = 0
            for tp in session_tps:
                leased = self._leased_bytes([tp])
                if block and size + leased > limit:
                    blocks.append(block)
                    block, size = [], 0
                block.append(tp)
                size += leased
            if block:
                blocks.append(block)
        return blocks

    def _leased_bytes(self, block: list[TieredParam]) -> int:
        """Pool bytes ``block``'s update leases at most: masters, moments,
        gradients and compute copies."""
        return sum(self.state_nbytes(tp) + tp.grad_nbytes + tp.nbytes for tp in block)

    def state_key(self, tp: TieredParam, name: str) -> str:
        return tp.session.keys.state(name, tp.name)

    def _compute_device(self, tp: TieredParam) -> torch.device:
        placement = self.placement or tp.session.config.optimizer_placement
        if placement == "cpu" or _on_host(self._fused, tp):
            return torch.device("cpu")
        return tp.session.device

    def _state_ahead(self, work: list, frees: dict) -> bool:
        """Every streamed block's state not made yet is made before the first
        update ([Note: one block landing]): where no gradient is freed as it
        is used, or the pool has room for all of it beside the gradients."""
        if not any(frees.values()):
            return True
        for session, tps in self._by_session(
                [tp for streamed, _, block in work if streamed for tp in block]).items():
            need = self.unmade.nbytes(tps)
            if not need:
                continue
            stats = session.client.stats()
            if "pool_bytes" not in stats or \
                    need > stats["pool_bytes"] - stats.get("pool_used_bytes", 0):
                return False
        return True

    def _begin_block(self, group: dict, block: list[TieredParam],
                     coef: torch.Tensor | None, zeroed: set[str]) -> _Landing:
        """Lease ``block``'s keys and queue its update; its copies back into
        the pool are in flight until :meth:`_end_block`. ``zeroed``: state
        keys put as zeros in this ``step()``, made on the device instead of
        copied in."""
        session = block[0].session
        resident = {tp: _resident_work(self._fused, tp) for tp in block}
        zeroed |= _ensure_stored(self, [tp for tp in block if resident[tp] is None])
        keys = list(dict.fromkeys(k for tp in block for k in self._block_keys(tp, resident[tp])))
        session.leases.acquire(keys)
        try:
            views = session.leases.views(keys)
        except CapacityError:   # nothing of the block updated: its leases go
            session.leases.release(keys)
            raise
        on_device = False
        try:
            for tp in block:
                on_device |= self._step_param(group, tp, views, coef, resident[tp], zeroed)
        except BaseException:   # (out of device memory, say) its leases go, as written:
            # detach and a later step() must not find them held
            _release_landed(session, keys, on_device)
            raise
        landed = session.copy.out_after_compute() if on_device else None
        return _Landing(block, keys, resident, landed, self._leased_bytes(block))

    def _end_block(self, landing: _Landing, frees: dict) -> None:
        """Once ``landing``'s copies out have landed ([Note: release after the
        event] in tierd.client.releases): its leases go, and the gradients it
        used where they are freed as they are used."""
        block = landing.block
        session = block[0].session
        if landing.event is not None:
            landing.event.synchronize()
        session.leases.release(landing.keys, written=True)
        # next needed in the next step ([Note: eviction by next use])
        # (not an fp32 parameter's own key: the next forward reads it first)
        session.leases.demote([k for tp in block if landing.resident[tp] is None
                               for k in self.state_keys(tp) if k != tp.key])
        self._stepped.update((tp, tp.session.counters.backwards) for tp in block)
        used = [tp for tp in block if tp in frees.get(tp.session, ())]
        if used:
            free_grads(session, used)
            self.needs_zero_grad = True   # a backward before zero_grad would miss them

    def _block_keys(self, tp: TieredParam, resident: dict | None) -> list[str]:
        grad = [] if tp.grad_on_device else [tp.grad_key]
        if resident is not None:   # only the gradient comes from the pool
            return grad
        keys = self.state_keys(tp) + grad
        if self.separate_master(tp):
            keys.append(tp.key)
        return keys

    def _step_param(self, group: dict, tp: TieredParam, views: dict[str, torch.Tensor],
                    coef: torch.Tensor | None, resident: dict | None = None,
                    zeros: set[str] | frozenset[str] = frozenset()) -> bool:
        in_place = resident is None and self.master_on_device(tp)
        device = tp.session.device if resident is not None else _update_device(self, tp)
        on_device = device.type != "cpu"
        shared = tp.session.leases.shared
        names = {"param": self.master_key(tp), "grad": tp.grad_key,
                 **{n: self.state_key(tp, n) for n in self.state_names}}
        if resident is not None:   # master and moments stay on the device, updated there
            names = {"grad": tp.grad_key}
        held = tp.device_grad   # summed on the device, not in the pool
        # a shared key is never changed in place: its new version is published;
        # a master on the device is updated there (the store's copy is written)
        # state made as zeros now is made on the device, not copied in, and a
        # master not made yet is cast there ([Note: masters cast where they are updated])
        cast = resident is None and names["param"] in self.unmade.cast
        read = {n: tp.key if cast and n == "param" else k for n, k in names.items()}
        work = {n: (torch.zeros_like(views[k], device=device) if on_device and k in zeros
                    else views[read[n]].to(device, non_blocking=True) if on_device
                    else views[k].clone() if k in shared else views[read[n]])
                for n, k in names.items()
                if not (in_place and n == "param") and not (held is not None and n == "grad")}
        if cast:
            work["param"] = work["param"].float()
        if on_device:   # the session's copy counters ([Note: two copy streams])
            tp.session.copy.h2d_bytes += sum(views[read[n]].nbytes for n in work
                                             if names[n] not in zeros)
        if held is not None:
            work["grad"] = held.to(device)
        if resident is not None:
            work["param"] = resident[self.master_key(tp)]
            work.update({n: resident[self.state_key(tp, n)] for n in self.state_names})
        elif in_place:
            work["param"] = tp.compute
        ops = tp.session.grad_views.ops(tp)
        if ops:   # the loop's in-place changes of p.grad, replayed in order
            replay(ops, work["grad"])
            tp.session.grad_views.applied(tp, work["grad"])
        if coef is not None:
            work["grad"].mul_(coef.to(work["grad"].device))
        self.update_param(group, tp, work["param"], work["grad"],
                          {n: work[n] for n in self.state_names})
        changed = coef is not None or bool(ops)   # p.grad keeps the changed gradient
        written = [] if resident is not None else [n for n in names if n != "grad"]
        written += ["grad"] if changed and held is None else []
        new = [(names[n], work[n]) for n in written]
        if self.separate_master(tp) and resident is None:
            new.append((tp.key, work["param"].to(tp.param.dtype)))
        publish = [(k, t) for k, t in new if k in shared]
        out = [(k, t) for k, t in new if k not in shared and views[k].data_ptr() != t.data_ptr()]
        for k, t in out:
            if t.device.type == "cpu":
                views[k].copy_(t)
        out = [(k, t) for k, t in out if t.device.type != "cpu"]
        if out:   # on the copy-out stream: the next block's reads overlap them
            tp.session.copy.copy_out_many([(views[k], t) for k, t in out],
                                          tuple(k for k, _ in out))
        if publish:
            tp.session.share.publish(publish)
        self.unmade.written(k for k, _ in new)   # (those stored without bytes: on their way)
        if tp.resident and not in_place:
            tp.session.refresh_resident(tp, work["param"])
        return on_device

    def _update(self, group: dict, state: dict, param: torch.Tensor, grad: torch.Tensor,
                moments: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError
