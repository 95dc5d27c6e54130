"""``python -m tierd.bench.attach --quick``: every case runs, checks the stored
values against the source and reports its figures. Checks behaviour and the
output's shape, never a timing."""

from __future__ import annotations

import json

import pytest

from tierd.bench import attach as bench


def test_quick_run_reports_every_case(tmp_path):
    out = bench.main(["--quick", "--tmp", str(tmp_path), "--json", str(tmp_path / "a.json")])
    cases = [r["case"] for r in out["rows"]]
    assert cases[:3] == ["cpu fp32 model, compute bf16", "cpu fp32 model, compute fp32",
                         "weights= bf16 file, meta fp32 model, compute bf16"]
    assert cases[-4:] == ["zeros by put_many, fresh pool", "zeros by put_many, warm pool",
                          "zeros by put_zeros, fresh pool", "zeros by put_zeros, warm pool"]
    for r in out["rows"]:
        assert r["bytes"] > 0 and r["seconds"] > 0 and r["gb_per_s"] > 0, r
    by_case = {r["case"]: r for r in out["rows"]}
    params = by_case["cpu fp32 model, compute bf16"]["params"]
    assert by_case["cpu fp32 model, compute bf16"]["bytes"] == 6 * params   # bf16 + fp32 master
    assert by_case["cpu fp32 model, compute fp32"]["bytes"] == 4 * params
    # a bf16 file's values are the masters already: the first update makes them
    weights = by_case["weights= bf16 file, meta fp32 model, compute bf16"]
    assert weights["bytes"] == 2 * params and weights["master_bytes"] == 0
    assert json.loads((tmp_path / "a.json").read_text())["rows"] == out["rows"]


def test_cases_picks_the_rows_and_refuses_an_unknown_one(tmp_path, capsys):
    out = bench.main(["--quick", "--tmp", str(tmp_path), "--cases", "weights,cpu-bf16"])
    assert [r["case"] for r in out["rows"]] == [
        "cpu fp32 model, compute bf16", "weights= bf16 file, meta fp32 model, compute bf16"]
    assert all(r["daemon_segment_wait_s"] >= 0 for r in out["rows"])
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--cases", "cpu-bf16,gpu-fp8"])
    assert "unknown gpu-fp8" in capsys.readouterr().err


def test_a_wrong_stored_value_fails_the_case():
    model = bench.build(_Tiny())
    expected = model.layers[0].gate.weight.detach().clone()
    bench._check(model, expected)
    expected[0, 0] += 1
    with pytest.raises(AssertionError, match="differs"):
        bench._check(model, expected)


class _Tiny:
    layers, d, ff, kv, vocab = 1, 8, 16, 4, 10
