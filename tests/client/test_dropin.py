"""The training loop people already have, on an attached model, against plain
torch on the same model and data (in-process store; one real-daemon test)."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.store import LocalStore
from tierd.errors import StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama

CLIP = 0.05   # small enough that every step of these models is clipped


def _pair(build=llama, **options):
    ref = build()
    return attach(copy.deepcopy(ref), client=LocalStore(), device="cpu", **options), ref


def _opts(model, ref, **kwargs):
    return (tierd.optim.AdamW(model.parameters(), **kwargs),
            torch.optim.AdamW(ref.parameters(), foreach=False, **kwargs))


def _loop(model, opt, data, *, window: int = 1, clip: float | None = None,
          zero=None) -> tuple[list[float], list[torch.Tensor]]:
    """A plain torch loop: ``window`` backwards per step (a short last window
    if ``len(data)`` is not a multiple), torch's clipping, ``zero`` to forget
    gradients (default ``opt.zero_grad``). Returns the losses and clip norms."""
    losses, norms = [], []
    for i, ids in enumerate(data):
        loss = model(input_ids=ids, labels=ids).loss / window
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % window == 0 or i + 1 == len(data):
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            (zero or opt.zero_grad)()
    return losses, norms


# ------------------------------------------------------------------ clipping
def test_clip_grad_norm_returns_torchs_norm_and_clips_the_update_bitwise():
    model, ref = _pair()
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    data = batches(6)
    got = _loop(model, opt, data, window=2, clip=CLIP)
    want = _loop(ref, ref_opt, data, window=2, clip=CLIP)
    assert got[0] == want[0]
    assert [n.item() for n in got[1]] == [n.item() for n in want[1]]
    assert all(n.item() > CLIP for n in want[1])   # every step really was clipped
    assert not any(f.fusing for f in opt._fused)   # clipping seen: updates in step() from then on
    assert_same_weights(model, ref)


def test_p_grad_reads_and_zeroing_through_p_grad_behave_as_in_torch():
    model, ref = _pair()
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    data = batches(4)
    for m in (model, ref):
        m(input_ids=data[0], labels=data[0]).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n], p.grad), n
    # model.zero_grad() (as Trainer and Lightning call it) forgets them: the
    # next window starts from zero in both
    model.zero_grad(); ref.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    got = _loop(model, opt, data[1:], zero=model.zero_grad)
    assert got == _loop(ref, ref_opt, data[1:], zero=ref.zero_grad)
    assert_same_weights(model, ref)


def test_p_grad_changed_or_zeroed_around_a_forward_behaves_as_in_torch():
    model, ref = _pair()
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    data = batches(4)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(input_ids=data[0], labels=data[0]).loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP)
        # clipped, then another backward adds to the clipped gradient
        m(input_ids=data[1], labels=data[1]).loss.backward()
        o.step()
        loss = m(input_ids=data[2], labels=data[2]).loss
        m.zero_grad()   # between a forward and its backward
        loss.backward()
        o.step()
        o.zero_grad()
    assert_same_weights(model, ref)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_foreach_clipping_and_other_norm_types_match_torch(norm_type):
    model, ref = _pair()
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    data = batches(2)
    norms = []
    for m, o in ((model, opt), (ref, ref_opt)):
        for ids in data:
            m(input_ids=ids, labels=ids).loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP, norm_type,
                                                        foreach=True).item())
            o.step()
            o.zero_grad()
    assert norms[:2] == norms[2:]
    assert_same_weights(model, ref)


def test_clipping_first_seen_after_a_fused_update_fails_naming_max_grad_norm():
    model, _ = _pair()
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(2)
    _loop(model, opt, data[:1])    # learns; the next update runs inside backward
    model(input_ids=data[1], labels=data[1]).loss.backward()
    assert opt.has_unfinished_step()
    with pytest.raises(StateError, match=r"max_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)


def test_unsupported_in_place_change_of_p_grad_fails_and_loses_nothing():
    model, ref = _pair()
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    ids = batches(1)[0]
    for m in (model, ref):
        m(input_ids=ids, labels=ids).loss.backward()
    weight = next(model.parameters())
    with pytest.raises(StateError, match="in place"):
        weight.grad.add_(torch.ones_like(weight.grad))
    opt.step(); ref_opt.step()
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("window", [1, 2, 3])
def test_accumulation_window_is_learned_and_matches_torch_with_a_short_last_window(window):
    model, ref = _pair(gpt2)
    opt, ref_opt = _opts(model, ref, lr=1e-3, weight_decay=0.01)
    data = batches(2 * window + 1 if window > 1 else 3)   # windows: w, w, then 1
    assert _loop(model, opt, data, window=window) == _loop(ref, ref_opt, data, window=window)
    (fused,) = opt._fused
    assert fused.window == window
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ frozen
def test_frozen_parameters_get_no_optimizer_state_and_no_bucket():
    def freeze(m):
        for n, p in m.named_parameters():
            p.requires_grad_(not n.startswith("model.embed_tokens"))
        return m
    ref = freeze(llama())
    store = LocalStore()
    model = attach(copy.deepcopy(ref), client=store, device="cpu")
    opt, ref_opt = _opts(model, ref, lr=1e-3)   # handed every parameter, frozen too
    frozen = [p.tiered for p in model.parameters() if not p.requires_grad]
    assert frozen
    state_keys = [k for tp in frozen for k in opt.state_keys(tp)[1:]]
    assert not set(state_keys) & set(store.keys())
    assert not any(tp in f.bucket_of for f in opt._fused for tp in frozen)
    data = batches(3)
    assert _loop(model, opt, data) == _loop(ref, ref_opt, data)
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ a new optimizer
def test_a_new_optimizer_starts_fresh_and_replaces_the_fused_one_before_it():
    model, ref = _pair(gpt2)
    data = batches(2)
    for kwargs in (dict(lr=1e-3), dict(lr=1e-2, weight_decay=0.1)):
        opt, ref_opt = _opts(model, ref, **kwargs)   # as a loop re-made per phase
        assert _loop(model, opt, data) == _loop(ref, ref_opt, data)
    assert_same_weights(model, ref)
    assert session_of(model).optimizers == opt._fused   # only the newest fuses


# ------------------------------------------------------------------ real daemon
def test_clipped_accumulating_loop_with_frozen_parameters_on_the_daemon_matches_torch(daemon):
    ref = gpt2()
    ref.transformer.wpe.weight.requires_grad_(False)   # frozen positions
    client = tierd.connect(daemon)
    model = attach(copy.deepcopy(ref), client=client)
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    frozen = model.transformer.wpe.weight.tiered
    assert not set(opt.state_keys(frozen)[1:]) & set(client.keys())
    data = batches(5)
    got = _loop(model, opt, data, window=2, clip=CLIP)
    want = _loop(ref, ref_opt, data, window=2, clip=CLIP)
    assert got[0] == want[0]
    assert [n.item() for n in got[1]] == [n.item() for n in want[1]]
    assert_same_weights(model, ref)
    # no clipping: the update is fused into the backward ending each learned window
    model, ref = attach(copy.deepcopy(ref), client=client, name="fused"), ref
    opt, ref_opt = _opts(model, ref, lr=1e-3)
    assert _loop(model, opt, data, window=2) == _loop(ref, ref_opt, data, window=2)
    assert opt._fused and opt._fused[0].window == 2
    assert_same_weights(model, ref)


# ------------------------------------------------------------------ torch.compile
class _Block(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                                torch.nn.GELU())
                                            for _ in range(depth)])

    def forward(self, x):
        return x + self.layers(x)


class _Stack(torch.nn.Module):
    """Embedding, three blocks of ``depth`` Linear+GELU, head: units inside blocks."""

    def __init__(self, depth: int, width: int = 16) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.emb = torch.nn.Embedding(10, width)
        self.blocks = torch.nn.ModuleList([_Block(width, depth) for _ in range(3)])
        self.head = torch.nn.Linear(width, 10)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x).logsumexp(-1).mean()


def _compiled_training(depth: int) -> tuple[int, int, int]:
    """Three compiled steps against eager torch; returns (graph breaks, ops
    captured, graphs)."""
    from torch._dynamo.utils import counters
    ref = _Stack(depth)
    model = attach(copy.deepcopy(ref), client=LocalStore(), device="cpu")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    opt, ref_opt = _opts(model, ref, lr=1e-2)
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    for m, o in ((compiled, opt), (ref, ref_opt)):
        for _ in range(3):
            m(ids).backward()
            o.step()
            o.zero_grad()
    assert_same_weights(model, ref)
    return (sum(counters["graph_break"].values()), counters["stats"]["calls_captured"],
            counters["stats"]["unique_graphs"])


def test_compiled_attached_model_trains_like_torch_with_no_graph_break_inside_a_block():
    breaks_1, captured_1, graphs_1 = _compiled_training(depth=1)
    breaks_3, captured_3, graphs_3 = _compiled_training(depth=3)
    # two more Linear+GELU per block add no break (hooks sit at block boundaries)
    # and are compiled: 2 ops each, in the one graph of a block, which the
    # three blocks share (their parameters are plain tensors of one shape)
    assert breaks_3 == breaks_1 and graphs_3 == graphs_1
    assert captured_3 - captured_1 >= 2 * 2


def test_attach_of_a_compiled_module_is_refused_naming_the_order():
    model = _Stack(1)
    with pytest.raises(TypeError, match=r"torch.compile\(tierd.attach\(model\)\)"):
        attach(torch.compile(model), client=LocalStore(), device="cpu")
    attach(model, client=LocalStore(), device="cpu")   # the model itself was not touched
