"""Placement under torch.distributed (gloo): every rank keeps the resident
units on its device as replicas, the rest streams from the node's one copy.

Ranks are real processes sharing a real daemon (``tests/client/dist_worker.py``).
On the CPU placement runs against an explicit ``gpu_memory_bytes``; the caps
below give this model (2-layer GPT-2, fp32, AdamW) a plan with units of
every kind: 266240 keeps the layer norms whole, the weights of the
embeddings and of most of the first layer, and streams the rest; 626240
keeps the tied embedding and more units whole and every other unit's weights.
"""

from __future__ import annotations

import pytest
import torch

from tests.client.test_distributed import assert_matches, run_ranks
from tests.conftest import start_daemon

# set for a unit per module owning parameters (dist_worker --module-units)
MIXED_CAP = 266240
EMBEDDING_CAP = 626240


@pytest.fixture(scope="module")
def reference4(tmp_path_factory) -> dict:
    """Plain torch, one process, global batch 4, 4 steps."""
    return run_ranks(tmp_path_factory.mktemp("ref4"), [None], "--steps", "4")[0]


def _assert_replicas(results: list[dict]) -> None:
    """Every rank holds the same plan and bitwise the same values."""
    first = results[0]
    for r in results:
        assert "error" not in r and "exited" not in r, r
        assert r["session"]["placement"] == "placed", r["session"]
        assert r["plan"] == first["plan"]
        for name, want in first["weights"].items():
            assert torch.equal(r["weights"][name], want), f"rank {r['rank']}: {name}"


def test_replicas_within_the_smallest_cap_commit_and_resume(daemon_factory, tmp_path_factory,
                                                           reference4):
    """Ranks asking for different caps get one plan within the smallest; the
    values match one process. A commit holds the owners' resident values: a
    resumed run (placed differently) continues bitwise as one that never
    stopped (placement does not change the math)."""
    daemon = daemon_factory(pool="256MiB")
    # the last rank asks for far more: both plan within the smallest cap
    full = run_ranks(tmp_path_factory.mktemp("full"), [daemon.socket] * 2, "--steps", "4",
                     "--tierd", "--module-units", "--gpu-memory-bytes", str(MIXED_CAP),
                     "--last-rank-gpu-memory-bytes", str(1 << 30))
    _assert_replicas(full)
    assert_matches(full, reference4)
    plan = full[0]["plan"]
    assert plan["device_bytes"] <= MIXED_CAP
    # a mixed plan: some units keep weights (or all) on the device, the rest stream
    assert {"weights", "stream"} <= set(plan["places"].values()) <= {"resident", "weights",
                                                                    "stream"}
    for r in full:
        assert r["session"]["resident_bytes"] > 0
        assert r["session"]["placement_replans"] == 0

    node = tmp_path_factory.mktemp("node")
    args = ("--tierd", "--module-units", "--job", "res", "--gpu-memory-bytes",
            str(EMBEDDING_CAP))
    first = start_daemon(node, pool="256MiB")
    try:   # placed from its second step on: the commit after it writes resident state back
        before = run_ranks(tmp_path_factory.mktemp("first"), [first.socket] * 2,
                           "--steps", "2", "--commit-at", "1", *args)
    finally:
        first.stop()
    _assert_replicas(before)
    assert "resident" in before[0]["plan"]["places"].values()
    again = start_daemon(node, pool="256MiB")   # same NVMe dir: recovers the commit
    try:
        resumed = run_ranks(tmp_path_factory.mktemp("second"), [again.socket] * 2,
                            "--steps", "4", "--resume", "--start-step", "2", *args)
    finally:
        again.stop()
    _assert_replicas(resumed)
    for r, f in zip(resumed, full):
        assert r["losses"] == f["losses"][2:]
        for name, want in f["weights"].items():
            assert torch.equal(r["weights"][name], want), name


def test_replicas_follow_windows_and_new_input_shapes(daemon_factory, tmp_path_factory):
    """Windows of two backwards (the replicas sum a window's gradients as the
    owner sums them in the pool); shorter sequences at step 3: every rank
    streams again (the owners write their resident units back first) and
    measures; step 4, a window of one backward updated in ``step()``, is
    placed again."""
    args = ("--steps", "5", "--accumulate", "2", "--short-seq-from", "3",
            "--short-last-window")
    ref = run_ranks(tmp_path_factory.mktemp("ref"), [None], *args)[0]
    results = run_ranks(tmp_path_factory.mktemp("ranks"),
                        [daemon_factory(pool="256MiB").socket] * 2, *args, "--tierd",
                        "--module-units", "--gpu-memory-bytes", str(EMBEDDING_CAP))
    _assert_replicas(results)
    assert "resident" in results[0]["plan"]["places"].values()
    assert_matches(results, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_one_gpu_keep_replicas_bitwise_like_streaming(daemon_factory,
                                                                    tmp_path_factory):
    """Two gloo ranks share cuda:0: placed (whatever fits in 256 MiB is
    resident) gives bitwise the values of everything streamed."""
    daemon = daemon_factory(pool="256MiB")
    args = ("--steps", "4", "--tierd", "--device", "cuda:0")
    placed = run_ranks(tmp_path_factory.mktemp("placed"), [daemon.socket] * 2, *args,
                       "--job", "placed", "--gpu-memory-bytes", str(256 << 20))
    streamed = run_ranks(tmp_path_factory.mktemp("streamed"), [daemon.socket] * 2, *args,
                         "--job", "streamed", "--gpu-memory-bytes", "0")
    _assert_replicas(placed)
    assert "resident" in placed[0]["plan"]["places"].values()
    for r in streamed:
        assert "error" not in r, r
    for p, s in zip(placed, streamed):
        assert p["losses"] == s["losses"]
        for name, want in s["weights"].items():
            assert torch.equal(p["weights"][name], want), name



def test_a_cap_too_small_on_one_rank_fails_attach_on_every_rank(daemon_factory, tmp_path):
    daemon = daemon_factory(pool="256MiB")
    results = run_ranks(tmp_path, [daemon.socket] * 2, "--steps", "1", "--tierd", "--job", "small",
                        "--module-units", "--gpu-memory-bytes", str(EMBEDDING_CAP),
                        "--last-rank-gpu-memory-bytes", "1000")
    for r in results:   # the same error everywhere, no rank left waiting
        assert r["error"].startswith("ValueError: gpu_memory_bytes=1000 is below"), r
        assert "a cap must be at least" in r["error"] and "of any rank" in r["error"]
    with daemon.connect(job="small") as client:   # the failed attach left nothing stored
        assert client.keys("tierd-attach/") == []


def test_a_fraction_cap_on_the_cpu_under_ranks_is_refused_before_anything_is_stored(
        daemon, tmp_path):
    """In-process gloo world of one: the cap is checked before the upload."""
    import torch.distributed as dist

    import tierd
    from tierd.client.attach import attach, is_attached
    from tests.client.models import llama
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        model = llama()
        params = dict(model.named_parameters())
        before = {k: v.detach().clone() for k, v in params.items()}
        with pytest.raises(ValueError, match="fraction of the device's memory"):
            attach(model, client=tierd.connect(daemon, job="frac"), job="frac", device="cpu",
                   process_group=dist.group.WORLD, gpu_memory_bytes=0.5)
    finally:
        dist.destroy_process_group()
    assert not is_attached(model)
    assert all(p is params[k] and torch.equal(p, before[k]) for k, p in model.named_parameters())
    with daemon.connect(job="frac") as client:
        assert client.keys("tierd-attach/") == []
