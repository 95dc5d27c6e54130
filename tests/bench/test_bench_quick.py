"""``tierd bench`` from the source tree: ``--only`` picks sections, a bad
section name is refused before anything runs, a missing peer is one line.

The whole ``--quick`` suite runs from an installed wheel in
tests/test_package.py. Checks the shape of the output, never a timing:
figures are for people.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env
from tierd.bench import report, run, training
from tierd.cli import main


def test_only_runs_the_named_sections(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tierd", "bench", "--quick", "--only", "1",
                           "--out", str(tmp_path), "--nvme", str(tmp_path / "nvme")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-quick.json")
    sections = json.loads(path.read_text())["sections"]
    assert list(sections) == list(run.SECTIONS)
    assert sections["limits"]["status"] == "ok" and sections["limits"]["rows"]
    for name in list(run.SECTIONS)[1:]:
        assert sections[name] == {"title": run.SECTIONS[name][0], "status": "skipped",
                                  "reason": "not selected (--only)", "rows": []}
    assert "] limits: ok" in proc.stderr


def test_an_unknown_section_is_refused_with_the_list_of_sections(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", "limits,warp", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown section 'warp'" in err
    for i, name in enumerate(run.SECTIONS, 1):
        assert f"{i} {name}" in err
    assert not out.exists()   # refused before anything was measured or written


def test_a_missing_peer_is_one_table_line_saying_why(monkeypatch):
    real = training.importlib.util.find_spec
    monkeypatch.setattr(training.importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else real(name, *a))
    results, rows = training.measured(ctx=None, names=("accelerate",))   # starts no worker
    assert results == {}
    text = report.table({"sections": {"forward": {"title": "4 forward only", "status": "ok",
                                                  "rows": rows}}})
    lines = text.splitlines()[1:]
    assert len(lines) == 1
    assert "accelerate cpu_offload" in lines[0] and "accelerate is not installed" in lines[0]


def test_an_out_that_cannot_hold_results_is_refused_before_measuring(tmp_path, monkeypatch):
    taken = tmp_path / "results"
    taken.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", str(taken)])
    assert f"--out {taken}: cannot write results there" in str(exc.value.code)
    assert taken.read_text() == "not a directory"
    assert not (tmp_path / "cache").exists()   # no daemon or NVMe dir was started


def _bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "tierd", "bench", "--quick", *args,
                           "--out", str(tmp_path), "--nvme", str(tmp_path / "nvme")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    (path,) = tmp_path.glob("*-quick.json")
    return proc, json.loads(path.read_text())["sections"]


def test_the_control_section_measures_the_hooks(tmp_path):
    proc, sections = _bench(tmp_path, "--only", "control")
    assert proc.returncode == 0, proc.stderr[-3000:]
    control = sections["control"]
    assert control["status"] == "ok"
    (r,) = control["rows"]
    assert "error" not in r, r.get("log", r)
    assert r["hook_calls"] > 0 and r["hook_s"] > 0 and 0 < r["share"]
    assert "] control: ok" in proc.stderr


def test_a_failed_section_makes_the_run_fail_and_is_named(tmp_path):
    # a budget far below what the limits take: the section times out
    proc, sections = _bench(tmp_path, "--only", "limits", "--budget-s", "0.001")
    assert proc.returncode == 1
    assert sections["limits"]["status"] == "timeout"
    assert "tierd bench: 1 section failed: limits (timeout" in proc.stderr
