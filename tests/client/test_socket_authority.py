"""An explicit socket (argument, ``$TIERD_SOCKET``, ``--socket``) is the
daemon the operator means: with nothing there a job fails naming the path,
and no private daemon is started ([Note: an explicit socket is authoritative]
in ``tierd.client.embedded``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tierd
from tests.conftest import ROOT, subprocess_env
from tierd.cli import main
from tierd.client import embedded
from tierd.errors import DaemonUnavailable


@pytest.fixture
def fresh_embedded(monkeypatch, tmp_path):
    """A fresh embedded-daemon holder, nothing at the default socket path."""
    fresh = embedded._Embedded()
    monkeypatch.setattr(embedded, "_EMBEDDED", fresh)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TIERD_NVME", str(tmp_path / "nvme"))
    monkeypatch.delenv("TIERD_SOCKET", raising=False)
    yield fresh
    fresh.stop()


def test_dead_tierd_socket_fails_attach_naming_the_path(fresh_embedded, monkeypatch, tmp_path):
    dead = tmp_path / "none" / "t.sock"
    monkeypatch.setenv("TIERD_SOCKET", str(dead))
    model = torch.nn.Linear(8, 8)
    with pytest.raises(DaemonUnavailable, match=f"no tierd daemon at {dead}.*TIERD_SOCKET"):
        tierd.attach(model)
    assert fresh_embedded.daemon is None                    # no private daemon started
    assert isinstance(model.weight, torch.nn.Parameter) and model.weight.numel() == 64


def test_dead_socket_argument_fails_ensure_daemon(fresh_embedded, tmp_path):
    dead = tmp_path / "gone.sock"
    with pytest.raises(DaemonUnavailable, match=f"no tierd daemon at {dead}"):
        embedded.ensure_daemon(dead)
    assert fresh_embedded.daemon is None


def test_explicit_socket_with_a_daemon_is_used(fresh_embedded, monkeypatch, daemon):
    monkeypatch.setenv("TIERD_SOCKET", str(daemon.socket))
    assert embedded.ensure_daemon() == daemon.socket
    assert fresh_embedded.daemon is None


def test_no_socket_configured_starts_the_embedded_daemon(fresh_embedded):
    choice = embedded.resolve_socket()
    assert not choice.explicit and "XDG_RUNTIME_DIR" in choice.why
    sock = embedded.ensure_daemon()
    assert fresh_embedded.running() is not None and sock == fresh_embedded.daemon.socket


def test_resolve_socket_says_why():
    assert embedded.resolve_socket("/x/t.sock").why == "given as an argument"


def test_demo_honours_tierd_socket(fresh_embedded, monkeypatch, tmp_path, capsys):
    dead = tmp_path / "none" / "t.sock"
    monkeypatch.setenv("TIERD_SOCKET", str(dead))
    assert main(["demo", "--steps", "1", "--no-progress"]) == 2
    assert f"no tierd daemon at {dead}" in capsys.readouterr().err


def test_demo_trains_on_the_daemon_at_tierd_socket(monkeypatch, daemon):
    env = dict(subprocess_env(), TIERD_SOCKET=str(daemon.socket))
    proc = subprocess.run([sys.executable, "-m", "tierd", "demo", "--steps", "1", "--seq-len",
                           "32", "--batch-size", "2", "--no-progress"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "private" not in proc.stdout and "pool 64.0 MiB" in proc.stdout
