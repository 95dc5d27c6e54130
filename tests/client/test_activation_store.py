"""ActivationStore, its chunks and the ``auto`` stages on the in-process store
(no daemon): saved tensors come back bit-exact, views share one copy, every
byte of the store is given back, and lifecycle misuse raises StateError."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tierd.client.activations import (ActivationConfig, ActivationStore, AutoStage, ChunkState,
                                      tier_activations)
from tierd.client.activations.auto import AutoPlanner
from tierd.client.copy_stream import CopyStream
from tierd.client.store import LocalStore
from tierd.errors import CapacityError, StateError, UnknownKey

PREFIX = "test-act/s"
KiB = 1 << 10


def _store(local: LocalStore, *, chunk_bytes: int = 16 * KiB,
           prefetch_bytes: int = 8 * KiB) -> ActivationStore:
    return ActivationStore(local, CopyStream(torch.device("cpu")), PREFIX,
                           chunk_bytes=chunk_bytes, prefetch_bytes=prefetch_bytes)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(33, 17, generator=g),                        # odd size: padding
            torch.randn(64, 64, generator=g).to(torch.bfloat16),
            torch.randint(-2**40, 2**40, (100,), generator=g),       # int64
            torch.randn(48, 80, generator=g).t(),                    # non-contiguous
            torch.randn(20 * KiB, generator=g)]                      # bigger than a chunk


def _no_leases_left(local: LocalStore, keys: list[str]) -> bool:
    """A write lease is granted only on a key nobody leases (then given back)."""
    if not keys:
        return True
    local.lease_async(keys, write=True).result()
    local.release(keys)
    return True


def test_saved_tensors_come_back_bit_exact_and_the_store_is_emptied():
    local = LocalStore()
    store = _store(local)
    want = _tensors()
    handles = [store.save(t) for t in want]
    assert store.stats.chunks >= 2 and store.live_chunks() == store.stats.chunks
    for h, t in reversed(list(zip(handles, want))):   # backward's order
        got = store.load(h)
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride()
        assert torch.equal(got, t)
    assert store.stats.d2h_bytes == sum(t.numel() * t.element_size() for t in want)
    keys = local.keys(PREFIX)
    assert keys and _no_leases_left(local, keys)
    del handles, h, got
    store.end_backward()   # counts down the dropped handles
    assert local.keys(PREFIX) == [] and store.live_chunks() == 0
    assert local.used_bytes == 0
    store.close()


def test_a_tensor_saved_twice_and_its_views_share_one_copy():
    store = _store(LocalStore(), chunk_bytes=64 * KiB)
    h = torch.randn(64, 32)
    q, k = h.split(16, dim=1)
    handles = [store.save(x) for x in (h, q, k, h.t(), h)]
    assert store.stats.records == 1 and store.stats.deduped == 4
    assert store.stats.d2h_bytes == h.numel() * 4
    got = [store.load(x) for x in handles]
    for g, x in zip(got, (h, q, k, h.t(), h)):
        assert torch.equal(g, x) and g.stride() == x.stride()
    # restored as views of one buffer, as autograd saved them
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1
    small = torch.randn(64, 32)
    store.save(small[:4])   # a small view: only its span is copied
    assert store.stats.d2h_bytes == h.numel() * 4 + 4 * 32 * 4
    store.close()


def test_chunk_transitions_out_of_order_raise_state_error_naming_the_chunk():
    store = _store(LocalStore())
    value = torch.randn(256)
    saved = store.save(value)
    chunk = saved.record.chunk
    assert chunk.state is ChunkState.OPEN and chunk.key.startswith(PREFIX + "/")
    with pytest.raises(StateError, match=f"{chunk.key} is open.*published"):
        chunk.published()
    store.flush()
    assert chunk.state is ChunkState.STORED
    with pytest.raises(StateError, match=f"{chunk.key} is stored.*sealed"):
        chunk.seal()
    with pytest.raises(StateError, match=f"{chunk.key} is stored.*read"):
        chunk.pool_view()
    with pytest.raises(StateError, match=f"{chunk.key} is stored.*aborted"):
        chunk.aborted()
    assert torch.equal(store.load(saved), value)   # the store still works
    store.close()


def test_auto_stage_changes_only_in_order():
    auto = AutoPlanner(ActivationConfig(policy="auto", budget_bytes=None),
                       torch.device("cpu"), blocks=1, overlap=False, prefetch_bytes=0)
    with pytest.raises(StateError, match="stage profile.*check its plan"):
        auto.check_plan()
    auto.make_plan(1e9)
    assert auto.stage is AutoStage.DONE and auto.plan is not None   # CPU: nothing to check
    with pytest.raises(StateError, match="stage done.*make a plan"):
        auto.make_plan(1e9)
    fixed = AutoPlanner(ActivationConfig(policy="offload"), torch.device("cpu"), blocks=1,
                        overlap=False, prefetch_bytes=0)
    assert fixed.stage is AutoStage.DONE


def test_a_pool_too_small_for_a_chunk_raises_capacity_error_and_loses_nothing():
    local = LocalStore(pool_bytes=48 * KiB)
    store = _store(local)
    small = torch.randn(1024)                    # 4 KiB: fits in the first chunk
    kept = store.save(small)
    with pytest.raises(CapacityError, match=f"activation chunk {PREFIX}/1 .*recompute"):
        store.save(torch.randn(40 * KiB // 4))   # 40 KiB: a chunk of its own, no room
    assert torch.equal(store.load(kept), small)  # what was saved before is intact
    store.close()
    assert local.used_bytes == 0 and local.keys() == []


def test_a_chunk_gone_from_the_store_raises_on_load_and_close_still_frees():
    local = LocalStore()
    store = _store(local)
    saved = store.save(torch.randn(1024))
    store.flush()
    local.delete(local.keys(PREFIX))             # e.g. the job's keys deleted by hand
    with pytest.raises(UnknownKey):
        store.load(saved)
    store.end_backward()
    store.close()
    assert store.live_chunks() == 0 and local.used_bytes == 0


def test_end_backward_releases_every_lease_and_frees_chunks_of_dropped_handles():
    local = LocalStore()
    store = _store(local, chunk_bytes=8 * KiB, prefetch_bytes=4 * KiB)
    values = [torch.full((1024,), float(i)) for i in range(6)]   # 4 KiB each: 3 chunks
    handles = [store.save(v) for v in values]
    for i in (5, 4, 3):
        assert torch.equal(store.load(handles[i]), values[i])
    del handles[3:]                               # autograd freed what ran
    store.end_backward()
    left = local.keys(PREFIX)
    assert store.live_chunks() == len(left) == 2 and _no_leases_left(local, left)
    assert store.restored_bytes() == 0
    for i in (2, 1, 0):                           # a later backward of the rest
        assert torch.equal(store.load(handles[i]), values[i])
    handles.clear()
    store.end_backward()
    assert local.keys(PREFIX) == [] and local.used_bytes == 0
    store.close()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                    for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_tier_activations_on_the_in_process_store_matches_torch(policy):
    ref = _Net()
    x = torch.randn(16, 32)
    ref(x).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters()}
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    local = LocalStore(pool_bytes=1 << 20)
    with tier_activations(model, local, policy=policy, min_bytes=0, verbose=False) as handle:
        for _ in range(2):
            model(x).backward()
            for n, p in model.named_parameters():
                assert torch.equal(p.grad, want[n]), n
            model.zero_grad(set_to_none=True)
            assert local.used_bytes == 0
        assert (handle.stats()["d2h_bytes"] > 0) == (policy != "recompute")
