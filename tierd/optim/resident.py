"""Moving a resident bucket's tensors between the device and the pool
([Note: resident optimizer state] in ``tierd.optim.fused``)."""

from __future__ import annotations


def write_back(session, opt, b) -> None:
    """Copy a resident bucket's master, moments and compute copy into the
    pool (blocking: only when the host is about to read the pool)."""
    copy = session.copy
    state = [k for tp in b.tps for k in opt.state_keys(tp)]
    keys = state + [tp.key for tp in b.tps if tp.has_master]
    session.leases.acquire(keys)
    views = session.leases.views(keys)
    pairs = [(views[k], b.work[k]) for k in state]
    pairs += [(views[tp.key], tp.param.data) for tp in b.tps if tp.has_master]
    copy.copy_out_many(pairs, tuple(keys)).synchronize()
    session.leases.release(keys, written=True)
    b.dirty = False


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
