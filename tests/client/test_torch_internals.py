"""Each private torch API tierd uses still behaves as tierd needs.

A failure here names the API a torch release changed; fix
``tierd/client/torch_internals.py`` before anything else."""

from __future__ import annotations

import gc

import torch
from torch import nn

from tierd.client import torch_internals as ti


def test_current_graph_task_is_minus_one_outside_and_set_inside_backward():
    assert ti.current_graph_task() == -1 and not ti.in_backward()
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append((ti.current_graph_task(), ti.in_backward())))
    y.sum().backward()
    assert len(seen) == 1 and seen[0][0] != -1 and seen[0][1]


def test_engine_callback_runs_after_every_node_of_the_backward():
    order = []
    x = torch.ones(2, requires_grad=True)
    a = x * 2
    b = a * 3

    def first(g):
        ti.queue_engine_callback(lambda: order.append("end"))
        order.append("b")
    b.register_hook(first)
    a.register_hook(lambda g: order.append("a"))
    b.sum().backward()
    assert order == ["b", "a", "end"]


def test_storage_id_is_shared_by_views_and_data_not_by_copies():
    t = torch.zeros(4, 4)
    assert ti.storage_id(t) == ti.storage_id(t.t()) == ti.storage_id(t.data) == ti.storage_id(t[1:])
    assert ti.storage_id(t.clone()) != ti.storage_id(t)


def test_storage_ref_says_when_a_storage_is_freed():
    t = torch.zeros(8)
    ref = ti.StorageRef(t.untyped_storage())
    assert not ref.expired()
    del t
    gc.collect()
    assert ref.expired()


def test_checkpoint_generator_recomputes_the_call_in_backward():
    calls = []

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            calls.append(ti.in_backward())
            return torch.tanh(self.lin(x))

    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 3)
    ref = block(x).sum()
    ref.backward()
    want = block.lin.weight.grad.clone()
    block.zero_grad()
    calls.clear()
    gen = ti.checkpoint_without_reentrant(block, x)
    next(gen)
    out = block(x)
    next(gen, None)
    out.sum().backward()
    assert calls == [False, True]   # run once, then recomputed inside backward
    torch.testing.assert_close(block.lin.weight.grad, want, rtol=0, atol=0)


def test_tree_flatten_finds_and_tree_map_replaces_nested_tensors():
    a, b = torch.ones(2), torch.zeros(2)
    nested = ([a, (b, 3)], {"k": a})
    assert [t is a or t is b for t in ti.tree_flatten(nested)[0]
            if isinstance(t, torch.Tensor)] == [True, True, True]
    swapped = ti.tree_map(lambda x: b if x is a else x, nested)
    assert swapped[0][0] is b and swapped[1]["k"] is b and swapped[0][1][1] == 3


def test_fused_adamw_is_torch_fused_adamw_bitwise():
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(2)]
    mine = [p.detach().clone() for p in ref]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    for step in (1, 2, 3):
        grads = [torch.randn(7, 3) for _ in ref]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        ti.fused_adamw(mine, grads, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                       weight_decay=0.1, eps=1e-8, maximize=False)
    assert all(torch.equal(a, b.detach()) for a, b in zip(mine, ref))


def test_foreach_adamw_is_torch_single_tensor_adamw_bitwise():
    torch.manual_seed(1)
    ref = [torch.nn.Parameter(torch.randn(5, 4)) for _ in range(3)]
    mine = [p.detach().clone() for p in ref]
    opt = torch.optim.AdamW(ref, lr=3e-3, weight_decay=0.05, foreach=False, maximize=True)
    m = [torch.zeros_like(p) for p in mine]
    v = [torch.zeros_like(p) for p in mine]
    for step in (1, 2):
        grads = [torch.randn(5, 4) for _ in ref]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        ti.foreach_adamw(mine, grads, m, v, step=step, lr=3e-3, beta1=0.9, beta2=0.999,
                         weight_decay=0.05, eps=1e-8, maximize=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(mine, ref))


def test_compiled_modules_are_told_apart_and_graph_breaks_counted():
    lin = nn.Linear(2, 2)
    compiled = torch.compile(lin, backend="eager")
    assert ti.is_compiled_module(compiled) and not ti.is_compiled_module(lin)

    def broken(x):
        x = x + 1
        print(end="")   # a graph break
        return x * 2
    ti.dynamo_reset()
    torch.compile(broken, backend="eager")(torch.ones(2))
    assert ti.dynamo_graph_breaks() >= 1
    ti.dynamo_reset()
    assert ti.dynamo_graph_breaks() == 0


def test_dynamo_frames_compiled_rises_on_a_recompile_and_not_on_a_warm_call():
    def double(x):
        return x * 2
    ti.dynamo_reset()
    compiled = torch.compile(double, backend="eager", dynamic=False)
    compiled(torch.ones(2))
    warm = ti.dynamo_frames_compiled()
    assert warm >= 1
    compiled(torch.ones(2))                          # guards pass: no compile
    assert ti.dynamo_frames_compiled() == warm
    compiled(torch.ones(2, dtype=torch.float64))     # a dtype guard fails: a recompile
    assert ti.dynamo_frames_compiled() > warm
    ti.dynamo_reset()
    assert ti.dynamo_frames_compiled() == 0


def test_compiled_regions_counted_and_forgotten_code_traced_again():
    """A graph break splits a call into two compiled frames; forgetting
    compiled code makes the next call compile again."""
    def broken(x):
        x = x + 1
        print(end="")   # a graph break
        return x * 2
    ti.dynamo_reset()
    compiled = torch.compile(broken, backend="eager")
    compiled(torch.ones(2))
    assert ti.compiled_regions_run(lambda: compiled(torch.ones(2))) == 2
    assert ti.compiled_regions_run(lambda: broken(torch.ones(2))) == 0
    warm = ti.dynamo_frames_compiled()
    ti.forget_compiled_code()
    compiled(torch.ones(2))
    assert ti.dynamo_frames_compiled() > warm


def test_free_pinned_host_cache_needs_cuda():
    assert ti.free_pinned_host_cache() is torch.cuda.is_available()


def test_allocator_settings_are_read_back_as_set():
    before = ti.allocator_settings()
    assert before is not None   # this torch can say; else wants_expandable reads env only
    try:
        ti.set_allocator_settings("expandable_segments:False")
        assert "expandable_segments:False" in ti.allocator_settings()
        ti.set_allocator_settings("expandable_segments:True")
        assert "expandable_segments:True" in ti.allocator_settings()
    finally:
        ti.set_allocator_settings(before or "expandable_segments:False")
