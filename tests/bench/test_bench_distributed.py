"""``tierd.bench.distributed`` on the CPU (gloo, ``--quick``): the sharded
GPU tier's case and the FSDP2 peer run and land in the report with their
ratios; a case that cannot run is a row that says so. Checks the shape of
the output, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env
from tierd.bench import distributed


def test_quick_run_reports_the_sharded_tier_beside_fsdp2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tierd.bench.distributed", "--quick", "--arch", "llama",
         "--checkpointing", "--out", str(tmp_path), "--only", "sharded,fsdp2,fsdp2-offload"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "distributed.json").read_text())
    (rows,) = report["steps"].values()   # one batch size
    sharded, fsdp = rows["tierd-2-sharded"], rows["fsdp2-2"]
    assert sharded["step_s"] > 0
    assert sharded["pcie_per_gpu_gb"] and len(sharded["pcie_per_gpu_gb"]) == 2
    if fsdp.get("failed"):   # torch's gloo ranks now and then abort at exit on a loaded
        # machine ("terminate called without an active exception"): the row says so
        assert "vs_fsdp2_same_ranks" not in sharded
        assert (tmp_path / "fsdp2-2.log").read_text()
    else:
        assert sharded["vs_fsdp2_same_ranks"] > 0 and fsdp["vs_fsdp2_same_ranks"] == 1.0
    # CPUOffloadPolicy needs an accelerator: the row says it did not run
    assert rows["fsdp2-offload-2"] == {"failed": True}
    assert (tmp_path / "fsdp2-offload-2.log").read_text()
    table = (tmp_path / "distributed.md").read_text()
    assert "| tierd-2-sharded |" in table and "| fsdp2-offload-2 | did not run" in table


def test_llama_sizes_have_the_parameter_counts_their_rows_name():
    counts = {}
    for size, (layers, d, inter, heads, kv, vocab) in distributed.LLAMA.items():
        head = d // heads
        attn = d * d * 2 + 2 * d * kv * head
        counts[size] = layers * (attn + 3 * d * inter + 2 * d) + 2 * vocab * d + d
    assert 1.2e9 < counts["1.3b"] < 1.5e9
    assert 7.9e9 < counts["8b"] < 8.1e9
    assert 12.9e9 < counts["13b"] < 13.1e9
    assert 20e9 < counts["20b"] < 20.5e9
