"""The client's side of the daemon's read-ahead ([Note: the job's access
plan] in tierd.server.readahead): what a model larger than the pool tells
the daemon (on the in-process store, which keeps what it was told), and a
frozen model streamed through a real daemon's small pool, trained as plain
PyTorch trains it."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.attached import is_attached
from tierd.client.store import LocalStore
from tests.client.models import batches, gpt2, train


def _frozen_gpt2():
    """~7.5M fp32 parameters (30 MB), only the layer norms trained."""
    model = gpt2(n_layer=4, n_embd=384, vocab=1000)
    for name, p in model.named_parameters():
        p.requires_grad_("ln" in name)
    return model


def _trained(model, data):
    opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3) \
        if is_attached(model) else \
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                          foreach=False)
    return train(model, opt, data)


def test_a_model_larger_than_the_pool_tells_its_order_and_each_use():
    store = LocalStore()
    model = attach(gpt2(n_layer=2, n_embd=128, vocab=1000), client=store, device="cpu")
    session = session_of(model)
    session.pool_bytes = 1 << 20   # as a daemon's pool the model's 2 MB exceed
    _trained(model, batches(4, vocab=1000))
    trace = session.mover.planner.trace
    keys = [tuple(tp.key for tp in session.units[u].params) for u in trace]
    assert store.plans == [(session.prefix, keys)]   # once: the order and its keys held
    # each use from the first followed step on, counted on across steps
    assert store.uses == list(range(len(store.uses)))
    assert len(store.uses) == 3 * len(trace)   # steps 2 to 4 (step 1 learned the order)


def test_a_model_the_pool_holds_or_read_ahead_off_tells_nothing():
    held = LocalStore()   # 1 GiB: the model fits
    _trained(attach(gpt2(n_layer=2, n_embd=128, vocab=1000), client=held, device="cpu"),
             batches(3, vocab=1000))
    off = LocalStore()
    model = attach(gpt2(n_layer=2, n_embd=128, vocab=1000), client=off, device="cpu",
                   read_ahead=False)
    session_of(model).pool_bytes = 1 << 20
    _trained(model, batches(3, vocab=1000))
    assert held.plans == off.plans == [] and held.uses == off.uses == []


def test_read_ahead_must_be_a_bool():
    with pytest.raises(ValueError, match="read_ahead='yes' must be True or False"):
        attach(gpt2(), client=LocalStore(), device="cpu", read_ahead="yes")


def test_frozen_weights_through_a_small_pool_read_ahead_and_train_as_torch(daemon_factory):
    data = batches(5, vocab=1000)
    ref = _frozen_gpt2()
    want = _trained(copy.deepcopy(ref), data)
    per_step = {}
    for read_ahead in (True, False):
        # 30 MB of weights streamed through 16 MiB in units of 7 MB (each block)
        d = daemon_factory(pool="16MiB", nvme_size="512MiB", extra=("--segment-size", "4MiB"))
        with tierd.connect(d.socket) as c:
            model = attach(copy.deepcopy(ref), client=c, read_ahead=read_ahead)
            opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            got, steps = [], []
            for ids in data:
                before = c.stats()
                got += train(model, opt, [ids])
                after = c.stats()
                steps.append((after["bytes_to_pool"] - before["bytes_to_pool"],
                              after["bytes_read_ahead"] - before["bytes_read_ahead"]))
            tierd.detach(model)
        assert got == want, read_ahead
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert torch.equal(p, q) or p.requires_grad, name   # the frozen ones unchanged
        per_step[read_ahead] = steps
    planned, unplanned = per_step[True], per_step[False]
    assert all(ahead == 0 for _, ahead in unplanned)
    for (read, ahead), (lru_read, _) in zip(planned[2:], unplanned[2:]):
        assert ahead > 0 and read <= lru_read, (planned, unplanned)
