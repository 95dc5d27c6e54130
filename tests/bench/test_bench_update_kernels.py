"""``python -m tierd.bench.update_kernels`` on the CPU: each setting's update
timed both ways against fp32 AdamW, with the bytes its stored state moves."""

from __future__ import annotations

import json

import pytest

from tierd.bench import update_kernels


def test_each_setting_is_timed_both_ways_against_fp32_and_written(tmp_path):
    result = update_kernels.main(["--out", str(tmp_path), "--numel", "4096", "--tensors", "2",
                                  "--warmup", "1", "--repeats", "1", "--compiled"])
    assert json.loads((tmp_path / "update-kernels-cpu.json").read_text()) == result
    rows = [(r["setting"], r["way"]) for r in result["rows"]]
    assert rows == [("fp32", "torch")] + [(s, w) for s in ("bf16", "8bit", "8bit-bf16")
                                          for w in ("compiled", "eager")]
    per_param = {r["setting"]: r["bytes_per_param"] for r in result["rows"]}
    # fp32 p/g/m/v 4 B each; 8-bit moments 1 B + a 4 B scale per 256
    assert per_param == pytest.approx({"fp32": 28, "bf16": 20, "8bit": 16 + 4 * 4 / 256,
                                       "8bit-bf16": 10 + 4 * 4 / 256})
    for r in result["rows"]:
        assert r["params"] == 8192 and len(r["times_s"]) == 2 and r["s_per_gparam"] > 0
    assert result["rows"][0]["to_fp32"] == 1.0


def test_without_compiled_the_cpu_runs_the_eager_way_only(tmp_path):
    result = update_kernels.main(["--out", str(tmp_path), "--settings", "8bit", "--numel",
                                  "4096", "--tensors", "1", "--warmup", "0", "--repeats", "1"])
    assert [(r["setting"], r["way"]) for r in result["rows"]] == [("fp32", "torch"),
                                                                  ("8bit", "eager")]


@pytest.mark.parametrize("flags", [["--settings", "int4"], ["--numel", "1000"],
                                   ["--repeats", "0"]])
def test_bad_flags_are_refused(tmp_path, flags, capsys):
    with pytest.raises(SystemExit):
        update_kernels.main(["--out", str(tmp_path), *flags])
    assert "error:" in capsys.readouterr().err
