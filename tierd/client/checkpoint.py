"""Training commits and resume: ``tierd.commit(model, opt, step)`` and
``tierd.attach(model, job=..., resume=True)``.

[Note: what a training commit holds]
Everything an attached model trains already lives under its key prefix
(``tierd-attach/<name>``): parameters (``p/``), fp32 masters (``master/``)
and the optimizer's moments (``optim/<state>/``). A commit adds the two
things that live in the client: each parameter's optimizer step count
(``optim/step/<name>``, a float64 scalar, since the bias corrections and
SGD's first-step buffer depend on it; parameters without a gradient keep
their own count, as in torch) and the training step the caller passed
(``optim/_step``, an int64 scalar). Then the job is committed as one version
(``client.commit``). The daemon refuses a commit while a key is write-leased,
so the session's held leases are ended for the commit and taken again after.

[Note: resume]
After a daemon restart a named job holds exactly its last commit, so resuming
is: the parameters' keys exist, so they are not uploaded (the fresh model's
values are ignored); the optimizer creates zeros only for missing state keys
and reads the step counts back. Resuming needs a named job with a commit and
a stable ``name``; anything else raises, because silently starting fresh
would train a different run under the old one's name. On a daemon that did
not restart, the job's keys are its *latest* values, which may be newer than
the last commit (nothing rolls them back), and are not all of one step: the
GPU's values reach the store only at a commit ([Note: resident state leaves
the store], [Note: kept weights are written when the store is read] in
``tierd.updates.resident``).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tierd.client.attached import session_of
from tierd.client.embedded import is_embedded
from tierd.errors import StateError, TierdError


def resumable_keys(client, prefix: str, expected: list[str]) -> frozenset[str]:
    """The job's keys under ``prefix`` if it can resume there, else StateError.

    ``expected`` are the parameter keys (``<prefix>/p/<name>``) of the model."""
    jobs = client.stats().get("jobs", {})
    if jobs.get(client.job, {}).get("ephemeral", False):
        raise StateError(
            f"cannot resume in job {client.job!r}: it is this process's default job, "
            "which is never committed; connect with a named job "
            "(tierd.attach(model, job='run1', ...) or tierd.connect(job='run1'))")
    tags = client.commits()
    if not tags:
        hint = ""
        if _on_embedded(client):
            hint = (f"; this process started its own embedded daemon, which had no {client.job!r} "
                    f"before: {NOT_DURABLE}")
        raise StateError(
            f"job {client.job!r} has no commit to resume from; attach with resume=False "
            "(and the same name=) for the first run and call tierd.commit(model, opt, step)"
            + hint)
    existing = frozenset(client.keys(prefix + "/"))
    missing = [k for k in expected if k not in existing]
    if missing:
        found = "none" if len(missing) == len(expected) else f"{len(missing)} of {len(expected)} missing"
        hint = ("" if len(missing) == len(expected) else
                "; if a training process of this job ended since its last commit, the units "
                "it kept on the GPU took their newest values with it (they are not in the "
                "store between commits, and the weights it kept there are older): restart "
                "the daemon, which brings the job back to its last commit, and resume "
                "from there")
        raise StateError(
            f"job {client.job!r} (last commit {tags[-1]!r}) has no parameter keys for "
            f"this model under {prefix + '/'!r} ({found}, e.g. {missing[0]!r}); pass the "
            f"name= (AttachConfig.name) the committed run used, and the same model{hint}")
    return existing


def commit(model: nn.Module, optimizer, step: int) -> dict:
    """Make the attached ``model`` and ``optimizer``'s state (``None``: no
    optimizer) durable as commit ``f"step-{step}"`` of its job; a restart and ``attach(..., resume=True)``
    continue from here. Call it after ``opt.step()`` (and ``zero_grad()``).
    Under torch.distributed call it on every rank: each stores its share of
    the step counts and the node's leader commits the job.

    Returns the daemon's commit info (``tag``, ``tensors``, ``written_bytes``...).

    Example:
        >>> model = tierd.attach(model, job="run1")                  # doctest: +SKIP
        >>> opt = tierd.optim.AdamW(model.parameters(), lr=1e-4)     # doctest: +SKIP
        >>> for step in range(1, 1001):                              # doctest: +SKIP
        ...     train_step(model, opt)
        ...     if step % 100 == 0:
        ...         tierd.commit(model, opt, step)
    """
    session = session_of(model)
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if optimizer is not None and optimizer.has_unfinished_step():
        raise StateError("a fused update ran but opt.step() was not called yet; "
                         "commit after opt.step()")
    # frozen weights kept only on the GPU go into the store first ([Note: frozen
    # weights kept only on the device] in tierd.client.kept_frozen)
    session.placer.store_kept()
    session.settle()
    ranks = None if session.share is None else session.share.ranks
    values = {}
    if ranks is None or ranks.leader:
        values[session.keys.training_step] = torch.tensor(step, dtype=torch.int64)
    if optimizer is not None:
        values.update(optimizer.step_counts(session))   # this rank's share
    if values:
        session.client.put_many(values)
    held = session.leases.end_holds()
    try:
        if ranks is None:
            info = session.client.commit(f"step-{step}")
        else:
            info = _commit_node(session, ranks, f"step-{step}")
    finally:
        if held and not session.leases.hold(held):
            session.held_bytes = 0   # no room to hold again: leased per use from now on
    if _on_embedded(session.client):
        # a constant text: Python's warnings show it once per calling line
        warnings.warn(f"tierd.commit on the embedded daemon: {NOT_DURABLE}", UserWarning,
                      stacklevel=2)
    return info


#: why a commit on the embedded daemon does not outlive the process, and the fix
NOT_DURABLE = (
    "the embedded daemon (started by attach when no daemon answered) deletes its state, "
    "commits too, when the process that started it exits, so a later process cannot resume "
    "from them. To keep commits across processes, run a daemon of your own, `tierd serve "
    "--nvme DIR` (its socket: $TIERD_SOCKET or the default path, which attach finds), for "
    "the first run and the resumed one")


def _on_embedded(client) -> bool:
    path = getattr(client, "path", None)
    return path is not None and is_embedded(path)


def _commit_node(session, ranks, tag: str) -> dict:
    """Every rank's values and releases are in; the node's leader commits the
    job and every rank returns (or raises) its answer."""
    session.client.stats()   # the daemon has processed this rank's releases
    ranks.barrier("commit")
    outcome = None
    if ranks.leader:
        try:
            outcome = ("ok", session.client.commit(tag))
        except TierdError as exc:
            outcome = ("error", f"{type(exc).__name__}: {exc}")
            ranks.from_leader(outcome, "commit")
            raise
    outcome = ranks.from_leader(outcome, "commit")
    if outcome[0] == "error":
        raise TierdError(f"the node's commit {tag!r} failed on its leader rank: {outcome[1]}")
    return outcome[1]


def resumed_step(model: nn.Module) -> int | None:
    """The ``step`` of the commit an attached model resumed from (None if it did not resume).

    Example:
        >>> model = tierd.attach(model, job="run1", resume=True)   # doctest: +SKIP
        >>> start = tierd.resumed_step(model) + 1                  # doctest: +SKIP
    """
    return session_of(model).resumed_step
