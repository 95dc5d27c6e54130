"""``tierd.attach(model)``: stream a model's parameters from tierd's tiers.

Example:
    >>> import torch, tierd
    >>> model = tierd.attach(torch.nn.Linear(8, 8))            # doctest: +SKIP
    >>> opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)   # doctest: +SKIP
    >>> model(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    >>> tierd.detach(model)                                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import fields, replace

from torch import nn

from tierd.client import distributed
from tierd.client.attach_config import AttachConfig, check_cap, resolve_cap
from tierd.client.attached import AttachSession, Resumed, is_attached, session_of
from tierd.client.capacity import (StoreNeed, device_room, estimate_budget, margin_for,
                                   model_need)
from tierd.client.checkpoint import resumable_keys
from tierd.client.connection import connect
from tierd.client.device_allocator import use_expandable_segments
from tierd.client.embedded import ensure_daemon, node_socket, room_problem
from tierd.client.hooks import refuse_compiled
from tierd.client.init_weights import InitPlan, kept_units, plan_init
from tierd.client.keys import ModelKeys, random_name
from tierd.client.registry import expected_keys
from tierd.client.weights import CheckpointReader, WeightsPlan, plan_load
from tierd.errors import CapacityError, StateError

__all__ = ["AttachConfig", "attach", "attached", "detach", "session_of"]


def _join_ranks(group, model: nn.Module, client, job: str | None, config: AttachConfig,
                need: StoreNeed):
    """Under torch.distributed: agree with the other ranks, find the node's
    daemon (an embedded one sized for ``need``: one copy per node); returns
    (Ranks, client)."""
    if client is not None:
        socket, job = client.path, client.job
    else:
        socket = node_socket()   # an explicit socket with no daemon raises here
    ranks, socket = distributed.join(
        group, socket_path=socket, job=job, model=model, config=config,
        device=config.resolved_device(),
        start_daemon=functools.partial(ensure_daemon, need=need, commits=True))
    return ranks, client if client is not None else connect(socket, job=job)


def attach(model: nn.Module, *, client=None, config: AttachConfig | None = None,
           job: str | None = None, resume: bool = False, process_group=None,
           weights: str | os.PathLike | None = None, strict: bool = True,
           init: bool = False, **options) -> nn.Module:
    """Move ``model``'s parameters into tierd and stream them in on use.

    Returns ``model`` itself; its parameters become :class:`TieredParameter`
    objects whose storage is empty between uses (call ``model.parameters()``
    after attaching; the old Parameter objects are emptied). Gradients are
    summed into the daemon; ``param.grad`` is a view of them (clipping works,
    see ``tierd.client.grad_view``): use ``tierd.optim``. To compile, attach
    first: ``torch.compile(tierd.attach(model))``.
    ``options`` are :class:`AttachConfig` fields (not allowed with ``config``).
    Without ``client``, connects to (or starts) the node's embedded daemon,
    in job ``job`` (a named job, which ``tierd.commit`` can commit; it is also
    the default ``name``) or this process's default job.

    ``resume=True`` continues from the job's last commit (``tierd.commit``):
    the model's own values are ignored, the committed ones are used, and
    ``tierd.optim`` optimizers created after continue with the committed
    state. Needs a named job with a commit and the ``name`` that run used;
    see [Note: resume] in ``tierd.client.checkpoint``.

    Under ``torch.distributed`` (``process_group``, or the default group when
    it is initialized with several ranks) every rank must call ``attach``
    with the same model and ``job``: the ranks of a node share one copy in
    the node's daemon, gradients are averaged across all ranks as DDP does,
    and each rank updates its share of the node's copy; ``detach`` and
    ``tierd.commit`` must then be called on every rank too. See
    ``tierd.client.distributed``.

    ``weights=PATH`` (a ``.safetensors`` file or a Hugging Face checkpoint
    directory, sharded or not) gives the parameters and buffers the file's
    values instead of the model's, read and stored one module at a time, so
    ``model`` may be built on the meta device (``with torch.device("meta"):``)
    and never exist in process memory. Names match as ``load_state_dict``
    would: every one when ``strict`` (a ValueError lists the missing and
    unexpected keys), a tied parameter under any of its names; shapes and
    dtypes are checked before anything is stored. See
    ``tierd.client.weights``.

    ``init=True`` gives a model built on the meta device its own
    initialization instead (Hugging Face ``_init_weights``, else each
    module's ``reset_parameters``), run one unit at a time on the compute
    device, stored and freed before the next: the model never exists whole
    in process or device memory. Every parameter must be on the meta device
    (a model with values is attached without ``init=True``); not with
    ``weights=``, ``resume=True`` or under torch.distributed. With the same
    seed the values are the model's own init run on the whole model; see
    ``tierd.client.init_weights`` for how that compares with a plain model.

    Example:
        >>> model = tierd.attach(model, compute_dtype="bf16", gpu_budget_bytes=1 << 30)  # doctest: +SKIP
        >>> model = tierd.attach(build_model(), job="run1", resume=True)                 # doctest: +SKIP
        >>> model = tierd.attach(model, job="run1")   # under torchrun, on every rank   # doctest: +SKIP
        >>> with torch.device("meta"): model = LlamaForCausalLM(cfg)                     # doctest: +SKIP
        >>> model = tierd.attach(model, weights="Llama-3-8B/", compute_dtype="bf16")    # doctest: +SKIP
        >>> model = tierd.attach(model, init=True, compute_dtype="bf16")  # from config   # doctest: +SKIP
    """
    refuse_compiled(model)
    if config is not None and options:
        raise TypeError(f"pass either config= or options {sorted(options)}, not both")
    if config is None:
        known = {f.name for f in fields(AttachConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown attach options {unknown}; known: {sorted(known)}")
        config = AttachConfig(**options)
    if job is not None and not (isinstance(job, str) and job):
        raise ValueError(f"job={job!r} must be a non-empty string (or None)")
    if is_attached(model):
        raise StateError(f"{type(model).__name__} is already attached; detach it first")
    if job is not None and client is not None and client.job != job:
        raise ValueError(f"job={job!r} but the client is connected to job {client.job!r}; "
                         "pass one of them")
    if config.name is None and job is not None:
        config = replace(config, name=job)
    if resume and config.name is None:
        raise ValueError("resume=True needs a stable key prefix: pass name= (the one the "
                         "committed run used) or job=")
    group = distributed.active_group(process_group)
    if group is None and config.gpu_tier == "sharded":
        raise ValueError("gpu_tier='sharded' shares the GPU tier among the ranks of a "
                         "torch.distributed job, and this process is in none (no process "
                         "group, or a world of one): call torch.distributed."
                         "init_process_group first (torchrun), or leave gpu_tier at "
                         "'replicated'")
    if group is not None and weights is not None:
        raise ValueError("weights= is not supported under torch.distributed yet: load the "
                         "checkpoint into the CPU model (load_state_dict) and attach that")
    if not isinstance(init, bool):
        raise TypeError(f"init={init!r} must be True or False")
    if init:
        _check_init(weights, resume, group)
        if config.name is None:   # init stores the keys before the session, under this name
            config = replace(config, name=random_name())
        plan = plan_init(model, config.unit_modules)   # a model it cannot init touches nothing
        return _connect_and_build(model, client, config, job=job, resume=False, group=None,
                                  plan=plan)
    plan = _plan_weights(model, weights, strict)   # a bad checkpoint touches nothing
    try:
        return _connect_and_build(model, client, config, job=job, resume=resume,
                                  group=group, plan=plan)
    finally:
        if plan is not None:
            plan.reader.close()


def _check_init(weights, resume: bool, group) -> None:
    if weights is not None:
        raise ValueError("pass init=True (the model's own initialization) or weights=PATH "
                         "(a checkpoint's values), not both")
    if resume:
        raise ValueError("pass init=True (new values) or resume=True (the job's committed "
                         "values), not both")
    if group is not None:
        raise ValueError("init=True is not supported under torch.distributed yet: "
                         "initialize the model on the CPU and attach that")


def _plan_weights(model: nn.Module, weights, strict: bool) -> WeightsPlan | None:
    if weights is None:
        meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if meta:
            raise ValueError(
                f"{type(model).__name__} has tensors on the meta device ({', '.join(meta[:3])}"
                f"{', ...' if len(meta) > 3 else ''}) and no values to attach: pass "
                "weights=PATH (a .safetensors file or a checkpoint directory), or init=True "
                "(the model's own initialization)")
        return None
    reader = CheckpointReader(weights)
    try:
        return plan_load(model, reader, strict=strict)
    except BaseException:
        reader.close()
        raise


def _connect_and_build(model: nn.Module, client, config: AttachConfig, *, job, resume: bool,
                       group, plan: WeightsPlan | InitPlan | None) -> nn.Module:
    owns_client = client is None
    ranks = None
    device = config.resolved_device()
    # a model built on the device leaves it at attach: its bytes count as room
    on_device = sum(p.nbytes for p in model.parameters() if p.device == device)
    cap = resolve_cap(device, config.gpu_memory_bytes, warn=False, leaving=on_device)
    explicit = config.gpu_memory_bytes is not None
    if group is None and explicit:   # a bad cap fails here, before anything is stored
        check_cap(model, config, cap)
    gpu = 0 if group is not None else device_room(cap)
    kept: frozenset[str] = frozenset()   # keys init=True keeps only on the device
    if isinstance(plan, InitPlan):
        kept = _keep_on_device(plan, config, cap, device, explicit)
    need = model_need(model, config.compute_dtype, ModelKeys.for_name(config.name), job=job,
                      device=gpu, lazy_masters=group is None,
                      optimizer_state=config.optimizer_state, existing=kept)
    if group is not None:
        ranks, client = _join_ranks(group, model, client, job, config, need)
        if config.name is None:
            config = replace(config, name=client.job)
    elif client is None:
        client = connect(ensure_daemon(need=need, commits=job is not None), job=job)
    try:
        if ranks is not None:   # every rank checks the smallest cap of any rank
            low, explicit = ranks.agree_max([-(cap or 0), int(explicit)],
                                            "agreeing on gpu_memory_bytes")
            if explicit:
                _check_agreed_cap(model, config, -low)
        _check_room(model, client, config, ranks, gpu, kept)
        use_expandable_segments(device, config.expandable_segments)
        return _build(model, client, config, owns_client=owns_client, resume=resume,
                      ranks=ranks, plan=plan)
    except BaseException:
        if owns_client:
            client.close()
        raise


def _check_agreed_cap(model: nn.Module, config: AttachConfig, cap: int) -> None:
    try:
        check_cap(model, config, cap)
    except ValueError as exc:
        raise ValueError(f"{exc} (under torch.distributed every rank places within the "
                         "smallest gpu_memory_bytes of any rank)") from None


def _keep_on_device(plan: InitPlan, config: AttachConfig, cap: int | None, device,
                    explicit: bool) -> frozenset[str]:
    """init=True: choose the units whose frozen parameters stay on the device,
    never stored ([Note: frozen weights kept only on the device] in
    tierd.client.kept_frozen), and return those parameters' keys."""
    if cap is None:
        return frozenset()
    budget = estimate_budget(cap, margin_for(cap, explicit=explicit,
                                             cuda=device.type == "cuda"))
    plan.keep = kept_units(plan, config.compute_dtype, budget)
    keys = ModelKeys.for_name(config.name)
    return frozenset(keys.param(plan.names[pid]) for pid, hs in plan.holders.items()
                     if hs[0].unit in plan.keep and not hs[0].param.requires_grad)


def _check_room(model: nn.Module, client, config: AttachConfig, ranks, gpu: int,
                kept: frozenset[str] = frozenset()) -> None:
    """CapacityError, before anything is stored, when the daemon cannot hold
    the model's values and training state (keys a resumed job has excepted,
    and ``kept``, which init=True keeps only on the device; ``gpu`` bytes of
    it counted on the GPU: [Note: the GPU counted] in tierd.client.capacity);
    under torch.distributed the node leader checks and every rank raises."""
    text = None
    if ranks is None or ranks.leader:
        keys = ModelKeys.for_name(config.name)
        existing = client.keys(keys.all) if config.name is not None else ()
        existing = [*existing, *kept]
        need = model_need(model, config.compute_dtype, keys, job=getattr(client, "job", None),
                          existing=existing, device=gpu, lazy_masters=ranks is None,
                          optimizer_state=config.optimizer_state)
        count = sum(p.numel() for p in model.parameters())
        text = room_problem(client, need, f"{type(model).__name__} ({count:,} parameters)")
    if ranks is not None:
        text = ranks.from_leader(text, "the capacity check")
    if text:
        raise CapacityError(text)


def _build(model: nn.Module, client, config: AttachConfig, *, owns_client: bool,
           resume: bool, ranks, plan: WeightsPlan | InitPlan | None = None) -> nn.Module:
    """Find what is stored already, then build the session (one place)."""
    keys = ModelKeys.for_name(config.name)
    expected = expected_keys(model, keys, config.compute_dtype, masters=ranks is not None)
    resumed = Resumed()
    if resume:
        stored = resumable_keys(client, keys.prefix, expected)
        step = int(client.get(keys.training_step)) if keys.training_step in stored else None
        resumed = Resumed(stored, step)
    shared_upload = ranks is not None and not resume
    if shared_upload and ranks.leader:   # [Note: one copy per node]
        distributed.broadcast_values(model, ranks)
    elif shared_upload:   # the others use what the leader stored
        ranks.barrier("attach (the leader uploading the parameters)")
        resumed = Resumed(frozenset(expected))
    if isinstance(plan, InitPlan):
        _build_initialized(model, client, config, plan, owns_client=owns_client)
    elif plan is not None:
        try:
            plan.load_buffers(model)
            AttachSession(model, client, config, owns_store=owns_client, resumed=resumed,
                          ranks=ranks, source=plan)
        except BaseException:
            plan.restore_buffers()
            raise
    else:
        AttachSession(model, client, config, owns_store=owns_client, resumed=resumed, ranks=ranks)
    if shared_upload and ranks.leader:
        ranks.barrier("attach (the leader uploading the parameters)")
    if ranks is not None:   # every rank has its session: they agree on one cap
        session_of(model).placer.join_ranks()
    return model


def _build_initialized(model: nn.Module, client, config: AttachConfig, plan: InitPlan, *,
                       owns_client: bool) -> None:
    """Initialize and store ``model`` unit by unit, then build the session
    over the keys stored, as a resumed job's ([Note: initializing unit by
    unit] in tierd.client.init_weights)."""
    stored: frozenset[str] = frozenset()
    try:
        plan.load_buffers()
        stored, kept = plan.store(client, ModelKeys.for_name(config.name), config.compute_dtype,
                                  config.resolved_device(), keep=plan.keep)
        AttachSession(model, client, config, owns_store=owns_client, resumed=Resumed(stored),
                      kept=kept)
    except BaseException:
        plan.restore_buffers()
        if stored:
            with contextlib.suppress(Exception):   # the store may be what failed
                client.delete(list(stored))
        raise


def detach(model: nn.Module) -> nn.Module:
    """Put ordinary parameters back (original dtype/device, current values),
    remove the hooks and delete the model's keys from the daemon.

    Example:
        >>> model = tierd.detach(model); torch.save(model.state_dict(), "m.pt")  # doctest: +SKIP
    """
    session_of(model).close()
    return model


@contextlib.contextmanager
def attached(model: nn.Module, **options) -> Iterator[nn.Module]:
    """``with tierd.attached(model) as m:`` attach for the block, detach after."""
    attach(model, **options)
    try:
        yield model
    finally:
        detach(model)
