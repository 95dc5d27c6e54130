"""tierd.optim against torch.optim on an attached model (real daemon)."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach
from tests.client.models import assert_same_weights, batches, gpt2, train


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.5, dampening=0.1, maximize=True),
])
def test_sgd_matches_torch_bitwise(daemon, kwargs):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.SGD(model.parameters(), **kwargs)
    ref_opt = torch.optim.SGD(ref.parameters(), foreach=False, **kwargs)
    data = batches(3)
    assert train(model, opt, data) == train(ref, ref_opt, data)
    assert_same_weights(model, ref)


def test_adamw_cpu_placement_param_groups_and_no_zero_grad(daemon):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon),
                   optimizer_placement="cpu")

    def groups(m):
        decay = [p for n, p in m.named_parameters() if p.ndim == 2]
        rest = [p for n, p in m.named_parameters() if p.ndim != 2]
        return [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]

    # fused=False: updated in step(), so gradients may keep accumulating across steps
    opt = tierd.optim.AdamW(groups(model), lr=1e-3, betas=(0.8, 0.99), eps=1e-6, fused=False)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-3, betas=(0.8, 0.99), eps=1e-6,
                                foreach=False)
    for ids in batches(3):   # never zero_grad: gradients keep accumulating, as in torch
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
    assert_same_weights(model, ref)


def test_lr_scheduler_drives_tierd_optimizer(daemon):
    ref = gpt2()
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for ids in batches(3):
        assert train(model, opt, [ids]) == train(ref, ref_opt, [ids])
        sched.step(); ref_sched.step()
    assert_same_weights(model, ref)


def test_arguments_are_validated():
    with pytest.raises(ValueError, match="betas"):
        tierd.optim.AdamW([], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="nesterov"):
        tierd.optim.SGD([], nesterov=True)
