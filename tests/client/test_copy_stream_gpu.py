"""The copy stream on CUDA: a parameter's buffer freed and filled again
keeps the values each compute read queued before the free saw, however far
the device lags the host."""

from __future__ import annotations

import pytest
import torch

from tierd.client.copy_stream import CopyStream

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_parameter_buffer_freed_and_filled_again_keeps_its_reads():
    device = torch.device("cuda")
    copy = CopyStream(device)
    n = 1 << 22
    param = torch.empty(n, device=device)
    param.untyped_storage().resize_(0)
    totals = []
    for value in (1.0, 2.0, 3.0):
        copy.allocate_for_copy_in(param, 4 * n)
        copy.wait(copy.copy_in_many([(param, torch.full((n,), value).pin_memory())], ("p",)))
        torch.cuda._sleep(50_000_000)
        totals.append(param.sum())
        param.untyped_storage().resize_(0)
    assert [t.item() for t in totals] == [n, 2 * n, 3 * n]
