"""A tierd optimizer's state_dict()/load_state_dict() in torch's format
(real daemon): saved to a file and loaded into a fresh attach, a torch
optimizer's dict loaded, bad input refused with nothing changed."""

from __future__ import annotations

import copy

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach
from tierd.errors import StateError
from tests.client.models import assert_same_weights, batches, gpt2, llama, train


def _fresh(daemon, weights):
    """A new attach of a GPT-2 holding ``weights``, and a tierd AdamW on it."""
    model = gpt2()
    model.load_state_dict(weights)
    model = attach(model, client=tierd.connect(daemon))
    return model, tierd.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _same_state(got: dict, want: dict) -> None:
    assert got["state"].keys() == want["state"].keys()
    for i, entry in want["state"].items():
        assert got["state"][i].keys() == entry.keys(), i
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(got["state"][i][k]).float(),
                               torch.as_tensor(v).float()), (i, k)


def test_saved_to_a_file_and_loaded_into_a_fresh_attach_trains_on_bitwise(daemon, tmp_path):
    data = batches(6)
    ref = gpt2()
    start = copy.deepcopy(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    straight, straight_opt = _fresh(daemon, start)   # uninterrupted tierd run
    train(straight, straight_opt, data)
    train(ref, ref_opt, data)

    model, opt = _fresh(daemon, start)
    train(model, opt, data[:3])
    saved = opt.state_dict()
    assert sorted(saved["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    assert saved["state"][0]["step"].item() == 3.0
    torch.save({"model": model.state_dict(), "optimizer": saved}, tmp_path / "ckpt.pt")
    tierd.detach(model)

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed, resumed_opt = _fresh(daemon, ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    _same_state(resumed_opt.state_dict(), saved)
    train(resumed, resumed_opt, data[3:])
    assert_same_weights(resumed, straight)
    assert_same_weights(resumed, ref)
    _same_state(resumed_opt.state_dict(), ref_opt.state_dict())


def test_a_torch_adamw_state_dict_moves_a_run_to_tierd(daemon):
    data = batches(5)
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    train(ref, ref_opt, data[:2])
    model, opt = _fresh(daemon, ref.state_dict())
    opt.load_state_dict(ref_opt.state_dict())
    train(ref, ref_opt, data[2:])
    train(model, opt, data[2:])
    assert_same_weights(model, ref)


def test_loading_its_own_state_dict_after_a_step_changes_nothing(daemon):
    """What torch allows and accelerate's AcceleratedOptimizer does when it wraps."""
    data = batches(4)
    ref = gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=False)
    model = attach(copy.deepcopy(ref), client=tierd.connect(daemon))
    opt = tierd.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for ids in data:
        train(ref, ref_opt, [ids])
        train(model, opt, [ids])
        opt.load_state_dict(opt.state_dict())
    assert_same_weights(model, ref)
    _same_state({"state": {i: {"momentum_buffer": e["momentum_buffer"]}
                           for i, e in opt.state_dict()["state"].items()}},
                ref_opt.state_dict())


def test_accelerate_prepare_after_a_step(daemon):
    from accelerate import Accelerator
    data = batches(4)
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    model, opt = _fresh(daemon, ref.state_dict())
    opt.param_groups[0]["weight_decay"] = ref_opt.param_groups[0]["weight_decay"]
    train(ref, ref_opt, data)
    train(model, opt, data[:2])
    model, opt = Accelerator(cpu=True).prepare(model, opt)
    train(model, opt, data[2:])
    assert_same_weights(model, ref)


def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing(daemon):
    data = batches(4)
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    model, opt = _fresh(daemon, ref.state_dict())
    train(ref, ref_opt, data[:2])
    train(model, opt, data[:2])
    good = opt.state_dict()

    other = attach(llama(), client=tierd.connect(daemon))
    other_opt = tierd.optim.AdamW(other.parameters(), lr=1e-2)
    train(other, other_opt, data[:1])
    bad_shape = copy.deepcopy(good)
    bad_shape["state"][1]["exp_avg"] = bad_shape["state"][1]["exp_avg"][:1]
    missing = copy.deepcopy(good)
    del missing["state"][2]["exp_avg_sq"]
    stray = copy.deepcopy(good)
    stray["state"][999] = stray["state"][0]
    for bad, match in ((other_opt.state_dict(), r"has \d+ parameters, this optimizer's \d+"),
                       (bad_shape, r"'exp_avg' of parameter 1 .* is a torch.float32 tensor of "
                                   r"shape \(1, 64\)"),
                       (missing, r"parameter 2 .* lacks \['exp_avg_sq'\]"),
                       (stray, "state for parameter 999"),
                       ({"state": {}}, "'state' and 'param_groups'"),
                       (torch.optim.SGD(gpt2().parameters(), lr=0.1).state_dict(),
                        r"lacks \['betas', 'eps'\]")):
        before = copy.deepcopy(opt.param_groups[0]["lr"])
        with pytest.raises(StateError, match=match):
            opt.load_state_dict(bad)
        assert opt.param_groups[0]["lr"] == before
        _same_state(opt.state_dict(), good)
    train(ref, ref_opt, data[2:])
    train(model, opt, data[2:])
    assert_same_weights(model, ref)
