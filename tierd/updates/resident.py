"""Moving a resident bucket's tensors between the device and the store.

[Note: resident optimizer state]
A bucket the placement made resident ([Note: the GPU is the first tier] in
``tierd.client.placement``) is *pinned*: it is fetched once as any other,
and after its update its master and moments stay on the device (RESIDENT),
its compute copy is refreshed in place, and nothing goes back over PCIe.
The pool's copy is then older (``dirty``) until the host is about to read
the pool (``settle``: ``state_dict``, ``commit``, ``detach``, a deferred
``step()``), which writes it back first, so commits and reads see every
value. Gradients that earlier backwards of a window summed in the pool are
brought in for the update. An optimizer that updates in ``step()``
(clipping: ``fusing`` off) keeps its buckets for this alone: ``step()`` updates
a pinned bucket's device state in place
(:meth:`tierd.updates.fused.FusedUpdates.resident_work`).

[Note: resident state leaves the store]
Once a pinned bucket is RESIDENT, the device holds the newest master,
moments and compute copies of its parameters, and the store's copies are
only older bytes. They are deleted (:func:`leave_store`), so the GPU adds
capacity instead of mirroring the store: a model whose training state
exceeds pool + NVMe trains when placement keeps the difference on the
device ([Note: the GPU counted] in ``tierd.client.capacity``). When the host
is about to read the store (``state_dict``, ``commit``, ``detach``, streaming
the bucket again) :func:`write_back` puts them back as new keys, which needs
the room they took before; the first update after that deletes them again.
Under torch.distributed every rank reads the owners' keys, so they stay.

[Note: kept weights are written when the store is read]
A unit placed ``WEIGHTS`` keeps its compute copy on the device while its
master and moments stream. Its update refreshes the device copy; writing the
new compute copy to the store too, every step, kept those keys the most
recently used in the pool, where they held room the streamed state needed
(at 18.5B, 22 GB of bf16 copies the GPU already had, while state went
through NVMe), besides 2 B/param over PCIe. So the store's copy is left
older (``TieredParam.stale_in_store``) and written when the host is about to
read the store (``settle``: ``commit``, ``detach``, streaming the unit again),
as resident state is; untouched meanwhile, it leaves the pool first. The
master, which ``state_dict`` reads, streams as before. Under
torch.distributed the other ranks read the owner's new compute copy from the
store, so it is written every step there.
"""

from __future__ import annotations

from tierd.client.capacity import DaemonRoom, record_bytes, size_text
from tierd.errors import CapacityError
from tierd.updates.buckets import BucketState


def _values(opt, b) -> dict:
    """A resident bucket's device tensors by store key: masters, moments, and
    the compute copies of parameters that have a master of their own."""
    values = {k: b.work[k] for tp in b.tps for k in opt.state_keys(tp)}
    values.update({tp.key: tp.compute for tp in b.tps if opt.separate_master(tp)})
    return values


def check_room_to_write_back(session) -> None:
    """CapacityError, before anything is written, when the store cannot take
    back every resident value that left it ([Note: resident state leaves the
    store]): a commit, or streaming the units again, needs that room."""
    need = {k: v.numel() * v.element_size() for f in session.optimizers for b in f.buckets
            if b.state is BucketState.RESIDENT and not b.stored
            for k, v in _values(f.opt, b).items()}
    if not need:
        return
    room = DaemonRoom.from_stats(session.client.stats())
    job = getattr(session.client, "job", None)
    total = sum(record_bytes(k, n, job) for k, n in need.items())
    if room is None or total <= room.free(max(record_bytes(k, n, job) for k, n in need.items())):
        return
    raise CapacityError(
        f"{len(need)} values placement keeps only on the GPU ({size_text(total)}: weights, "
        f"fp32 masters and moments) must go back into the store before it is read (a "
        f"commit) or the units stream again (new input shapes), and the store has "
        f"{size_text(room.free())} free (pool {size_text(room.pool)} + NVMe "
        f"{size_text(room.nvme)}). Give the daemon that much more pool or NVMe "
        "(TIERD_POOL / TIERD_NVME_SIZE, or `tierd serve --pool/--nvme-size`); nothing was "
        "written and training can go on")


def leave_store(session, opt, b) -> None:
    """Delete the store's older copies of a RESIDENT bucket's values ([Note:
    resident state leaves the store]); no lease on them may be pending."""
    if not b.stored or session.share is not None:
        return
    values = _values(opt, b)
    keys = [k for k in values if k not in opt.unmade]
    session.drop_keys(keys, {k: values[k].numel() * values[k].element_size() for k in keys})
    opt.unmade.made(values)   # made on the device: put when written back
    b.left_store()


def write_back(session, opt, b) -> None:
    """Copy a resident bucket's master, moments and compute copy into the
    store (blocking: only when the host is about to read the store). Under
    torch.distributed only the owner writes ([Note: resident units are
    replicas] in ``tierd.client.distributed``): keys every rank reads get new
    versions, published before this returns."""
    copy = session.copy
    values = _values(opt, b)
    if not b.stored:   # [Note: resident state leaves the store]
        placed = session.client.reserve_async(values).result()
        try:
            copy.copy_out_many([(lease.tensor, values[lease.key]) for lease in placed],
                               tuple(values)).synchronize()
        except BaseException:
            session.client.abort(list(values))   # the device keeps the values
            raise
        session.client.publish_async(list(values)).result()
        b.written_back()
        return
    shared = session.leases.shared
    private = [k for k in values if k not in shared]
    if private:
        session.leases.acquire(private)
        views = session.leases.views(private)
        copy.copy_out_many([(views[k], values[k]) for k in private], tuple(private)).synchronize()
        session.leases.release(private, written=True)
    published = [(k, t) for k, t in values.items() if k in shared]
    if published:
        session.share.publish(published)
        session.releases.drain(block=True)   # the copies landed, the publish is sent
    b.written_back()


def writes_compute_copy(session, opt, tp) -> bool:
    """Whether an update by ``opt`` writes ``tp``'s new compute copy, cast
    from its master, to the store ([Note: kept weights are written when the
    store is read]); not where the compute copy is the master itself."""
    return opt.separate_master(tp) and (not tp.resident or session.share is not None)


def write_kept_weights(session, tps=None) -> None:
    """Copy the compute copies only the device has the newest of (of ``tps``;
    None: every parameter's) into the store (blocking: the host is about to
    read the store), a lease's worth (``session.lease_cap``) at a time: the
    pool is full of state then."""
    stale = [tp for tp in (session.params.values() if tps is None else tps)
             if tp.stale_in_store]
    while stale:
        chunk, nbytes = [], 0
        while stale and (not chunk or nbytes + stale[0].nbytes <= session.lease_cap):
            nbytes += stale[0].nbytes
            chunk.append(stale.pop(0))
        _write_kept(session, chunk)


def _write_kept(session, tps) -> None:
    keys = [tp.key for tp in tps]
    session.leases.acquire(keys)
    try:
        views = session.leases.views(keys)
        if session.copy.on_device:
            session.copy.copy_out_many([(views[tp.key], tp.compute) for tp in tps],
                                       tuple(keys)).synchronize()
        else:
            for tp in tps:
                views[tp.key].copy_(tp.compute)
    finally:
        session.leases.release(keys, written=True)
    for tp in tps:
        tp.stale_in_store = False


def device_values(session, tps) -> dict:
    """The masters of ``tps`` that resident buckets hold on the device
    (newer than the pool's until written back), by TieredParam."""
    wanted = set(tps)
    out = {}
    for f in session.optimizers:
        for b in f.buckets:
            if b.state is BucketState.RESIDENT:
                out.update({tp: b.work[f.opt.master_key(tp)] for tp in b.tps if tp in wanted})
    return out


def fetch_pooled_grads(session, b) -> None:
    """A resident bucket's gradients summed in the pool by earlier backwards
    of the window (or a learning step) come in for its update."""
    keys = [tp.grad_key for tp in b.tps if tp.grad_in_pool]
    if not keys:
        return
    copy = session.copy
    session.leases.acquire(keys)
    views = session.leases.views(keys)
    if copy.on_device:
        dsts, done = copy.copy_in_new([views[k] for k in keys], tuple(keys))
        copy.wait(done)
        b.work.update(dict(zip(keys, dsts)))
        session.releases.add(done, written=False)
    else:
        b.work.update({k: views[k].clone() for k in keys})
        session.leases.release(keys)

