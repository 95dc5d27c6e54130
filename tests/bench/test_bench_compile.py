"""``python -m tierd.bench.compile_step`` end to end on a tiny GPT-2 on the CPU
(aot_eager backend): the JSON it writes has every run and the summary. Checks
the shape of the output, never a timing: figures are for people (and GPUs)."""

from __future__ import annotations

import json

from tierd.bench import compile_step


def test_compile_step_writes_every_run_and_the_checks(tmp_path):
    out = tmp_path / "out"
    compile_step.main(["--out", str(out), "--layers", "1", "--d", "128", "--seq", "16",
                       "--batch", "2", "--steps", "1", "--warmup", "0", "--backend",
                       "aot_eager", "--device", "cpu", "--pool-gib", "1", "--nvme-gib", "1"])
    result = json.loads((out / "compile_step.json").read_text())
    for side in ("all_gpu", "tierd"):
        assert set(result[side]) == {"eager", "compiled"}
        assert all(run["step_s"] > 0 for run in result[side].values())
    assert result["tierd"]["compiled"]["graph_breaks"] > 0   # it really was compiled
    assert set(result["summary"]) == {"gain_all_gpu", "gain_tierd", "compiled_not_slower",
                                      "gain_within_5pct", "tierd_vs_all_gpu_compiled"}
