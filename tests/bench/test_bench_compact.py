"""``python -m tierd.bench.compact`` end to end on a tiny GPT-2 on the CPU (a
real embedded daemon): the JSON has a run per setting with its loss curve and
figures. Checks the output's shape, never an accuracy: that is for the GPU run."""

from __future__ import annotations

import json

import pytest

from tierd.bench import compact


def test_a_run_per_setting_with_its_curve_sizes_and_ratio_to_fp32(tmp_path):
    out = tmp_path / "out"
    compact.main(["--out", str(out), "--tiny", "--steps", "2", "--device", "cpu",
                  "--settings", "8bit-bf16,fp32"])
    result = json.loads((out / "compact.json").read_text())
    assert result["device"] == "cpu" and result["commit"] is not None
    assert result["args"]["steps"] == 2 and result["args"]["layers"] == 2
    fp32, small = result["runs"]   # in the settings' own order
    assert (fp32["setting"], fp32["state"], fp32["master"]) == ("fp32", "fp32", "fp32")
    assert (small["setting"], small["state"], small["master"]) == ("8bit-bf16", "8bit", "bf16")
    for run in (fp32, small):
        assert len(run["losses"]) == 2 and all(loss > 0 for loss in run["losses"])
        assert run["final_loss"] == run["losses"][-1] and run["eval_loss"] > 0
        assert run["seconds"] > 0
    assert fp32["final_vs_fp32"] == 0.0 and fp32["eval_vs_fp32"] == 0.0
    assert small["final_vs_fp32"] == pytest.approx(small["final_loss"] / fp32["final_loss"] - 1)
    assert fp32["bytes_per_param"] == 14.0      # bf16 copy, fp32 master, two fp32 moments
    assert small["bytes_per_param"] < 6.0


def test_settings_in_separate_calls_compare_to_the_first_calls_fp32_run(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--tiny", "--steps", "2", "--device", "cpu"]
    compact.main(["--out", str(first), *common, "--settings", "fp32"])
    compact.main(["--out", str(second), *common, "--settings", "bf16",
                  "--reference", str(first / "compact.json")])
    result = json.loads((second / "compact.json").read_text())
    fp32, bf16 = result["runs"]
    assert fp32["setting"] == "fp32" and fp32["reference"] == str(first / "compact.json")
    assert bf16["final_vs_fp32"] == pytest.approx(bf16["final_loss"] / fp32["final_loss"] - 1)
    with pytest.raises(SystemExit, match="other arguments"):
        compact.main(["--out", str(tmp_path / "third"), *common, "--steps", "3",
                      "--settings", "bf16", "--reference", str(first / "compact.json")])


def test_the_corpus_is_the_same_for_every_setting_and_follows_its_chain():
    import torch
    batch = compact.corpus(vocab=1000, used=50, branch=3, seed=0)
    a = batch(4, 20, torch.Generator().manual_seed(1))
    b = batch(4, 20, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == (4, 20)
    assert len(a.unique()) <= 50
    # every token is followed by at most three distinct successors
    pairs: dict[int, set] = {}
    for row in batch(64, 40, torch.Generator().manual_seed(2)).tolist():
        for x, y in zip(row, row[1:]):
            pairs.setdefault(x, set()).add(y)
    assert max(len(s) for s in pairs.values()) <= 3


def test_an_unknown_setting_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compact.main(["--out", str(tmp_path), "--settings", "int4"])
    assert "fp32, bf16, 8bit, 8bit-bf16" in capsys.readouterr().err


def test_plot_draws_the_curves_of_an_earlier_run(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"device": "cpu", "args": {"steps": 3, "layers": 2, "width": 64, "batch": 4,
                                        "seq": 32},
              "runs": [{"setting": s, "losses": [6.0, 5.5, 5.2], "bytes_per_param": b,
                        "final_loss": 5.2} for s, b in (("fp32", 14.0), ("8bit", 8.2))]}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(result))
    compact.main(["--out", str(tmp_path / "png"), "--plot", str(path)])
    assert (tmp_path / "png" / "compact.png").read_bytes()[:4] == b"\x89PNG"
