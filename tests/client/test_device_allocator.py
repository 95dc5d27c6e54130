"""Attach turns the CUDA caching allocator's expandable segments on unless the
process already chose ([Note: expandable segments] in
tierd.client.device_allocator); the choice is the attach's or the user's."""

from __future__ import annotations

import pytest
import torch

import tierd
from tierd.client import device_allocator, torch_internals
from tierd.client.attach import attach
from tierd.client.attach_config import AttachConfig
from tierd.client.device_allocator import use_expandable_segments, wants_expandable
from tests.client.models import gpt2

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("device,setting,env,current,want", [
    (CUDA, None, {}, "", True),
    (CUDA, None, {}, None, True),                      # a torch that cannot say
    (CPU, None, {}, "", False),                        # no CUDA allocator to set
    (CPU, True, {}, "", False),
    (CUDA, False, {}, "", False),
    (CUDA, None, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "", True),
    (CUDA, None, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "", False),
    (CUDA, None, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "", False),
    (CUDA, None, {}, "expandable_segments:False", False),   # set while running
    (CUDA, True, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "", True),
])
def test_the_users_choice_stands_unless_the_attach_says_otherwise(device, setting, env,
                                                                  current, want):
    assert wants_expandable(device, setting, env=env, current=current) is want


@pytest.fixture
def settings(monkeypatch):
    """The allocator's settings as torch_internals reads and sets them, recorded."""
    state = {"current": "", "set": []}
    monkeypatch.setattr(torch_internals, "allocator_settings", lambda: state["current"])

    def set_(text):
        state["set"].append(text)
        state["current"] = text
    monkeypatch.setattr(torch_internals, "set_allocator_settings", set_)
    for name in device_allocator._ENV:
        monkeypatch.delenv(name, raising=False)
    return state


def test_attach_on_cuda_sets_expandable_segments_once(settings):
    assert use_expandable_segments(CUDA, None)
    assert not use_expandable_segments(CUDA, None)    # a second attach finds them on
    assert not use_expandable_segments(CUDA, True)
    assert settings["set"] == ["expandable_segments:True"]


def test_nothing_is_set_on_the_cpu_or_when_the_attach_says_no(settings, monkeypatch):
    assert not use_expandable_segments(CPU, None)
    assert not use_expandable_segments(CUDA, False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not use_expandable_segments(CUDA, None)
    assert settings["set"] == []


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_a_setting_that_is_not_a_bool_is_refused(bad):
    with pytest.raises(ValueError, match="expandable_segments"):
        AttachConfig(expandable_segments=bad)


def test_attach_on_the_cpu_leaves_the_allocator_as_it_is(settings, daemon):
    model = attach(gpt2(n_layer=2, n_embd=64, vocab=100), client=tierd.connect(daemon),
                   device="cpu")
    assert settings["set"] == []
    tierd.detach(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", [None, False])
def test_segments_made_after_attach_on_cuda_are_expandable(setting, daemon, monkeypatch):
    for name in device_allocator._ENV:
        monkeypatch.delenv(name, raising=False)
    before = torch_internals.allocator_settings()
    torch_internals.set_allocator_settings("expandable_segments:False")
    try:
        model = attach(gpt2(n_layer=2, n_embd=64, vocab=100), client=tierd.connect(daemon),
                       expandable_segments=setting)
        x = torch.empty(96 << 20, dtype=torch.uint8, device="cuda")   # a segment of its own
        made = [s for s in torch.cuda.memory_snapshot()
                if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
        assert len(made) == 1 and bool(made[0].get("is_expandable")) is (setting is None)
        del x
        tierd.detach(model)
    finally:
        torch_internals.set_allocator_settings(before or "expandable_segments:False")
