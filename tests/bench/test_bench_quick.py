"""The benchmark suite runs end to end (``--quick``) and writes its JSON.

Checks the shape of the output, never a timing: figures are for people.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env

SECTIONS = {"limits", "dataplane", "training", "forward", "control", "multijob"}


def test_quick_run_writes_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tierd.bench.run", "--quick", "--out", str(tmp_path),
                           "--nvme", str(tmp_path / "nvme")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    results = json.loads(files[0].read_text())
    assert set(results) >= {"meta", "sections"}
    assert set(results["sections"]) == SECTIONS
    for name, section in results["sections"].items():
        assert section["status"] in ("ok", "skipped", "timeout"), (name, section)
        assert isinstance(section["rows"], list)
    assert results["sections"]["limits"]["rows"]
    assert results["sections"]["dataplane"]["rows"]
