"""``python -m tierd.bench.activations --quick`` runs every policy and budget end to
end and writes its JSON, Markdown and PNG. Checks the shape of the output and
that tiering moved bytes, never a timing: figures are for people."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

POLICIES = {"none", "save_on_cpu", "offload", "recompute", "auto"}


def test_quick_run_measures_every_policy_and_budget(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tierd.bench.activations", "--quick", "--steps", "1",
                           "--budget-s", "600", "--out", str(tmp_path),
                           "--nvme", str(tmp_path / "nvme")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "activations-cpu-quick.json").read_text())
    rows = results["rows"]
    assert {r["policy"] for r in rows} == POLICIES
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    for r in rows:
        assert r["peak_bytes"] >= 0 and r["step_s"] > 0 and r["steps_timed"] == 1
    by_policy = {r["policy"]: r for r in rows if r["policy"] != "auto"}
    assert by_policy["offload"]["d2h_bytes_per_step"] > 0      # bytes did go to the pool
    assert by_policy["recompute"]["d2h_bytes_per_step"] == 0
    autos = [r for r in rows if r["policy"] == "auto"]
    assert sorted(r["fraction"] for r in autos) == sorted(results["meta"]["fractions"])
    assert all(r["plan"] and r["budget_bytes"] > 0 for r in autos)
    budgets = results["budgets"]
    assert len(budgets) == len(autos)
    for v in budgets:
        assert set(v["fits"]) == POLICIES - {"auto"}
        assert v["auto_within_5pct"] in (True, False, None)
        assert v["auto_faster_than_save_on_cpu"] in (True, False, None)
    text = (tmp_path / "activations-cpu-quick.md").read_text()
    assert "## Per budget" in text and "save_on_cpu" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "activations-cpu-quick.png").stat().st_size > 0
