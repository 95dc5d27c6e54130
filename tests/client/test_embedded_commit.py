"""A commit on the embedded daemon does not outlive the process that started
it: commit warns once, and a later process's resume says why it finds no
commit and how to keep one (real processes, real embedded daemons)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import subprocess_env

FIRST = """
import json, warnings
import tierd, tierd.optim
from tests.client.models import batches, gpt2, train
model = tierd.attach(gpt2(), job="run1")
opt = tierd.optim.AdamW(model.parameters(), lr=1e-3)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("default")   # Python's own filter: once per calling line
    for step, ids in enumerate(batches(3), 1):
        train(model, opt, [ids])
        tierd.commit(model, opt, step)
print(json.dumps([str(w.message) for w in seen if "embedded" in str(w.message)]))
"""

SECOND = """
import tierd
from tests.client.models import gpt2
try:
    tierd.attach(gpt2(), job="run1", resume=True)
except tierd.StateError as exc:
    print(exc)
"""


def _run(code: str, tmp_path) -> str:
    env = dict(subprocess_env(), XDG_RUNTIME_DIR=str(tmp_path / "run"),   # no daemon at the
               TIERD_NVME=str(tmp_path / "nvme"), TIERD_POOL="256MiB",    # default socket
               TIERD_NVME_SIZE="256MiB")
    env.pop("TIERD_SOCKET", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_a_commit_on_the_embedded_daemon_warns_and_resume_says_why(tmp_path):
    warned = json.loads(_run(FIRST, tmp_path))
    assert len(warned) == 1   # three commits, one warning
    assert "deletes its state" in warned[0] and "tierd serve" in warned[0]
    assert not any((tmp_path / "nvme").iterdir())   # the embedded daemon's files are gone
    error = _run(SECOND, tmp_path)
    assert "has no commit to resume from" in error
    assert "started its own embedded daemon" in error and "tierd serve" in error
