"""``tierd demo``: the README's first command, on the CPU."""

from __future__ import annotations

import re
import subprocess

from tierd.demo.run import options, run
from tests.conftest import subprocess_env, tierd_command


def test_demo_three_steps_exits_0_and_spills_to_nvme(tmp_path):
    env = dict(subprocess_env(), XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run(tierd_command("demo", "--steps", "3"), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^step +(\d+)/3 +loss +([0-9.]+)", proc.stdout, re.M)
    assert [s for s, _ in steps] == ["1", "2", "3"]
    # gpt2-small's private pool is smaller than its model state: tensors
    # must have gone to NVMe and come back.
    moved = re.search(r"daemon moved (.+) to NVMe and (.+) to the pool", proc.stdout)
    assert moved and moved.group(1) != "0 B" and moved.group(2) != "0 B", proc.stdout


def test_demo_loss_goes_down_on_the_demo_text(daemon):
    lines: list[str] = []
    result = run(options(steps=5, seq_len=64, socket=str(daemon.socket)), out=lines.append)
    assert len(result.losses) == 5
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    assert result.params > 0 and lines[-1].startswith("pool ")
    assert result.h2d_bytes >= 5 * result.params * 4   # every fp32 weight streamed in, each step


def test_demo_reuses_a_running_daemon_and_leaves_no_keys_behind(daemon):
    run(options(steps=1, seq_len=32, batch_size=2, socket=str(daemon.socket)))
    with daemon.connect() as c:
        stats = c.stats()
    assert stats["tensors"] == 0 and stats["pool_used_bytes"] == 0
