"""``python -m tierd.bench.placement --tiny`` end to end on the CPU: every
case gets a row with the issue's fields, measured both ways (synchronized
steps and back to back), and the capped case a floor. Checks the shape of
the output, never a timing."""

from __future__ import annotations

import json

from tierd.bench import placement


def test_placement_writes_a_row_per_case_with_both_timings(tmp_path):
    out = tmp_path / "out"
    placement.main(["--out", str(out), "--tiny", "--commit", "0" * 40])
    result = json.loads((out / "placement.json").read_text())
    assert result["commit"] == "0" * 40 and result["device"] == "cpu"
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == {case for case, *_ in placement.TINY}
    for r in rows.values():
        assert r["error"] is None
        for k in ("allgpu_s", "tierd_s", "allgpu_run_s", "tierd_run_s"):
            assert r[k] > 0, k
    capped = rows["tiny B=2 train, cap 2 MB"]
    assert capped["placement"] == "placed"   # on the CPU only an explicit cap places
    assert capped["floor_s"] >= capped["allgpu_s"]
    assert rows["tiny B=2 train"]["floor_s"] is None   # uncapped: no floor


def test_case_runs_only_the_cases_it_names(tmp_path):
    placement.main(["--out", str(tmp_path), "--tiny", "--case", "cap 2 MB"])
    rows = json.loads((tmp_path / "placement.json").read_text())["rows"]
    assert sorted(r["case"] for r in rows) == ["tiny B=2 train, cap 2 MB",
                                               "tiny B=2 train, checkpointing, cap 2 MB"]


def test_a_floor_without_the_all_gpu_step_uses_tierds_own_compute():
    # the 8B reference runs out of GPU memory: tierd's compute-stream busy time stands in
    row = {"allgpu_s": None, "tierd_diag": {"compute_busy_s": 0.7}, "planned_pcie_gb": 50.0}
    assert placement.floor(row, 100e9) == 0.7
    assert placement.floor({**row, "planned_pcie_gb": 100.0}, 100e9) == 1.0   # PCIe-bound
    assert placement.floor({**row, "allgpu_s": 0.9}, 100e9) == 0.9
    assert placement.floor({**row, "tierd_diag": None}, 100e9) is None   # CPU: no profile
