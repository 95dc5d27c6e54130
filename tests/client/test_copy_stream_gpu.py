"""The copy stream on CUDA: memory of a freed copy-in buffer goes to the
next copy in at once, and that copy writes it only after the compute
stream's reads queued before the free ([Note: copy-in memory reused in
stream order] in tierd.client.copy_stream)."""

from __future__ import annotations

import pytest
import torch

from tierd.client.copy_stream import CopyStream

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_freed_copy_in_buffer_is_reused_at_once_and_written_after_its_last_read():
    device = torch.device("cuda")
    copy = CopyStream(device)
    n = 1 << 22
    ones, twos = torch.ones(n).pin_memory(), torch.full((n,), 2.0).pin_memory()
    (first,), landed = copy.copy_in_new([ones], ("a",))
    copy.wait(landed)
    torch.cuda._sleep(200_000_000)   # the compute stream is busy well past the free below
    total = first.sum()              # a read queued behind it
    address = first.data_ptr()
    del first, landed                # freed by the host, read by the device later
    (second,), landed = copy.copy_in_new([twos], ("b",))
    assert second.data_ptr() == address, "the freed buffer's memory was held back"
    copy.wait(landed)
    assert total.item() == n         # the read saw the first values, not the second
    assert second.sum().item() == 2 * n


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
