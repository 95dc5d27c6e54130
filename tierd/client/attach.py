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
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from tierd.client.activations import POLICIES, tier_activations
from tierd.client.attached import Session
from tierd.client.checkpoint import TRAINING_STEP, resumable_keys
from tierd.client import distributed
from tierd.client.hooks import ModuleHooks
from tierd.client.registry import restore_parameters, take_parameters
from tierd.errors import StateError

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_PLACEMENTS = ("gpu-stream", "cpu")
_SESSION_ATTR = "_tierd_session"


@dataclass(frozen=True, kw_only=True)
class AttachConfig:
    """How an attached model uses the tiers. Every field has a working default.

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
    #: Most bytes of parameters allowed on the compute device for prefetch
    #: (the unit running now is always fetched, even above the budget).
    gpu_budget_bytes: int = 2 << 30
    #: Bytes of upcoming parameters for which pool leases are requested
    #: ahead of use (brings NVMe-resident ones into the pool in time).
    prefetch_bytes: int = 512 << 20
    #: Parameters smaller than this stay on the compute device all the time.
    resident_below_bytes: int = 0
    #: Where ``tierd.optim`` updates master weights and moments: "gpu-stream"
    #: (per block on the compute device) or "cpu" (in place in the pool).
    optimizer_placement: str = "gpu-stream"
    #: Keep lasting pool leases on the model's keys (compute-dtype params,
    #: then optimizer states) while they take at most this fraction of the
    #: pool: no daemon request per use. Above it, keys are leased per use and
    #: may spill to NVMe. 0 disables holding.
    hold_fraction: float = 0.5
    #: Gradients are written to the pool in buckets of about this many bytes.
    grad_bucket_bytes: int = 32 << 20
    #: Key prefix in the daemon (a random one when None); must be unique.
    name: str | None = None
    #: Tier what autograd saves in forward ("offload", "recompute", "auto";
    #: None: leave activations alone), see ``tierd.client.activations``.
    activations: str | None = None
    #: Bytes of saved activations allowed on the compute device (None: the
    #: policy decides; "auto" plans against it).
    activation_budget_bytes: int | None = None
    #: Saved tensors smaller than this stay on the compute device
    #: (``tier_activations(min_bytes=...)``).
    activation_min_bytes: int = 1 << 20

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
                  "grad_bucket_bytes", "activation_min_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0")
        if not 0.0 <= self.hold_fraction <= 1.0:
            raise ValueError(f"hold_fraction={self.hold_fraction} must be in [0, 1]")
        if self.optimizer_placement not in _PLACEMENTS:
            raise ValueError(f"optimizer_placement={self.optimizer_placement!r}; "
                             f"use one of {_PLACEMENTS}")
        if self.device is not None:
            object.__setattr__(self, "device", torch.device(self.device))
        if self.activations not in POLICIES:
            raise ValueError(f"activations={self.activations!r}; use one of {POLICIES}")
        if self.activation_budget_bytes is not None and self.activation_budget_bytes < 0:
            raise ValueError(f"activation_budget_bytes={self.activation_budget_bytes} must "
                             "be >= 0 or None")

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _connect(job: str | None):
    import tierd
    from tierd.client.embedded import ensure_daemon
    return tierd.connect(ensure_daemon(), job=job)


def _join_ranks(group, model: nn.Module, client, job: str | None, config: AttachConfig):
    """Under torch.distributed: agree with the other ranks, find the node's
    daemon; returns (Ranks, client)."""
    import tierd
    from tierd.client.embedded import answers, ensure_daemon
    from tierd.config import default_socket_path
    if client is not None:
        socket, job = client.path, client.job
    else:
        socket = default_socket_path()
        socket = socket if answers(socket) else None
    ranks, socket = distributed.join(
        group, socket_path=socket, job=job, model=model, config=config,
        device=config.resolved_device(), start_daemon=ensure_daemon)
    return ranks, client if client is not None else tierd.connect(socket, job=job)


def _expected_keys(model: nn.Module, prefix: str, config: AttachConfig) -> list[str]:
    """The keys attach stores for ``model``'s values (``p/`` and ``master/``)."""
    keys = []
    for name, p in model.named_parameters():
        keys.append(f"{prefix}/p/{name}")
        dtype = config.compute_dtype if p.is_floating_point() else p.dtype
        if dtype != torch.float32 and p.requires_grad:
            keys.append(f"{prefix}/master/{name}")
    return keys


def attach(model: nn.Module, *, client=None, config: AttachConfig | None = None,
           job: str | None = None, resume: bool = False, process_group=None,
           **options) -> nn.Module:
    """Move ``model``'s parameters into tierd and stream them in on use.

    Returns ``model`` itself; its parameters become :class:`TieredParameter`
    objects whose storage is empty between uses (call ``model.parameters()``
    after attaching; the old Parameter objects are emptied). Gradients are
    summed into the daemon, not into ``param.grad``: use ``tierd.optim``.
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

    Example:
        >>> model = tierd.attach(model, compute_dtype="bf16", gpu_budget_bytes=1 << 30)  # doctest: +SKIP
        >>> model = tierd.attach(build_model(), job="run1", resume=True)                 # doctest: +SKIP
        >>> model = tierd.attach(model, job="run1")   # under torchrun, on every rank   # doctest: +SKIP
    """
    if config is not None and options:
        raise TypeError(f"pass either config= or options {sorted(options)}, not both")
    if config is None:
        known = {f.name for f in fields(AttachConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown attach options {unknown}; known: {sorted(known)}")
        config = AttachConfig(**options)
    if getattr(model, _SESSION_ATTR, None) is not None:
        raise StateError(f"{type(model).__name__} is already attached; detach it first")
    if job is not None and client is not None and client.job != job:
        raise ValueError(f"job={job!r} but the client is connected to job {client.job!r}; "
                         "pass one of them")
    if config.name is None and job is not None:
        config = replace(config, name=job)
    if resume and config.name is None:
        raise ValueError("resume=True needs a stable key prefix: pass name= (the one the "
                         "committed run used) or job=")
    owns_client = client is None
    group = distributed.active_group(process_group)
    ranks = None
    if group is not None:
        ranks, client = _join_ranks(group, model, client, job, config)
        if config.name is None:
            config = replace(config, name=client.job)
    elif client is None:
        client = _connect(job)
    session = Session(model, client, config, owns_client=owns_client)
    session.ranks = ranks
    if resume:
        try:
            session.resumed_keys = resumable_keys(
                client, session.prefix, _expected_keys(model, session.prefix, config))
        except BaseException:
            if owns_client:
                client.close()
            raise
        session.resumed_step = int(client.get(f"{session.prefix}/{TRAINING_STEP}")) \
            if f"{session.prefix}/{TRAINING_STEP}" in session.resumed_keys else None
    if ranks is None or resume:
        take_parameters(session)
    else:
        _take_shared(session, ranks)
    session.start()
    session.hooks = ModuleHooks(session)
    if config.activations is not None:
        session.activations = tier_activations(
            model, client, policy=config.activations,
            budget_bytes=config.activation_budget_bytes, min_bytes=config.activation_min_bytes,
            device=session.device)
    object.__setattr__(model, _SESSION_ATTR, session)
    return model


def _take_shared(session: Session, ranks) -> None:
    """[Note: one copy per node]: the leader uploads (rank 0's values), the
    others use what it stored."""
    if ranks.leader:
        distributed.broadcast_values(session.model, ranks)
        take_parameters(session)
        ranks.barrier("attach (the leader uploading the parameters)")
    else:
        ranks.barrier("attach (the leader uploading the parameters)")
        session.resumed_keys = frozenset(
            _expected_keys(session.model, session.prefix, session.config))
        take_parameters(session)


def session_of(model: nn.Module) -> Session:
    """The Session of an attached model (raises StateError if it is not attached)."""
    session = getattr(model, _SESSION_ATTR, None)
    if session is None:
        raise StateError(f"{type(model).__name__} is not attached; call tierd.attach(model)")
    return session


def detach(model: nn.Module) -> nn.Module:
    """Put ordinary parameters back (original dtype/device, current values),
    remove the hooks and delete the model's keys from the daemon.

    Example:
        >>> model = tierd.detach(model); torch.save(model.state_dict(), "m.pt")  # doctest: +SKIP
    """
    session = session_of(model)
    if session.activations is not None:
        session.activations.close()
    session.hooks.remove()
    restore_parameters(session)
    session.leases.unhold_all()
    if session.ranks is not None:   # the node's keys go once every rank has read them
        session.client.stats()       # our releases are processed before the barrier
        session.ranks.barrier("detach")
    if session.ranks is None or session.ranks.leader:
        session.client.delete(session.client.keys(session.prefix + "/"))
    object.__delattr__(model, _SESSION_ATTR)
    if session.owns_client:
        session.client.close()
    return model


@contextlib.contextmanager
def attached(model: nn.Module, **options) -> Iterator[nn.Module]:
    """``with tierd.attached(model) as m:`` attach for the block, detach after."""
    attach(model, **options)
    try:
        yield model
    finally:
        detach(model)
