"""fp32 masters made when first needed: a model already in the compute dtype
stores none at attach, and trains, reads, commits and resumes exactly as one
whose masters were stored ([Note: masters made when first needed])."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tierd
import tierd.optim
from tierd.client.attach import attach, is_attached, session_of
from tierd.client.store import LocalStore
from tests.client.models import batches, llama, train


def _bf16_exact():
    """A bf16 model, and an fp32 one holding the same numbers (its masters are stored)."""
    model = llama().to(torch.bfloat16)
    return model, copy.deepcopy(model).to(torch.float32)


def _masters(model) -> list[str]:
    session = session_of(model)
    return [k for k in session.client.keys(session.keys.all) if "/master/" in k]


def _same(a, b) -> None:
    """``a`` (bf16 model) and ``b`` (fp32) hold the same values, rounded to bf16."""
    sa, sb = a.state_dict(), b.state_dict()
    for k, v in sa.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, sb[k].to(torch.bfloat16)), k


@pytest.mark.parametrize("cap", [None, 1 << 30], ids=["streamed", "resident"])
def test_a_bf16_model_stores_no_masters_and_trains_like_stored_masters(cap):
    lazy, eager = _bf16_exact()
    runs = []
    for model in (lazy, eager):
        model = attach(model, client=LocalStore(), device="cpu", compute_dtype="bf16",
                       gpu_memory_bytes=cap)
        runs.append((model, tierd.optim.AdamW(model.parameters(), lr=1e-3)))
    (lazy, lazy_opt), (eager, eager_opt) = runs
    n = sum(1 for p in eager.parameters() if p.requires_grad)
    assert _masters(lazy) == [] and len(_masters(eager)) == n
    _same(lazy, eager)   # read from the compute copy: the same numbers
    data = batches(4)
    assert train(lazy, lazy_opt, data) == train(eager, eager_opt, data)
    _same(lazy, eager)
    # made by the first update: in the store when streamed, on the device when resident
    assert len(_masters(lazy)) == (n if cap is None else 0)
    assert all(not tp.param.requires_grad or tp.master_made
               for tp in session_of(lazy).params.values())


def test_resume_from_a_commit_before_the_first_update():
    store = LocalStore(job="run1")
    lazy, eager = _bf16_exact()
    model = attach(lazy, client=store, job="run1", device="cpu", compute_dtype="bf16",
                   name="m")
    tierd.commit(model, None, 0)      # no master exists yet
    store.restart()
    object.__delattr__(model, "_tierd_session")
    again = attach(llama(seed=9).to(torch.bfloat16), client=store, job="run1", name="m",
                   resume=True, device="cpu", compute_dtype="bf16")
    ref = attach(eager, client=LocalStore(), device="cpu", compute_dtype="bf16")
    opt = tierd.optim.AdamW(again.parameters(), lr=1e-3)
    ref_opt = tierd.optim.AdamW(ref.parameters(), lr=1e-3)
    data = batches(3)
    assert train(again, opt, data) == train(ref, ref_opt, data)
    _same(again, ref)


def test_a_failed_attach_gives_a_bf16_model_its_values_back():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(3))).to(torch.bfloat16)
    before = {k: (p, p.detach().clone()) for k, p in model.named_parameters()}
    store = LocalStore(pool_bytes=20 << 10)   # the first modules fit, the last does not
    with pytest.raises(tierd.CapacityError):
        attach(model, client=store, device="cpu", compute_dtype="bf16")
    assert not is_attached(model) and store.keys() == []
    for k, p in model.named_parameters():
        assert p is before[k][0] and torch.equal(p, before[k][1]), k


def _spy_puts(session) -> list[str]:
    """Keys the client is given bytes other than zeros for from now on
    (put_many; the in-process store's put_zeros puts zeros through it)."""
    put, client = [], session.client
    original = client.put_many

    def put_many(items, *args, **kwargs):
        put.extend(k for k, t in items.items() if t.any())
        return original(items, *args, **kwargs)

    client.put_many = put_many
    return put


def test_the_first_update_casts_each_streamed_master_where_it_runs():
    """[Note: masters cast where they are updated]: no master is cast on the
    host and put before the update; each is written once, by its update, with
    the values a stored master gives."""
    lazy, eager = _bf16_exact()
    runs = []
    for model in (lazy, eager):
        model = attach(model, client=LocalStore(), device="cpu", compute_dtype="bf16")
        runs.append((model, tierd.optim.AdamW(model.parameters(), lr=1e-3)))
    (lazy, lazy_opt), (eager, eager_opt) = runs
    put = _spy_puts(session_of(lazy))
    data = batches(3)
    assert train(lazy, lazy_opt, data) == train(eager, eager_opt, data)
    _same(lazy, eager)
    assert not [k for k in put if "/master/" in k]
    assert len(_masters(lazy)) == len(_masters(eager)) and not lazy_opt.unmade.cast


def test_a_failed_first_update_stores_no_master_it_did_not_write():
    model, _ = _bf16_exact()
    model = attach(model, client=LocalStore(), device="cpu", compute_dtype="bf16")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    ids = batches(1)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls, update = [], opt.update_param

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (injected)")
        return update(*args, **kwargs)

    opt.update_param = failing
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="injected"):
        opt.step()
    session = session_of(model)
    written = {tp.master_key for tp in session.params.values() if tp.master_made}
    assert len(written) == 2 and set(_masters(model)) == written
    after = model.state_dict()
    untouched = [n for n, tp in session.params.items() if not tp.master_made]
    assert untouched and all(torch.equal(after[n], before[n]) for n in untouched)
    opt.update_param = update   # the next step makes the rest
    opt.step()
    assert all(tp.master_made for tp in session.params.values() if tp.param.requires_grad)
    assert not opt.unmade.cast
