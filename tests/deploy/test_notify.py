"""``Type=notify``: the daemon sends READY=1 to ``$NOTIFY_SOCKET`` once jobs can connect."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import tierd
from tests.conftest import subprocess_env, tierd_command
from tierd.server import notify


def test_daemon_notifies_ready_when_its_sockets_listen(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(120)
    sock = tmp_path / "tierd.sock"
    env = dict(subprocess_env(), NOTIFY_SOCKET=str(tmp_path / "notify"))
    env.pop("SYSTEMD_EXEC_PID", None)
    proc = subprocess.Popen(tierd_command("serve", "--nvme", str(tmp_path / "nvme"), "--socket",
                                          str(sock), "--pool", "16MiB", "--nvme-size", "64MiB"),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        fields = dict(line.split("=", 1) for line in listener.recv(4096).decode().splitlines())
        assert fields["READY"] == "1" and fields["MAINPID"] == str(proc.pid)
        assert str(sock) in fields["STATUS"]
        tierd.connect(sock).close()                 # ready means a job can connect now
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        listener.close()


def test_notify_reaches_abstract_sockets_and_skips_when_not_under_systemd():
    name = f"tierd-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind("\0" + name)
        assert notify.ready("up", env={"NOTIFY_SOCKET": "@" + name})
        assert listener.recv(4096).decode().startswith("READY=1\nSTATUS=up\n")
        # a child of the unit's main process (a job's embedded daemon) stays quiet
        assert not notify.ready("up", env={"NOTIFY_SOCKET": "@" + name,
                                           "SYSTEMD_EXEC_PID": str(os.getpid() + 1)})
    assert not notify.ready("up", env={})
    assert not notify.ready("up", env={"NOTIFY_SOCKET": "@" + name})   # nobody listens: no raise
