"""Compact optimizer state (``tierd.optim.AdamW(state=..., master=...)``):
each kernel against torchao's (bitwise), an attached model trained through
the real store on every update path against torchao's AdamW math, commit and
resume with the compact bytes, the bytes a parameter keeps, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.placement import Place
from tierd.client.store import LocalStore
from tierd.errors import StateError
from tierd.optim import compact, compact_compiled
from tierd.optim.compact import CompactState
from tests.client.models import assert_same_weights, batches, gpt2, llama, train

LR = 1e-2


def _torchao():
    return pytest.importorskip("torchao.optim")


# ------------------------------------------------------------------ kernels
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_torchaos(signed):
    _torchao()
    from torchao.optim.quant_utils import create_dynamic_map
    assert compact.dynamic_map(signed) == create_dynamic_map(signed=signed)


@pytest.mark.parametrize("signed", [True, False])
def test_block_quantization_is_torchaos_bitwise(signed):
    _torchao()
    from torchao.optim.quant_utils import (dequant_with_qmap, quantize_8bit_with_qmap,
                                           scale_tensor)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 2, 96)
    x = x if signed else x.abs()
    x[:2] = 0.0                                 # a block of zeros (scale clipped)
    table = compact.qmap(signed)
    # blocks of the map's own values and of the midpoints between them (absmax 1:
    # scaled as they are), where a search and its rounding are on a boundary
    mids = torch.cat([(table[1:] + table[:-1]) / 2, torch.ones(1)])
    x = torch.cat([x.reshape(-1), table, mids, torch.nextafter(mids, -mids)]).reshape(-1, 96)
    codes, scale = compact.quantize_blockwise(x, compact.codebook(signed))
    scaled, want_scale = scale_tensor(x, compact.BLOCK)
    want_codes = quantize_8bit_with_qmap(scaled, table)
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    back = compact.dequantize_blockwise(codes, scale, table)
    assert torch.equal(back, dequant_with_qmap(want_codes, table, want_scale))
    assert (back - x).abs().max() <= 0.1 * x.abs().max()   # 8 bits of a dynamic map


@pytest.mark.parametrize("signed", [True, False])
def test_the_codebook_gives_every_fp32_value_its_searched_code(signed):
    """[Note: 8-bit codes by a value's top bits]: within a key the code is a
    step function of the value with one step at most, so a key's two ends
    and the values either side of its threshold cover every fp32 value the
    key holds; plus infinities, NaNs, zeros, subnormals and random values."""
    book, values = compact.codebook(signed), compact.qmap(signed)
    keys = torch.arange(compact.KEYS, dtype=torch.int64) << compact.KEY_SHIFT
    span = (1 << compact.KEY_SHIFT) - 1
    ends = torch.cat([keys, keys | span]).to(torch.int32).view(torch.float32)
    finite = book.threshold[torch.isfinite(book.threshold)]
    near = torch.cat([finite, torch.nextafter(finite, torch.full_like(finite, -torch.inf)),
                      torch.nextafter(finite, torch.full_like(finite, torch.inf))])
    odd = torch.tensor([torch.inf, -torch.inf, torch.nan, -torch.nan, 0.0, -0.0, 1e-45,
                        -1e-45, 1.0, -1.0, 0.5, 1e-38])
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.rand(1 << 20, generator=g) * 2 - 1,
                      torch.randn(1 << 18, generator=g) * torch.logspace(-12, 1, 1 << 18)])
    x = torch.cat([ends, near, odd, values, rand])
    assert torch.equal(compact.nearest_codes(x, book), compact._searched_codes(x, values)
                       .to(torch.uint8))


def test_packed_moment_round_trips_codes_and_scales():
    x = torch.randn(4096)
    codes, scale = compact.quantize_blockwise(x, compact.codebook(True))
    packed = torch.empty(compact.packed_numel(x.numel()), dtype=torch.uint8)
    assert packed.numel() == 4096 + 4 * 16
    compact.pack_into(packed, codes, scale)
    got_codes, got_scale = compact.unpack(packed, x.numel())
    assert torch.equal(got_codes, codes) and torch.equal(got_scale, scale)
    # a view at an odd offset (a pool slot need not be 4-aligned) reads the same
    shifted = torch.empty(packed.numel() + 1, dtype=torch.uint8)[1:]
    shifted.copy_(packed)
    assert torch.equal(compact.unpack(shifted, x.numel())[1], scale)


def test_stochastic_rounding_is_torchaos_bitwise_and_unbiased():
    _torchao()
    from torchao.optim.quant_utils import _fp32_to_bf16_sr
    x = torch.randn(10_000)
    torch.manual_seed(3)
    got = compact.stochastic_round_bf16(x)
    torch.manual_seed(3)
    assert torch.equal(got, _fp32_to_bf16_sr(x))
    # a value a third of a bf16 ulp above 1.0 rounds up a third of the time
    third = torch.full((60_000,), 1.0 + 2.0 ** -7 / 3)
    rounded = compact.stochastic_round_bf16(third).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    assert abs(rounded.mean().item() - third[0].item()) < 2e-4


def _reference_state(p: torch.Tensor, state: str, signed: bool):
    """A moment as torchao keeps it, with tierd's rule for small tensors (fp32)."""
    from torchao.optim.subclass_8bit import OptimState8bit
    if state == "8bit" and compact.quantizable(p.numel()):
        return OptimState8bit.zeros(p.shape, signed, compact.BLOCK, p.device, dtype=p.dtype)
    if state == "bf16":
        return torch.zeros(p.shape, dtype=torch.bfloat16)
    return torch.zeros(p.shape, dtype=torch.float32)


def _stored(moment) -> torch.Tensor:
    """A reference moment in tierd's stored form (packed codes and scales)."""
    if hasattr(moment, "codes"):
        out = torch.empty(compact.packed_numel(moment.codes.numel()), dtype=torch.uint8)
        compact.pack_into(out, moment.codes, moment.scale)
        return out
    return moment


class TorchaoAdamW:
    """The reference: torchao's ``single_param_adam`` (eager, no compile),
    with its 8-bit state subclass or plain bf16/fp32 moments."""

    def __init__(self, params, state: str, lr: float = LR, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2):
        from torchao.optim.adam import single_param_adam
        self.step_fn = single_param_adam
        self.params = list(params)
        self.kind, self.lr, self.betas = state, lr, betas
        self.eps, self.weight_decay = eps, weight_decay
        self.state: dict = {}

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            st = self.state.setdefault(p, {})
            if not st:
                st.update(step=torch.tensor(0.0),
                          exp_avg=_reference_state(p, self.kind, True),
                          exp_avg_sq=_reference_state(p, self.kind, False))
            st["step"] += 1
            self.step_fn(p.detach(), p.grad, st["step"], st["exp_avg"], st["exp_avg_sq"], None,
                         torch.tensor(self.lr), self.betas[0], self.betas[1],
                         self.weight_decay, self.eps, True, p.dtype is torch.bfloat16)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_adamw_step_is_torchaos_single_param_adam_bitwise(state, master):
    _torchao()
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    p = torch.randn(32, 256, generator=g).to(dtype)
    ref_p = p.clone()
    like = CompactState(state=state).moment_like(p)
    m = torch.zeros(like.shape, dtype=like.dtype)
    v = torch.zeros(like.shape, dtype=like.dtype)
    ref = TorchaoAdamW([ref_p], state, lr=1e-3)
    for step in range(1, 5):
        grad = torch.randn(p.shape, generator=g).to(dtype)
        torch.manual_seed(step)
        compact.adamw_step([p], [grad], [m], [v], step=float(step), lr=1e-3, beta1=0.9,
                           beta2=0.999, weight_decay=1e-2, eps=1e-8, maximize=False)
        ref_p.grad = grad
        torch.manual_seed(step)
        ref.step()
        assert torch.equal(p, ref_p), step
        st = ref.state[ref_p]
        assert torch.equal(m, _stored(st["exp_avg"])) and torch.equal(v, _stored(st["exp_avg_sq"]))


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_one_multi_tensor_step_is_torchaos_steps_tensor_by_tensor_bitwise(state, monkeypatch):
    """One call over many tensors (fp32 masters and bf16 compute copies
    mixed, 8-bit and fp32 moments mixed, large ones cut into pieces, in
    several runs) gives
    torchao's single-tensor steps in order bit for bit, the stochastic
    rounding draws included, and so do single-tensor calls; ``maximize``
    of the negated gradient is the same step."""
    _torchao()
    monkeypatch.setattr(compact, "RUN_NUMEL", 10 * compact.BLOCK)
    g = torch.Generator().manual_seed(2)
    bf16, fp32 = torch.bfloat16, torch.float32
    shapes = [(64, 64), (64,), (16, 256), (3, 5), (48, 256), (8192,), (7,), (4096,)]
    dtypes = [bf16, bf16, fp32, fp32, bf16, bf16, fp32, fp32]
    params = [torch.randn(s, generator=g).to(dt) for s, dt in zip(shapes, dtypes)]
    # tensors in pieces (8-bit ones at block boundaries), several runs
    assert max(p.numel() for p in params) > 4 * compact.RUN_NUMEL
    assert sum(p.numel() for p in params) > 10 * compact.RUN_NUMEL
    one_by_one = [p.clone() for p in params]
    ref_params = [p.clone() for p in params]
    ref = TorchaoAdamW(ref_params, state, lr=1e-3)

    def zeros():
        likes = [CompactState(state=state).moment_like(p) for p in params]
        return [torch.zeros(like.shape, dtype=like.dtype) for like in likes]

    (ms, vs), (ms1, vs1) = (zeros(), zeros()), (zeros(), zeros())
    assert {m.dtype for m in ms} == ({torch.uint8, fp32} if state == "8bit"
                                     else {bf16} if state == "bf16" else {fp32})
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=1e-2, eps=1e-8)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        torch.manual_seed(step)
        compact.adamw_step(params, [-x for x in grads], ms, vs, step=float(step),
                           maximize=True, **hyper)
        torch.manual_seed(step)
        for i, p in enumerate(one_by_one):
            compact.adamw_step([p], [grads[i]], [ms1[i]], [vs1[i]], step=float(step),
                               maximize=False, **hyper)
        for p, grad in zip(ref_params, grads):
            p.grad = grad
        torch.manual_seed(step)
        ref.step()
        for i, p in enumerate(ref_params):
            st = ref.state[p]
            assert torch.equal(params[i], p) and torch.equal(one_by_one[i], p), (step, i)
            assert torch.equal(ms[i], _stored(st["exp_avg"])), (step, i)
            assert torch.equal(vs[i], _stored(st["exp_avg_sq"])), (step, i)
            assert torch.equal(ms1[i], ms[i]) and torch.equal(vs1[i], vs[i]), (step, i)


# ------------------------------------------------------------------ attached
@pytest.mark.parametrize("state", ["bf16", "8bit"])
@pytest.mark.parametrize("path", ["fused", "deferred", "cpu", "resident"])
def test_attached_training_is_torchaos_adamw_bitwise_on_every_update_path(daemon, state, path):
    """fp32 master weights (no rounding noise): tierd's compact update
    through the store equals torchao's AdamW on the plain model, bitwise,
    whichever path updates: fused into backward (streamed), in step()
    (deferred), on host threads in the pool, or resident on the device."""
    _torchao()
    ref = llama() if path == "resident" else gpt2()
    options: dict = {}
    if path == "resident":
        client = LocalStore()
        options = dict(device="cpu", gpu_memory_bytes=1 << 30)
    else:
        client = tierd.connect(daemon)
        if path == "cpu":
            options = dict(optimizer_placement="cpu")
    model = attach(copy.deepcopy(ref), client=client, **options)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=state,
                            fused=False if path == "deferred" else None)
    ref_opt = TorchaoAdamW(ref.parameters(), state)
    data = batches(5)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    if path == "resident":
        assert set(session_of(model).placer.plan.places.values()) == {Place.RESIDENT}
    saved = opt.state_dict()
    for i, p in enumerate(ref.parameters()):
        st = ref_opt.state[p]
        assert torch.equal(saved["state"][i]["exp_avg"], _stored(st["exp_avg"])), i
        assert torch.equal(saved["state"][i]["exp_avg_sq"], _stored(st["exp_avg_sq"])), i


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
@pytest.mark.parametrize("path", ["fused", "deferred", "cpu", "resident"])
def test_bf16_master_is_torchaos_bitwise_with_the_same_rounding(state, path, monkeypatch):
    """bf16 masters, streamed (fused into backward, or in step()), updated
    by host threads in the pool, or resident on the device (their compute
    copy is updated in place there): torchao's AdamW bitwise once both round
    the same way. Stochastic rounding draws follow the update order, which
    is not the reference's; the rounding itself is torchao's bitwise (above)."""
    torchao_adam = _torchao().adam
    nearest = lambda x: x.bfloat16()   # noqa: E731
    monkeypatch.setattr(compact, "stochastic_round_bf16", nearest)
    monkeypatch.setattr(torchao_adam, "_fp32_to_bf16_sr", nearest)
    resident = path == "resident"
    options = dict(gpu_memory_bytes=1 << 30) if resident else {}
    if path == "cpu":
        options = dict(optimizer_placement="cpu")
    ref = llama().to(torch.bfloat16)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   compute_dtype=torch.bfloat16, **options)
    session = session_of(model)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=state, master="bf16",
                            fused=False if path == "deferred" else None)
    ref_opt = TorchaoAdamW(ref.parameters(), state)
    data = batches(5)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    places = set(session.placer.plan.places.values()) if session.placer.plan else set()
    assert (places == {Place.RESIDENT}) == resident
    if path == "cpu":
        assert opt._fused[0].host.nbytes > 0   # updates ran on host threads
    kinds = {k[len(session.keys.prefix) + 1:].split("/")[0]
             for k in session.client.keys(session.keys.all)}
    assert "master" not in kinds   # no fp32 master anywhere


@pytest.mark.parametrize("path", ["fused", "deferred", "cpu"])
def test_bf16_master_stores_bf16_gradients_summed_as_torch_sums_them(path, monkeypatch):
    """Under ``master="bf16"`` a gradient is stored in bf16, its master's
    dtype ([Note: the stored gradient's dtype] in tierd.client.tiered_param):
    half the bytes the first step stores for it. Summed over a window of two
    backwards, training stays torchao's AdamW over a bf16 model bitwise,
    whose ``p.grad`` torch sums in bf16."""
    torchao_adam = _torchao().adam
    nearest = lambda x: x.bfloat16()   # noqa: E731
    monkeypatch.setattr(compact, "stochastic_round_bf16", nearest)
    monkeypatch.setattr(torchao_adam, "_fp32_to_bf16_sr", nearest)
    options = dict(optimizer_placement="cpu") if path == "cpu" else {}
    ref = llama().to(torch.bfloat16)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   compute_dtype=torch.bfloat16, **options)
    session = session_of(model)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state="8bit", master="bf16",
                            accumulation_steps=2, fused=False if path == "deferred" else None)
    ref_opt = TorchaoAdamW(ref.parameters(), "8bit")
    data = batches(6)
    loss = model(input_ids=data[0], labels=data[0]).loss / 2
    loss.backward()
    grads = session.gradients()
    assert grads and {g.dtype for g in grads.values()} == {torch.bfloat16}
    assert all(tp.grad_nbytes == tp.param.numel() * 2 for tp in session.params.values())
    opt.zero_grad()
    assert train(model, opt, data, accumulate=2) == train(ref, ref_opt, data, accumulate=2)
    assert_same_weights(model, ref)


def test_a_new_optimizer_stores_the_gradients_in_its_masters_dtype():
    """Gradient keys an exact optimizer made in fp32 are made again in bf16
    for a ``master="bf16"`` one that replaces it; one holding a gradient not
    used yet keeps its values (rounded to bf16, as torch's ``p.grad`` of a
    bf16 parameter holds them) and the next step uses them."""
    ref = llama().to(torch.bfloat16)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu",
                   compute_dtype=torch.bfloat16)
    session = session_of(model)
    data = batches(3)
    first = tierd.optim.AdamW(model.parameters(), lr=LR, fused=False)
    train(model, first, data[:1])                            # made the fp32 keys
    assert {tp.grad_dtype for tp in session.params.values()} == {torch.float32}
    loss = model(input_ids=data[1], labels=data[1]).loss
    loss.backward()                                          # a gradient not used yet
    pending = session.gradients()
    second = tierd.optim.AdamW(model.parameters(), lr=LR, state="bf16", master="bf16",
                               fused=False)
    assert {tp.grad_dtype for tp in session.params.values()} == {torch.bfloat16}
    got = session.gradients()
    assert got.keys() == pending.keys()
    assert all(torch.equal(got[n], v.bfloat16()) for n, v in pending.items())
    before = copy.deepcopy(model.state_dict())
    second.step()                                            # uses the converted gradients
    second.zero_grad()
    assert any(not torch.equal(v, before[n]) for n, v in model.state_dict().items())
    train(model, second, data[2:])
    assert {g.dtype for g in session.gradients().values()} <= {torch.bfloat16}


def test_stochastic_rounding_moves_bf16_weights_by_updates_below_half_an_ulp():
    """An update far below half a bf16 ulp leaves a weight as it was when
    rounded to nearest; rounded stochastically, it moves some of them."""
    ref = llama().to(torch.bfloat16)
    start = copy.deepcopy(ref.state_dict())
    model = attach(ref, client=LocalStore(), device="cpu", compute_dtype=torch.bfloat16)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, state="bf16",
                            master="bf16")
    train(model, opt, batches(3))
    got = model.state_dict()
    moved = sum(int((got[n] != v).sum()) for n, v in start.items())
    total = sum(v.numel() for v in start.values())
    assert 0 < moved < total // 10


def test_the_default_is_exact_fp32_adamw_and_says_nothing_of_compact(daemon):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    assert opt.compact.exact
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)
    saved = opt.state_dict()
    assert "compact" not in saved and saved["state"][0]["exp_avg"].dtype == torch.float32


# ------------------------------------------------------------------ checkpoints
def test_state_dict_round_trips_the_compact_bytes_and_refuses_another_setting(daemon,
                                                                              tmp_path):
    data = batches(6)
    start = gpt2()

    def fresh(state):
        model = attach(copy.deepcopy(start), client=tierd.connect(daemon))
        return model, tierd.optim.AdamW(model.parameters(), lr=LR, state=state)

    straight, straight_opt = fresh("8bit")
    train(straight, straight_opt, data)
    model, opt = fresh("8bit")
    train(model, opt, data[:3])
    saved = opt.state_dict()
    assert saved["compact"] == {"state": "8bit", "master": "fp32"}
    torch.save({"model": model.state_dict(), "optimizer": saved}, tmp_path / "ckpt.pt")
    tierd.detach(model)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    other = gpt2()
    other.load_state_dict(ckpt["model"])
    other = attach(other, client=tierd.connect(daemon))
    wrong = tierd.optim.AdamW(other.parameters(), lr=LR, state="bf16")
    with pytest.raises(StateError, match="state='8bit'.*Build it with"):
        wrong.load_state_dict(ckpt["optimizer"])
    assert wrong.state_dict()["state"] == {}          # nothing changed
    resumed_opt = tierd.optim.AdamW(other.parameters(), lr=LR, state="8bit")
    resumed_opt.load_state_dict(ckpt["optimizer"])
    again = resumed_opt.state_dict()
    for i, entry in saved["state"].items():
        for k, v in entry.items():
            assert torch.equal(again["state"][i][k], v), (i, k)
    train(other, resumed_opt, data[3:])
    assert_same_weights(other, straight)


def test_a_torch_fp32_state_dict_loads_into_a_compact_optimizer_converted(daemon):
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    train(ref, ref_opt, batches(2))
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state="bf16")
    opt.load_state_dict(ref_opt.state_dict())
    got = opt.state_dict()
    for i, entry in ref_opt.state_dict()["state"].items():
        assert torch.equal(got["state"][i]["exp_avg"], entry["exp_avg"].bfloat16()), i
        assert got["state"][i]["step"].item() == entry["step"].item()


def test_commit_and_resume_keep_the_compact_state_and_refuse_a_change(daemon):
    _torchao()
    data = batches(6)
    ref = gpt2()
    ref_opt = TorchaoAdamW(ref.parameters(), "8bit")
    want = train(ref, ref_opt, data)

    model = attach(gpt2(), client=daemon.connect(job="c8"), name="m")
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state="8bit")
    assert train(model, opt, data[:3]) == want[:3]
    tierd.commit(model, opt, 3)
    session_of(model).client.close()   # the process ends without detaching

    resumed = attach(gpt2(seed=5), client=daemon.connect(job="c8"), name="m", resume=True)
    for state in ("fp32", "bf16"):
        with pytest.raises(StateError, match="state='8bit'.*as the run that committed"):
            tierd.optim.AdamW(resumed.parameters(), lr=LR, state=state)
    opt = tierd.optim.AdamW(resumed.parameters(), lr=LR, state="8bit")
    assert train(resumed, opt, data[3:]) == want[3:]
    assert_same_weights(resumed, ref)


def test_an_exact_commit_resumed_by_a_compact_optimizer_is_refused(daemon):
    model = attach(gpt2(), client=daemon.connect(job="f32"), name="m",
                   compute_dtype=torch.bfloat16)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR)
    train(model, opt, batches(2))
    tierd.commit(model, opt, 2)
    session_of(model).client.close()
    resumed = attach(gpt2(), client=daemon.connect(job="f32"), name="m", resume=True,
                     compute_dtype=torch.bfloat16)
    with pytest.raises(StateError, match="state='fp32', master='fp32'"):
        tierd.optim.AdamW(resumed.parameters(), lr=LR, state="bf16")
    with pytest.raises(StateError, match="holds AdamW state kept with .*master='fp32'.*"
                                         "this optimizer keeps .*master='bf16'"):
        tierd.optim.AdamW(resumed.parameters(), lr=LR, master="bf16")
    opt = tierd.optim.AdamW(resumed.parameters(), lr=LR)   # the same setting resumes
    train(resumed, opt, batches(1))


# ------------------------------------------------------------------ sizes
def _bytes_per_param(model) -> float:
    """Bytes the store holds for the model's trained state at rest (compute
    copies, masters, moments) per trainable parameter."""
    session = session_of(model)
    keys = [k for k in session.client.keys(session.keys.all)
            if k[len(session.keys.prefix) + 1:].split("/")[0] in ("p", "master", "optim")
            and "/optim/step/" not in k and "/optim/format/" not in k]
    values = session.read(keys)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return sum(v.numel() * v.element_size() for v in values.values()) / n


@pytest.mark.parametrize("state,master,most", [("bf16", "fp32", 10.0), ("8bit", "bf16", 6.0)])
def test_bytes_per_parameter_in_the_store(daemon, state, master, most):
    model = attach(gpt2(n_embd=128), client=tierd.connect(daemon),
                   compute_dtype=torch.bfloat16)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=state, master=master)
    train(model, opt, batches(2))
    measured = _bytes_per_param(model)
    assert measured <= most
    assert CompactState(state=state, master=master).bytes_per_param(torch.bfloat16) <= most
    assert 2 < measured   # the compute copies at least


def test_bytes_per_param_figures():
    assert CompactState().bytes_per_param(torch.bfloat16) == 14.0
    assert CompactState(state="bf16").bytes_per_param(torch.bfloat16) == 10.0
    assert CompactState(state="8bit", master="bf16").bytes_per_param(torch.bfloat16) == 4.03125
    # a tensor below a block's worth keeps fp32 moments
    assert CompactState(state="8bit").bytes_per_param(torch.bfloat16, numel=1024) == 14.0


def test_placement_counts_the_compact_sizes():
    """What placement keeps per unit is what the setting stores."""
    sizes = {}
    for state, master in (("fp32", "fp32"), ("8bit", "bf16")):
        model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=torch.bfloat16)
        opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=state, master=master)
        session = session_of(model)
        units = session.placer.unit_bytes()
        sizes[state] = sum(u.state_bytes for u in units), sum(u.param_bytes for u in units)
        del opt
    (fp32_state, params), (compact_state, same_params) = sizes["fp32"], sizes["8bit"]
    assert params == same_params
    assert fp32_state == 6 * params             # fp32 master + two fp32 moments over bf16
    # two moments as stored (8-bit, fp32 below 4096 elements), no master of its own
    setting = CompactState(state="8bit", master="bf16")
    assert compact_state == sum(2 * setting.moment_nbytes(p) for p in llama().parameters())
    assert compact_state < 1.4 * params


@pytest.mark.parametrize("state,master", [("fp32", "fp32"), ("8bit", "bf16")])
def test_resident_bytes_are_the_storages_the_device_holds(state, master):
    """What the placer counts as held by the plan is what its tensors take:
    under ``master="bf16"`` a resident master is the compute copy itself, so
    it adds nothing (counted twice, the step's own memory read as 2 B/param
    less than it is, and the plan would take that much more than fits)."""
    from tierd.updates.buckets import BucketState
    model = attach(llama(), client=LocalStore(), device="cpu", compute_dtype=torch.bfloat16,
                   gpu_memory_bytes=1 << 30)
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state=state, master=master)
    train(model, opt, batches(3))
    session = session_of(model)
    assert set(session.placer.plan.places.values()) == {Place.RESIDENT}
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [tp.param for tp in session.params.values()]
            + [v for f in session.optimizers for b in f.buckets
               if b.state is BucketState.RESIDENT for v in b.work.values()]}
    assert session.placer.resident_bytes() == sum(held.values())


# ------------------------------------------------------------------ bad input
def test_bad_settings_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="state='int4'.*'fp32', 'bf16', '8bit'"):
        tierd.optim.AdamW([], state="int4")
    with pytest.raises(ValueError, match="master='fp16'.*'fp32', 'bf16'"):
        tierd.optim.AdamW([], master="fp16")


def test_bf16_master_needs_bf16_parameters():
    model = attach(gpt2(), client=LocalStore(), device="cpu")   # fp32 compute
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16"):
        tierd.optim.AdamW(model.parameters(), lr=LR, master="bf16")


def test_tensors_smaller_than_a_block_keep_fp32_moments_and_the_kernel_refuses_them():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        compact.quantize_blockwise(torch.randn(100), compact.codebook(True))
    with pytest.raises(ValueError, match="whole blocks of 256"):
        compact.packed_numel(4096 + 1)
    model = attach(gpt2(), client=LocalStore(), device="cpu")
    opt = tierd.optim.AdamW(model.parameters(), lr=LR, state="8bit")
    train(model, opt, batches(2))
    saved = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        moment = saved[i]["exp_avg"]
        if compact.quantizable(p.numel()):
            assert moment.dtype == torch.uint8 and moment.numel() < p.numel() * 1.02
        else:   # biases, norms, the position embedding of 2048 elements
            assert moment.dtype == torch.float32 and moment.shape == p.shape
    assert {saved[i]["exp_avg"].dtype for i in saved} == {torch.uint8, torch.float32}


#: steps within which a capped attach has placed its units (the placer's first
#: update places them; a later plan, e.g. after an activation plan, within this)
PLACED_WITHIN = 5


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("state,master", [("bf16", "fp32"), ("8bit", "fp32"), ("8bit", "bf16")])
def test_on_cuda_streamed_and_resident_compact_updates_agree_bitwise(daemon, state, master,
                                                                     monkeypatch):
    """The compact bytes streamed through the pool (fused into backward,
    copied in and out) and kept resident on the GPU give the same training,
    bitwise: the same kernels on the same device, whatever moves the bytes.
    ``gpu_memory_bytes=0`` places nothing (no plan: every unit streams); the
    capped run trains until its plan exists (made at the first update today,
    [Note: placing before the first update] in tierd.client.placer; within
    :data:`PLACED_WITHIN` steps whenever it is made) and three steps on it,
    and the streamed run trains as many steps on the same batches."""
    from tierd.client.placer import Placer, PlacerState
    monkeypatch.setattr(Placer, "_memory", lambda self: None)   # place from the cap alone
    monkeypatch.setattr(compact, "stochastic_round_bf16", lambda x: x.bfloat16())
    monkeypatch.setattr(compact_compiled, "_round_bf16", lambda x: x.bfloat16())
    dtype = torch.bfloat16 if master == "bf16" else torch.float32
    data = [ids.cuda() for ids in batches(PLACED_WITHIN + 3, batch=2, seq=16)]

    def attached(cap):
        model = attach(gpt2(n_layer=4, n_embd=128), client=tierd.connect(daemon),
                       gpu_memory_bytes=cap, compute_dtype=dtype)
        return model, tierd.optim.AdamW(model.parameters(), lr=LR, state=state, master=master)

    model, opt = attached(1 << 30)
    placer = session_of(model).placer
    resident, placed_at = [], None
    for ids in data:
        resident += train(model, opt, [ids])
        if placed_at is None and placer.plan is not None:
            placed_at = len(resident)
        if placed_at is not None and len(resident) == placed_at + 3:
            break
    assert placed_at is not None and placed_at <= PLACED_WITHIN, placed_at
    assert placer.state is PlacerState.PLACED
    assert set(placer.plan.places.values()) == {Place.RESIDENT}
    sd1 = model.state_dict()
    tierd.detach(model)

    model, opt = attached(0)
    streamed = train(model, opt, data[:len(resident)])
    placer = session_of(model).placer
    assert placer.state is PlacerState.OFF and placer.plan is None
    assert session_of(model).stats()["resident_bytes"] == 0
    sd0 = model.state_dict()
    tierd.detach(model)
    assert streamed == resident
    assert all(torch.equal(sd0[k], v) for k, v in sd1.items())


# ------------------------------------------------------------------ attach
def test_attach_counts_the_compact_setting_it_is_told_before_the_optimizer_exists():
    from tierd.client.attach_config import AttachConfig
    from tierd.client.capacity import model_need
    from tierd.client.keys import ModelKeys
    keys = ModelKeys.for_name("m")
    model = gpt2(n_embd=128)
    exact = model_need(model, torch.bfloat16, keys)
    setting = CompactState(state="8bit", master="bf16")
    small = model_need(model, torch.bfloat16, keys, optimizer_state=setting)
    assert exact.master > 0 and small.master == 0          # no fp32 master to store
    assert small.params == exact.params
    # the bf16 master's gradient is stored in bf16: half the first step's gradients
    assert small.gradients < exact.gradients * 0.6
    assert small.optimizer < exact.optimizer / 2
    assert small.total < exact.total
    with pytest.raises(ValueError, match="tierd.optim.CompactState"):
        AttachConfig(optimizer_state="8bit")
    # attach takes it as an option; the optimizer keeps its own setting
    attached = attach(gpt2(), client=LocalStore(), device="cpu", compute_dtype=torch.bfloat16,
                      optimizer_state=setting)
    assert session_of(attached).config.optimizer_state == setting


# ------------------------------------------------------------------ torch.distributed
@pytest.mark.parametrize("state,within", [("bf16", LR / 10), ("8bit", LR)])
def test_ranks_keep_compact_replicas_and_match_one_process(daemon_factory, tmp_path_factory,
                                                           state, within):
    """Two gloo ranks with compact moments: the owners send their units'
    compact bytes to the replicas (the embedding kept on the device), every
    rank holds bitwise the same values, and they match one tierd process with
    the same setting. The ranks sum gradients in another order, which fp32
    AdamW carries to 1.5e-4 here (tests/client/test_distributed.py); rounded
    moments carry it further where gradients are tiny (a bias element moves
    by 2.7e-4 with bf16 moments; an 8-bit code may move a level): the losses
    match, the weights are within a tenth of a step (bf16) or a step (8-bit)."""
    from tests.client.test_distributed import _global_losses, run_ranks
    from tests.client.test_distributed_placement import EMBEDDING_CAP, _assert_replicas
    daemon = daemon_factory(pool="256MiB")
    args = ("--steps", "4", "--tierd", "--state", state)
    one = run_ranks(tmp_path_factory.mktemp("one"), [daemon.socket], *args, "--job", "one")[0]
    assert "error" not in one, one
    ranks = run_ranks(tmp_path_factory.mktemp("two"), [daemon.socket] * 2, *args,
                      "--job", "two", "--module-units", "--gpu-memory-bytes",
                      str(EMBEDDING_CAP))
    _assert_replicas(ranks)
    assert "resident" in ranks[0]["plan"]["places"].values()
    assert _global_losses(ranks) == pytest.approx(one["losses"], abs=1e-5)
    for name, want in one["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], want, atol=within, rtol=0,
                                   msg=name)


def test_a_new_optimizer_with_another_setting_starts_fresh_state_in_its_own_form():
    """A new optimizer over an attached model replaces the earlier one (as in
    torch, its state starts at zero): the earlier one's moments, held in the
    pool in another form, are made again in the new one's."""
    _torchao()
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    session = session_of(model)
    data = batches(4)
    first = tierd.optim.AdamW(model.parameters(), lr=LR)
    ref_first = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    assert train(model, first, data[:2]) == train(ref, ref_first, data[:2])
    key = first.state_key(next(iter(first._owned())), "exp_avg")
    assert session.leases.is_held(key)   # the case the new form must not be written into
    second = tierd.optim.AdamW(model.parameters(), lr=LR, state="8bit")
    ref_second = TorchaoAdamW(ref.parameters(), "8bit")
    assert train(model, second, data[2:]) == train(ref, ref_second, data[2:])
    assert_same_weights(model, ref)
    saved = second.state_dict()["state"]
    assert {saved[i]["exp_avg"].dtype for i in saved} == {torch.uint8, torch.float32}
