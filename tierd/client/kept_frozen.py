"""Frozen parameters whose only copy is the compute device's, and writing
them into the store when that must change.

[Note: frozen weights kept only on the device]
A parameter's compute copy is in one of three places between steps:
STREAMED (the store holds it, fetched per use; ``TieredParam.resident``
False), RESIDENT_STORED (the device holds it for good, the store a copy,
older for a trained one until written: [Note: kept weights are written when
the store is read] in ``tierd.updates.resident``) and RESIDENT_ONLY (the
device copy is its only copy: ``TieredParam.in_store`` False). Only a frozen
parameter is RESIDENT_ONLY: nothing reads its store copy (no master, no
gradient, no optimizer state) and it never changes, so storing it would
only take store room the GPU already gives. ``init=True`` makes them: the
estimate ([Note: the plan before a step is measured] in
tierd.client.placer), made at attach from the meta model's sizes
(:func:`tierd.client.init_weights.kept_units`), names the units whose weights
the first step keeps, and their frozen parameters are initialized on the
device and kept there, never stored (``InitPlan.store``, the registry's
``kept``); a model larger than pool + NVMe attaches when the GPU keeps the
difference. A trainable parameter of a kept unit is stored as before: its
fp32 master is made from the stored compute copy, and its gradients and
optimizer state pass through the store until a plan pins them ([Note:
resident state leaves the store] in ``tierd.updates.resident``). The
placer adopts the RESIDENT_ONLY ones as placed. The transitions out, each
owned by the placer:

- RESIDENT_ONLY -> STREAMED: a plan that no longer keeps the unit (the
  measured plan, a shrink) writes them into the store first
  (:meth:`Placer.store_kept`: :func:`store_kept` here), and stops if the
  store cannot take them: a CapacityError naming the sizes, raised before
  anything moved.
- RESIDENT_ONLY -> RESIDENT_STORED: a commit writes them (``tierd.commit``
  calls :meth:`Placer.store_kept`), since a commit is read without this
  process; they stay stored after (their copy never ages).
- A reset (new input shapes, a plan made again) streams every stored unit
  to measure, but keeps RESIDENT_ONLY ones where they are: they cost only
  their bytes, counted as the plan's, and streaming them would take the
  store room they were kept to save. Detach reads their values from the
  device; nothing is stored.

Reads (``state_dict``, detach) take their device copy; a write sets it.
Making one trainable is refused (its master would be made from a store copy
it does not have): unfreeze before attach.
"""

from __future__ import annotations

from tierd.client.capacity import DaemonRoom, record_bytes, size_text
from tierd.errors import CapacityError


def store_kept(only: list, session) -> None:
    """Write ``only`` (RESIDENT_ONLY TieredParams of ``session``) into the
    store; they stay resident. A CapacityError naming the sizes, before
    anything is written, when the store cannot take them all."""
    if not only:
        return
    values = {tp.key: tp.compute for tp in only}
    job = getattr(session.client, "job", None)
    total = sum(record_bytes(k, v.nbytes, job) for k, v in values.items())
    room = DaemonRoom.from_stats(session.client.stats())
    largest = max(record_bytes(k, v.nbytes, job) for k, v in values.items())
    if room is not None and total > room.free(largest):
        raise _no_room_to_store(only, total, size_text(room.free()))
    try:
        placed = session.client.reserve_async(values).result()
    except CapacityError as exc:   # a store that does not report its room
        raise _no_room_to_store(only, total, f"less ({exc})") from exc
    try:
        if session.copy.on_device:
            session.copy.copy_out_many([(lease.tensor, values[lease.key])
                                        for lease in placed], tuple(values)).synchronize()
        else:
            for lease in placed:
                lease.tensor.copy_(values[lease.key])
        session.client.publish_async(list(values)).result()
    except BaseException:
        session.client.abort(list(values))   # the device keeps the values
        raise
    for tp in only:
        tp.in_store = True


def _no_room_to_store(only: list, total: int, free: str) -> CapacityError:
    return CapacityError(
        f"{len(only)} frozen parameters kept only on the GPU ({only[0].name!r}...: "
        f"{size_text(total)}) must go into the store (a plan that streams their unit, "
        f"or a commit), and it has {free} free. Nothing was moved or written: they stay "
        "on the GPU. Give the daemon that much more pool or NVMe (TIERD_POOL / "
        "TIERD_NVME_SIZE, or `tierd serve --pool/--nvme-size`), or the GPU more room "
        "(a larger gpu_memory_bytes, a smaller batch, activation checkpointing)")
