"""The GPU tier sharded by unit (``gpu_tier="sharded"``) under torch.distributed
(gloo, CPU): each resident unit's optimizer state lives on its owner only,
which sends the other ranks the new weights ([Note: resident state sharded by
unit] in ``tierd.client.sharded``).

Ranks are real processes sharing a real daemon (``tests/client/dist_worker.py``).
The owner runs the same update a replica would, on the same averaged
gradient, so a sharded run is bitwise the replicated one; against one process
with the global batch it agrees within ``TOL`` (gradients summed in another
order: tests/client/test_distributed.py).
"""

from __future__ import annotations

import pytest
import torch

import tierd
from tests.client.models import gpt2
from tests.client.test_distributed import assert_matches, run_ranks
from tests.client.test_distributed_placement import EMBEDDING_CAP
from tests.conftest import start_daemon
from tierd.client.attach import attach, is_attached
from tierd.client.attach_config import AttachConfig
from tierd.client.distributed import check_agreement, signature
from tierd.errors import StateError

WHOLE_CAP = 1 << 30   # the whole model stays on the device


def _assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Both runs without error, each with one plan on every rank, bitwise the
    same losses and values (placement moves values, it never changes them)."""
    for run in (a, b):
        for r in run:
            assert "error" not in r and "exited" not in r, r
            assert r["session"]["placement"] == "placed", r["session"]
            assert r["plan"] == run[0]["plan"]
    for x, y in zip(a, b):
        assert x["losses"] == y["losses"]
        for name, want in y["weights"].items():
            assert torch.equal(x["weights"][name], want), f"rank {x['rank']}: {name}"
            assert torch.equal(x["detached"][name], want), f"rank {x['rank']}: {name}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sharded_units_train_bitwise_as_replicas(daemon_factory, tmp_path_factory, dtype):
    """A plan with resident, weights-only and streamed units: sharded trains
    bitwise as replicated (and within TOL of one process in fp32); the values
    read while placed and after detach are the full ones on every rank."""
    daemon = daemon_factory(pool="256MiB")
    args = ("--steps", "4", "--tierd", "--module-units", "--compute-dtype", dtype,
            "--gpu-memory-bytes", str(EMBEDDING_CAP))
    replicated = run_ranks(tmp_path_factory.mktemp("replicated"), [daemon.socket] * 2, *args,
                           "--job", "replicated")
    sharded = run_ranks(tmp_path_factory.mktemp("sharded"), [daemon.socket] * 2, *args,
                        "--job", "sharded", "--gpu-tier", "sharded")
    _assert_same_run(sharded, replicated)
    assert "resident" in sharded[0]["plan"]["places"].values()
    # the state sharding leaves off a rank's device keeps more units resident
    # ([Note: one budget on every rank] in tierd.client.placement)
    plans = [r[0]["plan"] for r in (sharded, replicated)]
    assert plans[0]["streamed_bytes"] < plans[1]["streamed_bytes"], plans
    resident = [{i for i, p in plan["places"].items() if p == "resident"} for plan in plans]
    assert resident[0] > resident[1], plans
    if dtype == "fp32":
        ref = run_ranks(tmp_path_factory.mktemp("ref"), [None], "--steps", "4")[0]
        assert_matches(sharded, ref)


def test_a_sharded_rank_holds_its_share_of_the_resident_state(daemon_factory, tmp_path_factory):
    """The whole model placed on the device (fp32, a unit per block and the
    rest): by tierd's own count a replicated rank holds every unit's weights
    and state, a sharded rank the weights and its own units' state; the
    ranks' states add up to one copy, split about evenly."""
    daemon = daemon_factory(pool="256MiB")
    args = ("--steps", "3", "--tierd", "--gpu-memory-bytes", str(WHOLE_CAP))
    replicated = run_ranks(tmp_path_factory.mktemp("replicated"), [daemon.socket] * 2, *args,
                           "--job", "replicated")
    sharded = run_ranks(tmp_path_factory.mktemp("sharded"), [daemon.socket] * 2, *args,
                        "--job", "sharded", "--gpu-tier", "sharded")
    _assert_same_run(sharded, replicated)
    assert set(sharded[0]["plan"]["places"].values()) == {"resident"}
    weights = 4 * sum(v.numel() for k, v in replicated[0]["weights"].items()
                      if not k.startswith("lm_head"))   # tied to the embedding
    held = [r["session"]["resident_bytes"] for r in replicated]
    assert held[0] == held[1]
    state = held[0] - weights
    assert state >= 2 * weights   # AdamW's two moments at least
    mine = [r["session"]["resident_bytes"] - weights for r in sharded]
    print("replicated", held, "sharded", [r["session"]["resident_bytes"] for r in sharded],
          "weights", weights)
    assert sum(mine) == state
    assert all(0.4 * state <= m <= 0.6 * state for m in mine), (mine, state)


def test_a_sharded_run_resumes_from_its_commit_bitwise(tmp_path_factory):
    """Commit after step 1 (the owners write their resident state back), stop
    the daemon, resume on a new one over the same NVMe directory: steps 3-4
    and the values are bitwise those of a run that never stopped."""
    node = tmp_path_factory.mktemp("node")
    args = ("--tierd", "--module-units", "--job", "res", "--gpu-tier", "sharded",
            "--gpu-memory-bytes", str(EMBEDDING_CAP))
    daemon = start_daemon(tmp_path_factory.mktemp("whole"), pool="256MiB")
    try:
        whole = run_ranks(tmp_path_factory.mktemp("whole_run"), [daemon.socket] * 2,
                          "--steps", "4", *args)
    finally:
        daemon.stop()
    first = start_daemon(node, pool="256MiB")
    try:   # placed from its second step on: the commit after it writes resident state back
        before = run_ranks(tmp_path_factory.mktemp("first"), [first.socket] * 2,
                           "--steps", "2", "--commit-at", "1", *args)
    finally:
        first.stop()
    again = start_daemon(node, pool="256MiB")   # same NVMe dir: recovers the commit
    try:
        resumed = run_ranks(tmp_path_factory.mktemp("second"), [again.socket] * 2,
                            "--steps", "4", "--resume", "--start-step", "2", *args)
    finally:
        again.stop()
    for r in whole + before + resumed:
        assert "error" not in r and "exited" not in r, r
    assert "resident" in before[0]["plan"]["places"].values()
    for r, w in zip(resumed, whole):
        assert r["plan"] == w["plan"]
        assert r["losses"] == w["losses"][2:]
        for name, want in w["weights"].items():
            assert torch.equal(r["weights"][name], want), name
            assert torch.equal(r["detached"][name], want), name


def test_an_unknown_gpu_tier_is_refused():
    with pytest.raises(ValueError, match=r"gpu_tier='zero3'; use one of \('replicated', "
                                         r"'sharded'\)"):
        AttachConfig(gpu_tier="zero3")


def test_sharded_without_a_process_group_is_refused_before_anything_is_stored(daemon):
    model = gpt2()
    params = dict(model.named_parameters())
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ValueError, match="gpu_tier='sharded' shares the GPU tier among the "
                                         "ranks .*init_process_group first"):
        attach(model, client=tierd.connect(daemon.socket, job="lone"), job="lone",
               device="cpu", gpu_tier="sharded")
    assert not is_attached(model)
    assert all(p is params[k] and torch.equal(p, before[k]) for k, p in model.named_parameters())
    with daemon.connect(job="lone") as client:
        assert client.keys("tierd-attach/") == []


def test_ranks_that_disagree_on_the_gpu_tier_are_refused():
    """Every rank gets this error at attach (tierd.client.distributed.join)."""
    model = gpt2()
    ranks = [dict(rank=r, host="h", socket="s", job="j", device="cpu", gpus=0, backend="gloo",
                  model=signature(model, AttachConfig(gpu_tier=tier)))
             for r, tier in enumerate(["replicated", "sharded"])]
    with pytest.raises(StateError, match=r"ranks \[1\] differ from rank 0 .*'sharded'\) vs"):
        check_agreement(ranks)


def test_sharded_units_updated_in_step_with_clipping_and_windows(daemon_factory,
                                                                  tmp_path_factory):
    """With max_grad_norm the update runs in ``step()``: replicas cannot keep
    such units (at most their weights), their owners can. Windows of two
    backwards: the owner sums them in the pool. Bitwise the replicated run,
    within TOL of one process."""
    args = ("--steps", "3", "--accumulate", "2", "--clip", "0.5")
    ref = run_ranks(tmp_path_factory.mktemp("ref"), [None], *args)[0]
    daemon = daemon_factory(pool="256MiB")
    placed = (*args, "--tierd", "--module-units", "--gpu-memory-bytes", str(EMBEDDING_CAP))
    replicated = run_ranks(tmp_path_factory.mktemp("replicated"), [daemon.socket] * 2,
                           *placed, "--job", "replicated")
    sharded = run_ranks(tmp_path_factory.mktemp("sharded"), [daemon.socket] * 2, *placed,
                        "--job", "sharded", "--gpu-tier", "sharded")
    assert "resident" not in replicated[0]["plan"]["places"].values()
    assert "resident" in sharded[0]["plan"]["places"].values()
    for x, y in zip(sharded, replicated):
        assert "error" not in x and "error" not in y, (x, y)
        assert x["losses"] == y["losses"]
        for name, want in y["weights"].items():
            assert torch.equal(x["weights"][name], want), f"rank {x['rank']}: {name}"
    assert_matches(sharded, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_one_gpu_shard_bitwise_like_replicas(daemon_factory, tmp_path_factory):
    """Two gloo ranks share cuda:0, bf16 compute: whatever fits in 256 MiB is
    resident; sharded gives bitwise the replicated run's losses and values,
    and each rank holds less than a replica."""
    daemon = daemon_factory(pool="256MiB")
    args = ("--steps", "4", "--tierd", "--device", "cuda:0", "--compute-dtype", "bf16",
            "--gpu-memory-bytes", str(256 << 20))
    replicated = run_ranks(tmp_path_factory.mktemp("replicated"), [daemon.socket] * 2, *args,
                           "--job", "replicated")
    sharded = run_ranks(tmp_path_factory.mktemp("sharded"), [daemon.socket] * 2, *args,
                        "--job", "sharded", "--gpu-tier", "sharded")
    _assert_same_run(sharded, replicated)
    assert "resident" in sharded[0]["plan"]["places"].values()
    for s, r in zip(sharded, replicated):
        assert s["session"]["resident_bytes"] < r["session"]["resident_bytes"]


def test_two_nodes_shard_within_each_node(daemon_factory, tmp_path_factory):
    """Two nodes (daemons) of two ranks: gradients are summed across both
    nodes, each node's owner updates and sends the new weights to its node's
    other rank over a group of that node's ranks. Bitwise the replicated
    run, within TOL of one process."""
    a, b = daemon_factory(pool="256MiB"), daemon_factory(pool="256MiB")
    sockets = [a.socket, a.socket, b.socket, b.socket]
    args = ("--steps", "4", "--tierd", "--module-units", "--gpu-memory-bytes",
            str(EMBEDDING_CAP))
    replicated = run_ranks(tmp_path_factory.mktemp("replicated"), sockets, *args,
                           "--job", "replicated")
    sharded = run_ranks(tmp_path_factory.mktemp("sharded"), sockets, *args, "--job", "sharded",
                        "--gpu-tier", "sharded")
    _assert_same_run(sharded, replicated)
    assert "resident" in sharded[0]["plan"]["places"].values()
    ref = run_ranks(tmp_path_factory.mktemp("ref"), [None], "--steps", "4")[0]
    assert_matches(sharded, ref)
