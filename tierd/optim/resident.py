"""Moving a resident bucket's tensors between the device and the pool
([Note: resident optimizer state] in ``tierd.optim.fused``)."""

from __future__ import annotations

from tierd.optim.buckets import BucketState


def write_back(session, opt, b) -> None:
    """Copy a resident bucket's master, moments and compute copy into the
    pool (blocking: only when the host is about to read the pool). Under
    torch.distributed only the owner writes ([Note: resident units are
    replicas] in ``tierd.client.distributed``): keys every rank reads get new
    versions, published before this returns."""
    copy = session.copy
    state = [k for tp in b.tps for k in opt.state_keys(tp)]
    values = {k: b.work[k] for k in state}
    values.update({tp.key: tp.param.data for tp in b.tps if tp.has_master})
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
    b.dirty = False


def device_values(session, tps) -> dict:
    """The fp32 masters of ``tps`` that resident buckets hold on the device
    (newer than the pool's until written back), by TieredParam."""
    wanted = set(tps)
    out = {}
    for f in session.optimizers:
        for b in f.buckets:
            if b.state is BucketState.RESIDENT:
                out.update({tp: b.work[tp.master_key] for tp in b.tps if tp in wanted})
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
        pairs = [(copy.empty_for_copy_in(views[k]), views[k]) for k in keys]
        done = copy.copy_in_many(pairs, tuple(keys))
        copy.wait(done)
        b.work.update({k: d for k, (d, _) in zip(keys, pairs)})
        session.releases.add(done, written=False)
    else:
        b.work.update({k: views[k].clone() for k in keys})
        session.leases.release(keys)

