"""Nothing a client sends stops the daemon, and jobs stay private: one test
per way a client, a disk or an operator once broke it (real daemon processes,
real sockets and files)."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

import tierd
from tierd import protocol as P
from tierd.backends.manifest import ManifestStore
from tierd.client.control import ControlChannel
from tests.conftest import ROOT, subprocess_env, tierd_command
from tests.faults import harness

MiB = 1 << 20


def session_socket(d, job: str | None = None):
    """A control session and a DEALER speaking on it with raw frames."""
    ctl = ControlChannel(d.socket, job)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ctl.token)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"ipc://{d.socket}")
    return ctl, sock


def still_serving(d) -> None:
    assert d.alive(), d.output()[-2000:]
    with d.connect() as c:
        c.put("probe", torch.arange(100))
        assert torch.equal(c.get("probe"), torch.arange(100))


@pytest.fixture
def daemon(tmp_path):
    d = harness.start(tmp_path / "d")
    yield d
    d.stop()


# ------------------------------------------------- requests in isolation
@pytest.mark.parametrize("op", [[1, 2], {"a": 1}, 3.5, b"stats", None])
def test_an_op_of_any_type_is_a_protocol_error(daemon, op):
    ctl, sock = session_socket(daemon)
    sock.send(msgpack.packb({"v": P.VERSION, "id": 7, "op": op, "body": {}}))
    rid, (code, message) = P.decode_reply(sock.recv())
    assert (rid, code) == (7, "protocol") and "unknown op" in message
    sock.close()
    ctl.close()
    still_serving(daemon)


def test_a_failing_loop_stops_the_daemon_with_a_non_zero_status(tmp_path):
    script = harness.LAUNCHER.replace(
        "from tierd.server.daemon import serve",
        "from tierd.server.daemon import Daemon, serve\n"
        "async def broken(self):\n    raise RuntimeError('injected router failure')\n"
        "Daemon._router_loop = broken")
    (tmp_path / "nvme").mkdir()
    out = subprocess.run([sys.executable, "-c", script, str(ROOT / "tierd"), str(tmp_path / "nvme"),
                          str(tmp_path / "s.sock"), "16MiB", "64MiB", "{}"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert "injected router failure" in out.stderr and out.stderr.count("Traceback") == 1


# ------------------------------------------------------------ exhaustion
def test_more_than_253_segments_in_one_message_is_refused_and_the_client_batches(daemon):
    raw = socket.socket(socket.AF_UNIX)
    raw.settimeout(10)
    raw.connect(str(daemon.socket) + ".ctl")
    raw.sendall(P.encode_ctl({"v": P.VERSION, "op": "hello", "job": None}))
    raw.recv(1 << 16)
    raw.sendall(P.encode_ctl({"segments": list(range(1, 300))}))
    reply = P.decode_ctl(raw.recv(1 << 16)[P.CTL_HEADER.size:])
    assert reply["ok"] is False and "ask in batches" in reply["error"][1]
    raw.close()
    with daemon.connect() as c:
        c.put("x", torch.ones(4))
        with pytest.raises(tierd.TierdError, match="did not hand over"):
            c.control.map(list(range(1000, 1300)))   # two batches, none of them ours
        assert torch.equal(c.get("x"), torch.ones(4))
    still_serving(daemon)


@pytest.mark.parametrize("msg", [{"claim": 1}, {"claim": "yes"},
                                 {"claim": True, "segments": [1]}])
def test_a_malformed_claim_is_refused_and_a_claim_of_nothing_hands_over_nothing(daemon, msg):
    """[Note: segments mapped ahead]: a claim is ``{"claim": true}`` alone;
    one from a job that told nothing ahead hands over no segment."""
    def session() -> socket.socket:
        raw = socket.socket(socket.AF_UNIX)
        raw.settimeout(10)
        raw.connect(str(daemon.socket) + ".ctl")
        raw.sendall(P.encode_ctl({"v": P.VERSION, "op": "hello", "job": None}))
        raw.recv(1 << 16)
        return raw

    raw = session()
    raw.sendall(P.encode_ctl(msg))
    reply = P.decode_ctl(raw.recv(1 << 16)[P.CTL_HEADER.size:])
    assert reply["ok"] is False and "{'claim': true}" in reply["error"][1]
    raw.close()
    raw = session()
    raw.sendall(P.encode_ctl({"claim": True}))
    data, fds, _flags, _addr = socket.recv_fds(raw, 1 << 16, 8)
    reply = P.decode_ctl(data[P.CTL_HEADER.size:])
    assert reply["ok"] is True and reply["segments"] == [] and reply["more"] == 0 and not fds
    raw.close()
    still_serving(daemon)


def test_sessions_over_the_per_uid_limit_are_refused_and_others_go_on(tmp_path):
    d = harness.start(tmp_path / "d", max_sessions_per_uid=3)
    try:
        held = [ControlChannel(d.socket, None) for _ in range(2)]   # + start()'s probe, gone
        c = d.connect()
        with pytest.raises(tierd.Busy, match="max_sessions_per_uid = 3"):
            ControlChannel(d.socket, None)
        held.pop().close()
        c.put("x", torch.ones(3))
        with d.connect() as again:       # a slot came free
            assert again.keys() == []
        assert torch.equal(c.get("x"), torch.ones(3))
        c.close()
        for h in held:
            h.close()
    finally:
        d.stop()


def _low_fd_limit(n: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return limit


def test_running_out_of_descriptors_refuses_new_clients_only(tmp_path):
    d = harness.start(tmp_path / "d", preexec_fn=_low_fd_limit(64))
    try:
        first = d.connect()
        first.put("kept", torch.arange(10))
        held, refusal = [], None
        for _ in range(64):
            try:
                held.append(ControlChannel(d.socket, None))
            except tierd.Busy as exc:
                refusal = str(exc)
                break
        assert refusal is not None and "out of file descriptors" in refusal, d.output()[-2000:]
        for h in held:
            h.close()
        assert torch.equal(first.get("kept"), torch.arange(10))
        first.close()
        still_serving(d)
    finally:
        d.stop()


def test_an_oversized_request_is_refused_before_sending_and_on_the_socket(daemon):
    with pytest.raises(tierd.ProtocolError, match="split it into smaller batches"):
        P.encode_request(1, P.Delete(tuple("k" * 1000 + str(i) for i in range(20_000))))
    ctl, sock = session_socket(daemon)
    sock.send(b"\x00" * (P.MAX_FRAME_BYTES + 1))   # ZeroMQ drops this peer's connection
    sock.close()
    ctl.close()
    still_serving(daemon)


# ---------------------------------------------------- names and identity
@pytest.mark.parametrize("job, why", [
    ("x" * 244, "not allowed"), ("a\x00b", "not allowed"), ("", "not allowed"),
    ("../etc", "not allowed"), ("pid-1", "reserved"), ("session-1", "reserved"),
])
def test_bad_job_names_are_refused_at_the_handshake(daemon, job, why):
    with pytest.raises(tierd.ProtocolError, match=why):
        daemon.connect(job=job)
    still_serving(daemon)


def test_a_default_job_cannot_be_joined_by_its_name(daemon):
    with daemon.connect() as mine:
        mine.put("secret", torch.ones(4))
        assert mine.job.startswith("session-")
        with pytest.raises(tierd.ProtocolError, match="reserved"):
            daemon.connect(job=mine.job)
        with daemon.connect() as other:      # same process, own session: own job
            assert other.job != mine.job and other.keys() == []


def test_a_lease_view_stays_valid_after_close(daemon):
    c = daemon.connect()
    c.put("w", torch.arange(1 << 16, dtype=torch.float32))
    (lease,) = c.lease(["w"])
    view = lease.tensor[100:200]
    c.close()
    assert torch.equal(view, torch.arange(100, 200, dtype=torch.float32))
    assert float(lease.tensor.sum()) == float(torch.arange(1 << 16, dtype=torch.float64).sum())


CLIENT = """
import sys, tierd, torch
c = tierd.connect(sys.argv[1])
if sys.argv[2] == "put":
    c.put("secret", torch.full((4,), 7.0))
print(c.job, sorted(c.keys()), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs util-linux unshare")
def test_clients_outside_the_daemons_pid_namespace_get_jobs_of_their_own(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here: {probe.stderr.decode().strip()}")
    d = harness.start(tmp_path / "d", wrapper=("unshare", "--pid", "--kill-child", "--"))
    procs = []
    try:
        for action in ("put", "look"):
            p = subprocess.Popen([sys.executable, "-c", CLIENT, str(d.socket), action],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=subprocess_env())
            procs.append(p)
            line = p.stdout.readline().strip().split(maxsplit=1)
            assert line, d.output()[-2000:]
            procs[-1].job, procs[-1].keys = line
        assert procs[0].job != procs[1].job
        assert procs[0].keys == "['secret']" and procs[1].keys == "[]"
        with d.connect() as c:
            jobs = c.stats()["jobs"]
        assert jobs[procs[0].job]["tensors"] == 1 and jobs[procs[1].job]["tensors"] == 0
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)
        d.stop()


def _drop_ptrace() -> None:
    """Root keeps CAP_SYS_PTRACE, which overrides dumpability: drop it (in both
    processes, so the attacker is an ordinary process of the daemon's uid)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(24, 19, 0, 0, 0) != 0:          # PR_CAPBSET_DROP, CAP_SYS_PTRACE
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


ATTACKER = """
import os, sys
fds = f"/proc/{sys.argv[1]}/fd"
try:
    names = os.listdir(fds)
except PermissionError:
    names = [str(n) for n in range(256)]
for n in names:
    try:
        with open(f"{fds}/{n}", "rb") as f:
            print("opened", n, os.readlink(f"{fds}/{n}"))
    except OSError:
        pass
"""


def test_another_process_of_the_uid_cannot_open_the_pool_through_proc(tmp_path):
    d = harness.start(tmp_path / "d", preexec_fn=_drop_ptrace)
    try:
        with d.connect() as c:
            c.put("secret", torch.full((1024,), 7.0))
            if os.geteuid() == 0:   # root (with CAP_SYS_PTRACE) sees what there is to steal
                pid = d.process.pid
                assert any("memfd:tierd" in os.readlink(f"/proc/{pid}/fd/{n}")
                           for n in os.listdir(f"/proc/{pid}/fd"))
            out = subprocess.run([sys.executable, "-c", ATTACKER, str(d.process.pid)],
                                 preexec_fn=_drop_ptrace, capture_output=True, text=True,
                                 timeout=60)
        assert out.returncode == 0, out.stderr
        assert "opened" not in out.stdout, out.stdout
    finally:
        d.stop()


# ----------------------------------------------------------- the disk
def _serve(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(tierd_command("serve", "--pool", "16MiB", "--nvme-size", "64MiB", *args),
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a small filesystem")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_failed_preallocation_removes_what_it_created(tmp_path, small_disk):
    out = _serve(tmp_path, "--nvme", str(small_disk / "nvme"), "--socket", str(tmp_path / "a.sock"))
    assert out.returncode != 0 and "cannot preallocate" in out.stderr, out.stderr
    assert not (small_disk / "nvme").exists()
    (small_disk / "mine").mkdir()                 # the operator's directory stays, empty
    out = _serve(tmp_path, "--nvme", str(small_disk / "mine"), "--socket", str(tmp_path / "b.sock"))
    assert out.returncode != 0 and "cannot preallocate" in out.stderr, out.stderr
    assert not (small_disk / "mine" / "tierd-nvme.dat").exists()
    assert os.statvfs(small_disk).f_bfree == os.statvfs(small_disk).f_blocks


def test_a_damaged_manifest_quarantines_its_job_and_the_others_start(tmp_path):
    d = harness.start(tmp_path)
    for job in ("good", "bad"):
        with d.connect(job=job) as c:
            c.put("w", torch.full((256,), 3.0))
            c.commit("one")
    d.stop()
    store = ManifestStore(d.nvme)
    path = store.path("bad")
    body = msgpack.packb({"format": 1, "job": "bad", "history": 5})   # checksum fine, shape not
    damaged = msgpack.packb({"crc": zlib.crc32(body), "body": body})
    path.write_bytes(damaged)
    d = harness.start(tmp_path)
    try:
        with d.connect(job="good") as c:
            assert torch.equal(c.get("w"), torch.full((256,), 3.0))
        with d.connect(job="bad") as c:
            assert c.keys() == [] and c.commits() == []
            (q,) = c.stats()["quarantined"]
        assert "owner_uid" in q["reason"] or "tag" in q["reason"], q
        assert Path(q["file"]).read_bytes() == damaged      # kept aside as it was
        assert "quarantined commit manifest" in d.output()
        status = subprocess.run(tierd_command("status", "--json", "--socket", str(d.socket)),
                                env=subprocess_env(), capture_output=True, text=True, timeout=60)
        assert json.loads(status.stdout)["quarantined"][0]["file"] == q["file"]
    finally:
        d.stop()


# ----------------------------------------------------- the socket path
def test_the_socket_path_replaces_only_a_stale_socket(tmp_path):
    nvme = str(tmp_path / "n")
    regular = tmp_path / "file.sock"
    regular.write_text("keep me")
    out = _serve(tmp_path, "--nvme", nvme, "--socket", str(regular))
    assert out.returncode != 0 and "is not a socket" in out.stderr
    assert regular.read_text() == "keep me"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(shared / "t.sock.ctl"))          # bound, never listened: nobody answers
    stale.close()
    d = start_serve(shared / "t.sock", nvme)
    try:
        assert (shared.stat().st_mode & 0o777) == 0o755     # not ours: mode kept
        with tierd.connect(shared / "t.sock") as c:
            c.put("x", torch.ones(2))
    finally:
        d.terminate()
        assert d.wait(30) == 0
    created = tmp_path / "new" / "dir"
    d = start_serve(created / "t.sock", nvme)
    try:
        assert (created.stat().st_mode & 0o777) == 0o700    # made by the daemon: 0700
    finally:
        d.terminate()
        d.wait(30)
    if os.geteuid() == 0:
        os.chown(shared, 65534, 65534)
        out = _serve(tmp_path, "--nvme", nvme, "--socket", str(shared / "u.sock"))
        assert out.returncode != 0 and "belongs to uid 65534" in out.stderr


def start_serve(sock: Path, nvme: str) -> subprocess.Popen:
    proc = subprocess.Popen(tierd_command("serve", "--pool", "16MiB", "--nvme-size", "64MiB",
                                          "--nvme", nvme, "--socket", str(sock)),
                            env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            tierd.connect(sock).close()
            return proc
        except tierd.DaemonUnavailable:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read())
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("daemon did not start")
