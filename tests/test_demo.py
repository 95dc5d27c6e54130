"""``tierd demo``: the README's first command, on the CPU."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios

from tierd.demo.run import options, run
from tests.conftest import subprocess_env, tierd_command


def test_demo_three_steps_exits_0_spills_to_nvme_and_shows_a_progress_bar(tmp_path):
    """Run as a user would, on a terminal (a pty): step lines and a tqdm bar."""
    env = dict(subprocess_env(), XDG_CACHE_HOME=str(tmp_path / "cache"))
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))  # 200 columns
    proc = subprocess.Popen(tierd_command("demo", "--steps", "3"), stdin=subprocess.DEVNULL,
                            stdout=child, stderr=child, env=env)
    os.close(child)
    output = read_until_closed(main).replace("\r\n", "\n")
    assert proc.wait(600) == 0, output
    # a line printed above the bar comes after the bar's erasure (\r, spaces, \r)
    steps = re.findall(r"(?:^|\r)step +(\d+)/3 +loss +([0-9.]+)", output, re.M)
    assert [s for s, _ in steps] == ["1", "2", "3"], output
    assert re.search(r"training: +\d+%\|.*\| [123]/3 .*loss=", output), output
    # gpt2-small's private pool is smaller than its model state: tensors
    # must have gone to NVMe and come back.
    moved = re.search(r"daemon moved (.+) to NVMe and (.+) to the pool", output)
    assert moved and moved.group(1) != "0 B" and moved.group(2) != "0 B", output


def read_until_closed(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:            # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


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
