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

from tests.client.test_distributed import assert_matches, run_ranks
from tests.client.test_distributed_placement import EMBEDDING_CAP
from tests.conftest import start_daemon

WHOLE_CAP = 1 << 30   # the whole model stays on the device


def _assert_same_run(a: list[dict], b: list[dict]) -> None:
    """Both runs without error, with one plan, bitwise the same losses and values."""
    for r in a + b:
        assert "error" not in r and "exited" not in r, r
        assert r["session"]["placement"] == "placed", r["session"]
        assert r["plan"] == a[0]["plan"]
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
    if dtype == "fp32":
        ref = run_ranks(tmp_path_factory.mktemp("ref"), [None], "--steps", "4")[0]
        assert_matches(sharded, ref)
