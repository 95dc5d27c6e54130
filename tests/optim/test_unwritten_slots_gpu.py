"""[Note: slots the update writes first] in tierd.optim.state, on CUDA with a
real daemon: the first ``step()`` stores the moments its device update makes
and the masters it casts without writing zeros into pool bytes used before,
and trains bitwise like the same run storing them as zeros."""

from __future__ import annotations

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.client.placer import Placer
from tierd.optim.state import UnmadeState
from tests.client.models import batches, gpt2

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(daemon, data) -> tuple[list[float], dict, int]:
    """Three steps updated in ``step()``, every unit streamed; pool bytes the
    job used just before its first update (keys put and deleted) are reused
    by its state. The bytes the daemon zeroed in the first step, too."""
    client = tierd.connect(daemon)
    model = attach(gpt2(n_layer=4, n_embd=128), client=client, compute_dtype="bf16",
                   gpu_memory_bytes=0)
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=False)
    losses, zeroed = [], 0
    for i, ids in enumerate(data):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
        if i == 0:   # 8 MiB used, then freed: the lowest free bytes
            scratch = {f"scratch/{j}": torch.ones(1 << 18) for j in range(8)}
            client.put_many(scratch)
            client.delete(list(scratch))
        before = client.stats()["pool_zeroed_bytes"]
        opt.step()
        opt.zero_grad()
        if i == 0:
            zeroed = client.stats()["pool_zeroed_bytes"] - before
            assert not opt.unmade.blank and not opt.unmade.cast
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert session_of(model).params   # attached to the end
    tierd.detach(model)
    return losses, state, zeroed


def test_the_first_step_writes_no_zeros_for_state_its_device_update_makes(daemon, monkeypatch):
    monkeypatch.setattr(Placer, "_memory", lambda self: None)   # placed from the cap alone
    data = batches(3, batch=2, seq=16)
    blank = _run(daemon, data)
    store_zeros = UnmadeState.ensure_stored

    def zeros(self, tps, *, cast_masters=False, on_device=frozenset()):
        return store_zeros(self, tps, cast_masters=cast_masters)   # moments: put_zeros

    monkeypatch.setattr(UnmadeState, "ensure_stored", zeros)
    zeroed = _run(daemon, data)
    assert zeroed[2] > 0          # the reference wrote zeros into the used bytes
    assert blank[2] == 0          # this one wrote none
    assert blank[0] == zeroed[0]
    assert all(torch.equal(blank[1][k], v) for k, v in zeroed[1].items())
