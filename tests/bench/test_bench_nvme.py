"""``python -m tierd.bench.nvme --quick``: one run writes ``nvme.json`` with the
raw sweep, tierd's figures through a real daemon and their ratios; a bad size
is refused before anything runs. Checks the shape, never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env
from tierd.backends import recordio
from tierd.bench import nvme


def test_quick_run_writes_raw_tierd_and_ratios(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "tierd.bench.nvme", "--quick", "--dir",
                           str(tmp_path / "disk"), "--out", str(out)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "nvme.json").read_text())
    assert {"commit", "device", "disk", "command"} <= set(result)
    assert result["checksum"] == recordio.ALGO_NAMES[recordio.DEFAULT_ALGO]
    sweep = result["raw"]["sweep"]
    assert {(p["request_bytes"], p["depth"]) for p in sweep} == {
        (r, d) for r in (1 << 20, 8 << 20) for d in (1, 8)}
    for way in ("write", "read"):
        chosen = result["raw"][way]
        assert (chosen["request_bytes"], chosen["depth"]) in {(p["request_bytes"], p["depth"])
                                                              for p in sweep}
        assert chosen["GBps"] > 0
    assert result["tierd"]["spill_GBps"] > 0 and result["tierd"]["fetch_GBps"] > 0
    assert set(result["ratios"]) == {"spill", "fetch", "first_touch_spill", "first_touch_fetch"}
    assert len(result["rounds"]) == 1 and result["keys"] * result["tensor_bytes"] == result["bytes"]
    assert "spill (pool->NVMe)" in proc.stdout and "fetch (NVMe->pool)" in proc.stdout
    assert not list((tmp_path / "disk").iterdir())   # the raw file and the daemon's are gone


@pytest.mark.parametrize("argv, message", [
    (["--gib", "0.01"], "raise --gib or lower --tensor-mib"),
    (["--rounds", "-1"], "rounds=-1"),
])
def test_a_bad_size_is_refused_naming_the_fix(tmp_path, capsys, argv, message):
    code = nvme.main(["--dir", str(tmp_path / "disk"), "--out", str(tmp_path / "out"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "disk").exists() and not (tmp_path / "out").exists()
