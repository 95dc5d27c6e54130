"""One daemon, many jobs: isolation, users, quotas, dead and stalled clients."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

import tierd
from tierd import protocol as P
from tierd.client.control import ControlChannel
from tests.conftest import start_daemon, subprocess_env, tierd_command

MiB = 1 << 20


def wait_until(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_guessed_keys_of_another_job_give_nothing_also_after_it_died(daemon):
    script = ("import tierd, torch, sys\n"
              "c = tierd.connect(sys.argv[1])\n"           # default job: ends with the process
              "c.put('weights', torch.ones(1000))\n"
              "n = tierd.connect(sys.argv[1], job='named')\n"
              "n.put('weights', torch.ones(1000))\n"
              "print(c.job, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, str(daemon.socket)], env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    dead_job = out.stdout.strip()
    with daemon.connect(job="intruder") as c:
        for key in ("weights", f"{dead_job}/weights", "../named/weights", "named/weights"):
            with pytest.raises(KeyError):
                c.get(key)
            with pytest.raises(KeyError):
                c.lease([key])
            with pytest.raises(KeyError):
                c.evict([key])
            with pytest.raises(KeyError):
                c.delete([key])
        assert c.keys() == []
        jobs = c.stats()["jobs"]
    assert dead_job not in jobs                  # the process's default job ended with it
    assert jobs["named"]["tensors"] == 1         # a named job lives on


def test_drop_job_from_the_client_and_the_cli(daemon):
    with daemon.connect(job="tmp") as c:
        c.put_many({"a": torch.ones(10), "b": torch.ones(10)})
        c.drop_job()
        assert c.keys() == []
        c.put("c", torch.ones(3))
    out = subprocess.run(tierd_command("drop-job", "tmp", "--socket", str(daemon.socket)),
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "1 tensors" in out.stdout, out.stderr
    with daemon.connect(job="tmp") as c:
        assert c.keys() == []


def _reclaimed(stats: dict, baseline: int) -> bool:
    return stats["sessions"] == 1 and stats["pool_used_bytes"] == baseline


def test_killed_clients_give_everything_back_within_a_second(daemon):
    with daemon.connect(job="victim") as owner:
        owner.put_many({f"w{i}": torch.full((MiB // 4,), float(i)) for i in range(4)})
        baseline = owner.stats()["pool_used_bytes"]
        for _ in range(20):
            child = os.fork()
            if child == 0:                       # the client that will be killed
                try:
                    c = daemon.connect(job="victim")
                    c.lease([f"w{i}" for i in range(4)])
                    c._call(P.Reserve((P.TensorSpec("half", "float32", (MiB,), 4 * MiB),)))
                finally:
                    os.kill(os.getpid(), signal.SIGKILL)
            os.waitpid(child, 0)
            # the session gone, not only the slot: a child that died before its
            # reserve landed leaves pool_used at the baseline with its leases still held
            wait_until(lambda: _reclaimed(owner.stats(), baseline), 1.0,
                       "the dead client's session was not reclaimed within 1 s")
            assert owner.keys() == ["w0", "w1", "w2", "w3"]      # committed tensors stay
        owner.evict([f"w{i}" for i in range(4)])                 # no lease left behind
        assert torch.equal(owner.get("w3"), torch.full((MiB // 4,), 3.0))


def test_a_forked_child_holding_the_socket_does_not_keep_a_dead_session(daemon):
    script = ("import tierd, torch, sys, os, time\n"
              "c = tierd.connect(sys.argv[1], job='forky')\n"
              "c.put('x', torch.ones(10)); c.lease(['x'])\n"
              "if os.fork() == 0:\n"
              "    time.sleep(30); os._exit(0)\n"     # inherits the control socket
              "print(os.getpid(), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(daemon.socket)],
                            env=subprocess_env(), stdout=subprocess.PIPE, text=True)
    proc.wait(60)
    with daemon.connect(job="forky") as c:
        def released() -> bool:
            try:
                c.evict(["x"])
                return True
            except tierd.StateError:
                return False
        wait_until(released, 1.0, "lease of an exited process kept alive by its child")


def test_quotas_from_the_config_file(daemon_factory, tmp_path):
    config = tmp_path / "tierd.toml"
    config.write_text('[serve]\ndefault-pool-quota = "8MiB"\n\n'
                      '[jobs.capped]\npool_quota = "4MiB"\nnvme_quota = "8MiB"\n')
    d = daemon_factory(extra=("--config", str(config)))
    with d.connect(job="capped") as capped, d.connect(job="free") as free:
        for i in range(4):      # 2 MiB each, + a 4 KiB NVMe record header
            capped.put(f"k{i}", torch.zeros(MiB // 2))
        assert capped.stats()["jobs"]["capped"]["pool_used_bytes"] <= 4 * MiB
        with pytest.raises(tierd.CapacityError, match="quota"):
            capped.put("k4", torch.zeros(MiB // 2))
        free.put("f", torch.zeros(MiB))                          # others unaffected
        assert all(torch.equal(capped.get(f"k{i}"), torch.zeros(MiB // 2)) for i in range(4))


def test_a_stalled_client_does_not_stall_others(daemon, client):
    started = time.monotonic()
    stalled = ControlChannel(daemon.socket, "stall")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, stalled.token)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 0)
    sock.connect(f"ipc://{daemon.socket}")
    frame = P.encode_request(1, P.Stats())
    done = threading.Event()
    errors: list[Exception] = []

    def round_trips() -> None:
        try:
            for i in range(200):
                client.put("k", torch.full((100,), float(i)))
                assert torch.equal(client.get("k"), torch.full((100,), float(i)))
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=round_trips)
    worker.start()
    sent = 0
    while not done.wait(0.001):                # flood, never reading a single reply
        for _ in range(200):
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                break
        assert time.monotonic() - started < 60, "round trips stalled behind the flood"
    worker.join()
    assert not errors, errors
    assert sent >= 1000                        # the stalled peer's queues were full
    sock.close()
    stalled.close()


def test_too_many_requests_in_flight_get_busy(daemon_factory, monkeypatch):
    monkeypatch.setenv("TIERD_MAX_REQUESTS_PER_CLIENT", "2")
    d = daemon_factory()
    with d.connect() as c:
        keys = [f"k{i}" for i in range(16)]
        c.put_many({k: torch.zeros(MiB // 4) for k in keys})
        c.evict(keys)
        pending = [c.lease_async([k]) for k in keys]     # each waits on NVMe
        busy = ok = 0
        for p in pending:
            try:
                p.result()
                ok += 1
            except tierd.Busy:
                busy += 1
        assert busy > 0 and ok >= 2
        assert torch.equal(c.get("k15"), torch.zeros(MiB // 4))   # and the daemon is fine


def run_as(user: pwd.struct_passwd, fn) -> str:
    """Run ``fn()`` in a forked child as ``user`` (python is already loaded, so
    the child needs no access to the interpreter's files); return its output."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        try:
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = fn()
        except BaseException as exc:   # reported to the parent through the pipe
            out = f"{type(exc).__name__}: {exc}"
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(child, 0)
    return out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="needs root and useradd to create two OS users")
def test_another_os_user_cannot_join_or_map_a_job():
    users = []
    for name in ("tierd-alice", "tierd-bob"):
        subprocess.run(["useradd", "--no-create-home", name], capture_output=True)
        users.append(pwd.getpwnam(name))
    shared = Path(f"/tmp/tierd-shared-{os.getpid()}")
    shared.mkdir(mode=0o755, exist_ok=True)
    d = start_daemon(shared)
    try:
        os.chmod(shared, 0o755)                  # an operator's shared socket
        for p in (d.socket, d.socket.with_name("tierd.sock.ctl")):
            os.chmod(p, 0o666)

        def alice() -> str:
            c = tierd.connect(d.socket, job="alice-job")
            c.put("w", torch.ones(4))
            c.get("w")
            return " ".join(map(str, c.segment_views()))

        def bob(segments: str):
            def run() -> str:
                try:
                    tierd.connect(d.socket, job="alice-job")
                    return "JOINED"
                except tierd.StateError as exc:
                    refused = str(exc)
                ch = ControlChannel(d.socket, None)   # bob's own job
                try:
                    ch.map([int(s) for s in segments.split()])
                    return "MAPPED " + refused
                except tierd.TierdError as exc:
                    return f"{refused} | {exc}"
            return run

        segments = run_as(users[0], alice)
        assert segments and segments.replace(" ", "").isdigit(), segments
        out = run_as(users[1], bob(segments))
        assert "belongs to uid" in out and "did not hand over pool segments" in out, out
        with tierd.connect(d.socket, job="alice-job") as root:   # root may (configurable)
            assert torch.equal(root.get("w"), torch.ones(4))
    finally:
        d.stop()
        shutil.rmtree(shared, ignore_errors=True)
