"""[Note: updates before the next forward] in tierd.updates.forward: a share of
the streamed buckets of units that keep their weights on the device hold
their gradients at the end of the updating backward and update as the next
forward reaches their unit. Training is bitwise the same as updating in the
backward; anything that reads the values first runs the updates.

On the CPU placement runs against an explicit ``gpu_memory_bytes`` (nothing
is measured), so a cap a little above the model's weights keeps every unit's
weights and streams its state, as a capped GPU does."""

from __future__ import annotations

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, detach, session_of
from tierd.client.store import LocalStore
from tierd.client.values import TieredParameter
from tierd.updates.buckets import BucketState
from tierd.updates.forward import FORWARD_SHARE, WAITING
from tests.client.models import assert_same_weights, batches, gpt2, llama, train
from tests.faults import harness

SHARE = 0.5


def _cap(model, dtype: str) -> int:
    """Room for every weight at ``dtype`` and (what attach checks) for the
    largest block with its fp32 state, not for any block's state besides."""
    size = 2 if dtype == "bf16" else 4
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    largest = max(sum(p.numel() * (size + 12) for p in b.parameters()) for b in blocks)
    return max(sum(p.numel() * size for p in model.parameters()), largest) + (64 << 10)


def _attach(make, share, *, dtype="fp32", client=None, name=None, **options):
    model = make()
    return attach(model, client=client or LocalStore(), device="cpu", compute_dtype=dtype,
                  gpu_memory_bytes=_cap(model, dtype), forward_update_share=share,
                  name=name, **options)


def _pending(opt) -> list:
    """The buckets whose update waits for the next forward (fetched ahead or not)."""
    return [b for f in opt._fused for b in f.buckets if b.state in WAITING]


def _fetched_ahead(fused) -> int:
    """Bytes of the buckets fetched ahead of their update (AHEAD)."""
    return sum(b.nbytes for b in fused.buckets if b.state is BucketState.AHEAD)


def _waiting(opt) -> set[int]:
    return {unit for f in opt._fused for unit in f.in_forward._waiting}


def _loop(model, data, step) -> list[float]:
    """A training loop whose optimizer work after each backward is ``step(i)``."""
    losses = []
    for i, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        step(i)
    return losses


def _same_state(opt, ref_opt) -> None:
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for name in want[i]:
            assert torch.equal(torch.as_tensor(got[i][name]),
                               torch.as_tensor(want[i][name])), (i, name)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*")
@pytest.mark.parametrize("make,dtype,checkpointing", [
    (gpt2, "fp32", False),
    (gpt2, "bf16", False),
    (llama, "bf16", False),
    (gpt2, "bf16", True),     # reentrant: a gradient delivered twice is summed in fp32
])
def test_updates_before_the_next_forward_train_bitwise_like_updates_in_backward(
        make, dtype, checkpointing):
    data = batches(5)
    runs = []
    for share in (SHARE, 0.0):
        def build():
            m = make()
            if checkpointing:
                m.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": True})
            return m
        model = _attach(build, share, dtype=dtype)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        losses = train(model, opt, data)
        runs.append((model, opt, losses, bool(_pending(opt))))
    (model, opt, losses, pending), (plain, plain_opt, plain_losses, plain_pending) = runs
    assert pending and not plain_pending   # the last step's were still waiting
    assert losses == plain_losses
    assert_same_weights(model, plain)      # the read ran them
    assert not _pending(opt)
    _same_state(opt, plain_opt)


def test_only_blocks_that_keep_their_weights_wait_spread_through_the_forward():
    model = _attach(lambda: gpt2(n_layer=4), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    fused, registry = opt._fused[0], session_of(model).registry
    pending = _pending(opt)
    assert pending
    assert all(registry.unit_modules[b.unit] is not model for b in pending)   # not the rest
    assert all(tp.resident for b in pending for tp in b.tps)
    blocks = [b for b in fused.buckets if not b.pinned and b.unit is not None
              and registry.unit_modules[b.unit] is not model]
    assert sum(b.nbytes for b in pending) <= SHARE * sum(b.nbytes for b in blocks)
    # the forward reaches the first block before any copy could land
    units = {b.unit for b in pending}
    assert registry.unit_of[id(model.transformer.h[0])].index not in units
    assert len(units) == 3   # spread over the others
    before = session_of(model).stats()["forward_update_bytes"]
    train(model, opt, batches(1))
    assert session_of(model).stats()["forward_update_bytes"] - before == sum(
        b.nbytes for b in pending)   # counted as the forward updates them


def test_the_backward_s_last_copies_out_wait_for_the_first_unit():
    """[Note: the backward's last copies out wait for the first unit]: the
    first block's and the model's own buckets keep their new state until the
    next forward reaches the first block (past the model's preamble), or a
    read settles first; the window does not count them."""
    model = _attach(lambda: gpt2(n_layer=4), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    fused, registry = opt._fused[0], session_of(model).registry
    writing = [b for b in fused.buckets if b.state is BucketState.WRITING]
    first = registry.unit_of[id(model.transformer.h[0])].index
    assert {b.unit for b in writing} == {first, registry.unit_of[id(model)].index}
    assert fused._fetched_bytes == 0   # the WRITING ones: not counted
    seen = {}

    def states(at):
        def hook(module, args):
            seen.setdefault(at, [b.state for b in writing])
        return hook
    hooks = [model.transformer.wte.register_forward_pre_hook(states("preamble")),
             model.transformer.h[0].register_forward_pre_hook(states("first"))]   # after tierd's
    train(model, opt, batches(1))
    for h in hooks:
        h.remove()
    assert set(seen["preamble"]) == {BucketState.WRITING}
    assert set(seen["first"]) == {BucketState.HOST}   # queued; the step that updated them ended
    assert fused._fetched_bytes == 0
    # a read before the next forward queues them too
    assert any(b.state is BucketState.WRITING for b in fused.buckets)
    opt.state_dict()
    assert not any(b.state is BucketState.WRITING for b in fused.buckets)
    assert fused._fetched_bytes == 0


def test_state_fetched_ahead_and_given_back_is_fetched_again_at_its_update():
    """[Note: the next forward's first fetches start as the step begins]:
    the first pending buckets are fetched before the model's preamble; a
    pool that needs the room takes them back ([Note: a fetch that finds no
    room] in tierd.updates.fused), and their updates fetch them again,
    training as updates in the backward do."""
    data = batches(4)
    runs, given = [], []
    for share in (SHARE, 0.0):
        model = _attach(lambda: gpt2(n_layer=4), share)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        losses = train(model, opt, data[:2])
        assert not any(b.state is BucketState.AHEAD for f in opt._fused for b in f.buckets)

        def give_back(module, args, opt=opt, model=model):   # in the preamble
            fused = opt._fused[0]
            assert _fetched_ahead(fused) > 0
            assert session_of(model).mover.give_back_ahead()
            assert not any(b.state is BucketState.AHEAD for b in fused.buckets)
            assert _pending(opt) and fused._fetched_bytes == 0
            given.append(True)
        hook = model.transformer.wte.register_forward_pre_hook(give_back) if share else None
        losses += train(model, opt, data[2:3])
        if hook is not None:
            hook.remove()
        losses += train(model, opt, data[3:])
        runs.append((model, losses))
    assert given == [True]
    (model, losses), (plain, plain_losses) = runs
    assert losses == plain_losses
    assert_same_weights(model, plain)


def test_a_fetch_ahead_the_pool_has_no_room_for_leaves_the_update_to_its_forward(monkeypatch):
    """A pool with no room as the backward ends refuses the fetches ahead:
    the backward goes on, the buckets stay PENDING with nothing leased for
    them, and their forward fetches them: training as updates in the
    backward do."""
    from tierd.client.leases import LeaseTable
    from tierd.errors import CapacityError
    from tierd.updates.forward import ForwardUpdates
    real_views, real_begin, refusing = LeaseTable.views, ForwardUpdates.begin, [False]

    def views(self, keys):
        if refusing[0]:
            raise CapacityError("no room (refused by the test)")
        return real_views(self, keys)

    def begin(self):   # the step's begin: where the fetches ahead are asked
        refusing[0] = True
        try:
            real_begin(self)
        finally:
            refusing[0] = False

    data = batches(4)
    runs, seen = [], []
    for share in (SHARE, 0.0):
        model = _attach(lambda: gpt2(n_layer=4), share, hold_fraction=0.0)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        losses = train(model, opt, data[:1])
        hook = None
        if share:
            monkeypatch.setattr(LeaseTable, "views", views)
            monkeypatch.setattr(ForwardUpdates, "begin", begin)

            def preamble(module, args, opt=opt, model=model):
                pending = _pending(opt)
                if not pending:   # (the step after the first, learning one)
                    return
                assert all(b.state is BucketState.PENDING for b in pending)
                # none leased but the keys asked ahead ([Note: leases asked ahead])
                leased, asked = session_of(model).leases._refs, opt._fused[0]._ahead
                assert {k for b in pending for tp in b.tps for k in opt.state_keys(tp)
                        if k in leased} == {k for keys in asked.values() for k in keys}
                seen.append(len(pending))
            hook = model.transformer.wte.register_forward_pre_hook(preamble)
        losses += train(model, opt, data[1:3])
        if hook is not None:
            hook.remove()
            monkeypatch.undo()
        losses += train(model, opt, data[3:])
        runs.append((model, losses))
    (model, losses), (plain, plain_losses) = runs
    assert losses == plain_losses and seen   # (a preamble with pending updates ran)
    assert_same_weights(model, plain)


def test_an_untied_head_updated_as_the_backward_begins_writes_at_once():
    """Only the learned order's last buckets keep their state for the next
    forward: an untied head's, updated first in the backward, would hold its
    state through the backward's peak."""
    model = _attach(lambda: gpt2(n_layer=4, tie=False), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, batches(3))
    writing = {tp.name for b in opt._fused[0].buckets if b.state is BucketState.WRITING
               for tp in b.tps}
    assert any("wte" in name for name in writing)
    assert any(".h.0." in name for name in writing)
    assert not any("lm_head" in name for name in writing)


def test_every_streamed_unit_fetches_ahead_and_pending_keys_are_asked_for_early(monkeypatch):
    """On the GPU the fetch window fills (copies out land later): a forward that
    fetched only at the units that wait fetched each bucket where it was needed.
    Here a window of one bucket a refill stands in for it."""
    from tierd.updates.forward import ForwardUpdates
    model = _attach(lambda: gpt2(n_layer=4), SHARE, hold_fraction=0.0)   # leased per use
    # a window of the first few pending buckets (of 1.5-200 kB)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, prefetch_bytes=200_000)
    train(model, opt, batches(2))
    fused, registry = opt._fused[0], session_of(model).registry
    pending = _pending(opt)
    assert pending
    # the keys of the first pending ones (forward order) were asked for as
    # the backward ended; as the next step begins the first ones are fetched
    # within the window (twice prefetch_bytes), the keys of the next asked for
    order = [i for i in reversed(fused.order) if fused.buckets[i] in pending]
    assert set(fused._ahead) == set(order[:len(fused._ahead)]) and fused._ahead
    seen = {}

    def preamble(module, args):
        seen.setdefault("ahead", [i for i in order if fused.buckets[i].state is BucketState.AHEAD])
        seen.setdefault("asked", set(fused._ahead))
    hook = model.transformer.wte.register_forward_pre_hook(preamble)
    first = registry.unit_of[id(model.transformer.h[0])].index
    launched_in, unit_now, admitted = [], [None], [0]
    launch, ahead, before = (ForwardUpdates._launch, ForwardUpdates._launch_ahead,
                             ForwardUpdates.before_unit)

    def room(self, most):   # the next pending bucket's bytes
        admitted[0] += 1
        queue = [b for b in self.in_forward._queue if b.state is BucketState.PENDING]
        return queue[0].nbytes if queue and admitted[0] == 1 else 0

    def launch_ahead(self, unit):
        admitted[0] = 0
        ahead(self, unit)

    def before_unit(self, unit):
        unit_now[0] = unit
        before(self, unit)

    def record(self, b):
        launched_in.append((unit_now[0], b.unit))
        launch(self, b)

    monkeypatch.setattr(type(fused), "window_room", room)
    monkeypatch.setattr(ForwardUpdates, "_launch_ahead", launch_ahead)
    monkeypatch.setattr(ForwardUpdates, "before_unit", before_unit)
    monkeypatch.setattr(ForwardUpdates, "_launch", record)
    train(model, opt, batches(1))
    hook.remove()
    ahead = seen["ahead"]
    assert ahead == order[:len(ahead)] and 0 < sum(fused.buckets[i].nbytes for i in ahead) <= 400_000
    rest = order[len(ahead):]
    assert seen["asked"] == set(rest[:len(seen["asked"])]) and seen["asked"]
    # none before the first unit's forward ([Note: the first updates wait for the first unit])
    assert launched_in and all(u is not None for u, _ in launched_in)
    # the first block waits for none, yet its forward fetches the next ones
    assert any(u == first for u, _ in launched_in)
    assert sorted(b for _, b in launched_in) == sorted(b.unit for b in pending)
    # nothing asked ahead is left leased once the next step's updates ran
    monkeypatch.undo()
    model(input_ids=batches(1)[0]).logits.sum().item()
    opt.step()
    assert not _pending(opt)
    assert not fused._ahead


def test_a_refill_launches_no_more_than_the_room_it_finds(monkeypatch):
    """[Note: a refill takes the room it finds]: on the CPU a bucket's copies
    land as it is launched, so a refill that counted the room afresh after
    each launch would launch every pending update at the first unit."""
    from tierd.updates.forward import ForwardUpdates
    model = _attach(lambda: gpt2(n_layer=4), SHARE)
    probe = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, probe, batches(2))
    smallest = min(b.nbytes for b in _pending(probe))
    detach(model)
    model = _attach(lambda: gpt2(n_layer=4), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, prefetch_bytes=smallest)
    train(model, opt, batches(2))
    pending = _pending(opt)
    assert sum(b.nbytes for b in pending) > 2 * smallest
    calls, inside = [], [False]
    ahead, launch = ForwardUpdates._launch_ahead, ForwardUpdates._launch

    def launch_ahead(self, unit):
        calls.append([])
        inside[0] = True
        ahead(self, unit)
        inside[0] = False

    def record(self, b):   # (a unit's own buckets launch at its forward, room or not)
        if inside[0]:
            calls[-1].append(b.nbytes)
        launch(self, b)

    monkeypatch.setattr(ForwardUpdates, "_launch_ahead", launch_ahead)
    monkeypatch.setattr(ForwardUpdates, "_launch", record)
    train(model, opt, batches(1))
    launched = [c for c in calls if c]
    assert len(launched) > 1
    assert all(sum(c) <= 2 * smallest or len(c) == 1 for c in launched)


def test_a_refill_launches_for_the_next_units_only(monkeypatch):
    """[Note: a refill takes the room it finds]: with room for every pending
    update, a unit's pre-forward still launches only those of the next
    ``UNITS_AHEAD`` units with any, so the first block's kernels are not
    queued behind the launches of the whole forward's updates."""
    from tierd.updates import forward
    from tierd.updates.forward import ForwardUpdates
    model = _attach(lambda: gpt2(n_layer=6), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, prefetch_bytes=1 << 40)
    train(model, opt, batches(2))
    units = sorted({b.unit for b in _pending(opt)})
    assert len(units) > forward.UNITS_AHEAD + 1
    now, launched = [None], []
    before, launch = ForwardUpdates.before_unit, ForwardUpdates._launch

    def before_unit(self, unit):
        now[0] = unit
        before(self, unit)

    def record(self, b):
        launched.append((now[0], b.unit))
        launch(self, b)

    monkeypatch.setattr(ForwardUpdates, "before_unit", before_unit)
    monkeypatch.setattr(ForwardUpdates, "_launch", record)
    train(model, opt, batches(1))
    by_start = {}
    for start, unit in launched:
        by_start.setdefault(start, set()).add(unit)
    assert {u for _, u in launched} == set(units)   # every one ran in the forward
    assert all(len(us - {start}) <= forward.UNITS_AHEAD for start, us in by_start.items())
    assert len(by_start) > 2   # spread over the forward's units


def test_between_step_and_forward_the_modules_hold_tensors_that_read_the_new_values():
    data = batches(3)
    model, plain = _attach(gpt2, SHARE), _attach(gpt2, 0.0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = tierd.optim.AdamW(plain.parameters(), lr=1e-3)
    train(model, opt, data[:2])
    train(plain, plain_opt, data[:2])
    pending = _pending(opt)
    tp = pending[0].tps[0]
    holder = dict(model.named_parameters())[tp.name]
    assert isinstance(holder, TieredParameter)   # a read must run the update first
    want = dict(plain.named_parameters())[tp.name].detach().clone()
    assert torch.equal(holder.detach().clone(), want)   # an EMA, a logged norm
    assert not _pending(opt) and not _waiting(opt)
    assert not isinstance(dict(model.named_parameters())[tp.name], TieredParameter)
    assert train(model, opt, data[2:]) == train(plain, plain_opt, data[2:])
    assert_same_weights(model, plain)


def test_each_unit_runs_its_forward_on_its_updated_weights():
    model = _attach(lambda: gpt2(n_layer=4), SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(3)
    train(model, opt, data[:2])
    registry = session_of(model).registry
    waiting = _waiting(opt)
    assert waiting
    seen = {}

    def looker(block):
        def look(module, args):   # inside the block's forward: after its pre-hooks
            unit = registry.unit_of[id(block)].index
            seen[unit] = (unit in _waiting(opt), [type(p) for p in block.parameters()])
        return look

    handles = [block.ln_1.register_forward_pre_hook(looker(block))
               for block in model.transformer.h]
    train(model, opt, data[2:])
    for h in handles:
        h.remove()
    for unit in waiting:
        still, types = seen[unit]
        assert not still and TieredParameter not in types


def test_the_update_uses_the_hyper_parameters_of_its_backward():
    # a scheduler changes lr after step(), before the next forward runs the
    # update: the update uses the lr the backward's update would have used
    data = batches(4)
    runs = []
    for share in (SHARE, 0.0):
        model = _attach(gpt2, share)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)

        def step(i, opt=opt, sched=sched):
            opt.step()
            sched.step()
            opt.zero_grad()
        runs.append((model, _loop(model, data, step)))
    (model, losses), (plain, plain_losses) = runs
    assert losses == plain_losses
    assert_same_weights(model, plain)


def test_a_forward_without_autograd_runs_the_updates_it_reaches():
    data = batches(3)
    model, plain = _attach(gpt2, SHARE), _attach(gpt2, 0.0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = tierd.optim.AdamW(plain.parameters(), lr=1e-3)
    train(model, opt, data[:2])
    train(plain, plain_opt, data[:2])
    assert _pending(opt)
    with torch.no_grad():
        got = model(input_ids=data[2]).logits
        want = plain(input_ids=data[2]).logits
    assert torch.equal(got, want)
    assert train(model, opt, data[2:]) == train(plain, plain_opt, data[2:])


def test_no_update_waits_in_a_window_of_several_backwards_or_when_the_step_clips():
    data = batches(6)
    model = _attach(llama, SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, accumulation_steps=2)
    train(model, opt, data, accumulate=2)
    assert opt._fused[0].learned and not _pending(opt)
    model = _attach(gpt2, SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    train(model, opt, data)
    assert not _pending(opt)


@pytest.mark.parametrize("reader", ["optimizer_state_dict", "detach"])
def test_reading_right_after_a_step_sees_the_updates(reader):
    data = batches(3)
    model, plain = _attach(gpt2, SHARE, dtype="bf16"), _attach(gpt2, 0.0, dtype="bf16")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = tierd.optim.AdamW(plain.parameters(), lr=1e-3)
    train(model, opt, data)
    train(plain, plain_opt, data)
    assert _pending(opt)
    if reader == "optimizer_state_dict":
        _same_state(opt, plain_opt)
    else:
        detach(model)
        detach(plain)
        assert_same_weights(model, plain)
    assert not _pending(opt)


def test_a_commit_right_after_a_step_holds_the_updates(tmp_path):
    data = batches(4)
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    want = train(ref, ref_opt, data)
    d = harness.start(tmp_path)
    try:
        model = _attach(gpt2, SHARE, client=d.connect(job="run"), name="m")
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        assert train(model, opt, data[:2]) == want[:2]
        assert _pending(opt)
        tierd.commit(model, opt, 2)
        assert not _pending(opt)
        session_of(model).client.close()   # the process ends without detaching
        again = _attach(lambda: gpt2(seed=7), SHARE, client=d.connect(job="run"), name="m",
                        resume=True)
        opt = tierd.optim.AdamW(again.parameters(), lr=1e-3)
        assert train(again, opt, data[2:]) == want[2:]
        assert_same_weights(again, ref)
    finally:
        d.stop()


def test_the_share_is_none_on_the_cpu_unless_given_and_checked():
    model = attach(gpt2(), client=LocalStore(), device="cpu")   # no PCIe to use
    assert tierd.optim.AdamW(model.parameters(), lr=1e-3)._fused[0].in_forward.share == 0.0
    model = _attach(gpt2, 0.3)
    assert tierd.optim.AdamW(model.parameters(), lr=1e-3)._fused[0].in_forward.share == 0.3
    for bad in (-0.1, 1.0, 1.5, "half", True):
        with pytest.raises(ValueError, match="forward_update_share"):
            attach(gpt2(), client=LocalStore(), device="cpu", forward_update_share=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_on_cuda_updates_in_the_next_forward_train_bitwise_like_updates_in_backward(
        daemon, dtype, monkeypatch):
    # the updates run on the update stream as the forward reaches them, the
    # compute stream waits per unit; the plan from the cap alone (as in
    # test_cpu_update_gpu), so both runs place alike
    from tierd.client.placer import Placer
    monkeypatch.setattr(Placer, "_memory", lambda self: None)
    data = batches(6, batch=2, seq=16)
    runs = []
    for name, share in (("ahead", None), ("plain", 0.0)):
        made = gpt2(n_layer=4, n_embd=128)
        model = attach(made, client=tierd.connect(daemon), name=name, compute_dtype=dtype,
                       gpu_memory_bytes=_cap(made, dtype), forward_update_share=share)
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = []
        for ids in data:
            loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        pending = bool(_pending(opt))   # (before the reads below run them)
        runs.append((losses, model.state_dict(), opt.state_dict()["state"], pending,
                     opt._fused[0]))
    (losses, sd, state, pending, fused), (plain, sd1, state1, _, plain_fused) = runs
    assert fused.in_forward.share == FORWARD_SHARE and pending   # the default on a GPU
    assert plain_fused.in_forward.share == 0.0
    assert losses == plain
    assert all(torch.equal(sd[k], v) for k, v in sd1.items())
    for i in state1:
        for n in state1[i]:
            assert torch.equal(torch.as_tensor(state[i][n]), torch.as_tensor(state1[i][n]))


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_compiled_per_block_updates_wait_for_the_forward_and_nothing_recompiles_once_warm(
        mode):
    # regional: a block whose update waits gets a pre-forward hook, a graph
    # break at its start, as a streamed block has; whole: the compiled
    # backward hands every gradient over at its end, so nothing waits
    from torch._dynamo.utils import counters
    runs = []
    for share in (SHARE, 0.0):
        torch._dynamo.reset()
        counters.clear()
        model = _attach(llama, share)
        if mode == "whole":
            run = torch.compile(model, backend="aot_eager")
        else:
            for block in model.model.layers:
                block.compile(backend="aot_eager")
            run = model
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
        losses, graphs, pending = [], [], []
        for ids in batches(7, seq=12):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
            pending.append(bool(_pending(opt)))
        runs.append((losses, graphs, pending))
    (losses, graphs, pending), (plain, _, _) = runs
    assert losses == plain
    assert any(pending) == (mode == "regional")
    assert graphs[4:] == [graphs[4]] * len(graphs[4:])


def test_two_optimizers_each_update_their_own_blocks_in_the_forward():
    data = batches(4)
    runs = []
    for share in (SHARE, 0.0):
        model = _attach(lambda: gpt2(n_layer=4), share)
        blocks = [p for n, p in model.named_parameters() if ".h." in n]
        rest = [p for n, p in model.named_parameters() if ".h." not in n]
        first = tierd.optim.AdamW(blocks[:len(blocks) // 2], lr=1e-3)
        second = tierd.optim.SGD(blocks[len(blocks) // 2:] + rest, lr=1e-2, momentum=0.9)

        def step(i, opts=(first, second)):
            for opt in opts:
                opt.step()
                opt.zero_grad()
        losses = _loop(model, data, step)
        runs.append((model, losses, [bool(_pending(first)), bool(_pending(second))]))
    (model, losses, pending), (plain, plain_losses, _) = runs
    assert pending == [True, True]
    assert losses == plain_losses
    assert_same_weights(model, plain)


@pytest.mark.parametrize("state,master", [("bf16", "fp32"), ("8bit", "fp32"), ("8bit", "bf16")])
def test_compact_state_updated_in_the_forward_trains_bitwise_like_in_backward(
        state, master, monkeypatch):
    # 8-bit moments with their block scales, and bf16 masters that are the
    # weights themselves (updated in place on the device copy), follow the
    # same path. Stochastic rounding (master="bf16") draws its random bits in
    # the order the updates run, which differs, so here it rounds to nearest
    if master == "bf16":
        import tierd.optim.compact as compact
        monkeypatch.setattr(compact, "stochastic_round_bf16", lambda x: x.to(torch.bfloat16))
    data = batches(4)
    runs = []
    for share in (SHARE, 0.0):
        model = _attach(lambda: gpt2(n_layer=4, n_embd=128), share, dtype="bf16")
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, state=state, master=master)
        losses = train(model, opt, data)
        runs.append((model, opt, losses, bool(_pending(opt))))
    (model, opt, losses, pending), (plain, plain_opt, plain_losses, _) = runs
    assert pending
    assert losses == plain_losses
    assert_same_weights(model, plain)
    _same_state(opt, plain_opt)


def test_generation_right_after_a_step_runs_the_updates_its_first_token_reaches():
    data = batches(2)
    model, plain = _attach(gpt2, SHARE), _attach(gpt2, 0.0)
    opts = [tierd.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, plain)]
    for m, opt in zip((model, plain), opts):
        train(m, opt, data)
    assert _pending(opts[0])
    ids = data[0][:1, :6]
    outs = [m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                       do_sample=False, use_cache=True, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0) for m in (model, plain)]
    assert not _pending(opts[0]) and not _waiting(opts[0])
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[0].logits, outs[1].logits))


def test_a_loop_that_reads_the_weights_after_every_step_holds_updates_ever_more_rarely():
    # [Note: updates read before their forward]: an EMA read after step()
    # runs the waiting updates before their forward could overlap them
    data = batches(24)
    model, plain = _attach(gpt2, SHARE), _attach(gpt2, 0.0)
    runs = []
    for m in (model, plain):
        opt = tierd.optim.AdamW(m.parameters(), lr=1e-3)
        ema, held = [p.detach().clone() for p in m.parameters()], []

        def step(i, m=m, opt=opt, ema=ema, held=held):
            opt.step()
            opt.zero_grad()
            held.append(bool(_pending(opt)))
            torch._foreach_lerp_(ema, list(m.parameters()), 0.1)
        runs.append((_loop(m, data, step), ema, held))
    (losses, ema, held), (plain_losses, plain_ema, _) = runs
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(ema, plain_ema))
    # held at the first fused step, then after skipping 1, 2, 4, 8 backwards
    assert [i for i, h in enumerate(held) if h] == [1, 3, 6, 11, 20]


def test_a_loop_that_reads_now_and_then_keeps_holding_updates_between_reads():
    data = batches(12)
    model = _attach(gpt2, SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    held = []

    def step(i):
        opt.step()
        opt.zero_grad()
        held.append(bool(_pending(opt)))
        if i == 4:   # a logged norm, once, of a weight whose update waits
            name = _pending(opt)[0].tps[0].name
            float(dict(model.named_parameters())[name].norm())
    _loop(model, data, step)
    assert held == [False] + [True] * 4 + [False] + [True] * 6


def test_a_plan_that_grows_while_updates_wait_runs_them_first(monkeypatch):
    # the first plan keeps every unit's weights (an assumed update window
    # takes the rest of the cap); the first fused step leaves room, and the
    # plan grows to keep every unit whole while updates wait for the forward
    import tierd.updates.engine as engine_mod
    from tierd.client.placement import Place
    from tierd.client.placer import Placer
    from tests.client.test_placement_growth import _unit_bytes
    extra = 1 << 20
    weights, everything = _unit_bytes("bf16")
    cap = everything + 2 * extra
    monkeypatch.setattr(Placer, "_memory", lambda self: (self.resident_bytes() + extra, 1 << 40))
    monkeypatch.setattr(engine_mod, "update_window",
                        lambda buckets, prefetch: cap - extra - weights)
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16",
                   gpu_memory_bytes=cap, forward_update_share=SHARE)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    placer = session_of(model).placer
    data = batches(5)
    got = train(model, opt, data[:2])
    assert set(placer.plan.places.values()) == {Place.WEIGHTS} and _pending(opt)
    got += train(model, opt, data[2:])
    assert set(placer.plan.places.values()) == {Place.RESIDENT} and not _pending(opt)
    ref = attach(llama(), client=LocalStore(), device="cpu", compute_dtype="bf16")
    ref_opt = tierd.optim.AdamW(ref.parameters(), lr=1e-3)
    assert got == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
