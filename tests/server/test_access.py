"""Who may use a daemon: its own user and root, the members of ``--group``,
and inside it only a named job's owner (or root, with allow_root_join) joins
the job ([Note: group access] in tierd.server.sockets).

The decision is plain code over a uid and its groups, tested directly. The
daemons are real processes on real sockets. To give a connection another
uid without root, some daemons run with a test-only wrapper around
``sockets.peer_of`` that reads the uid and groups to report from a file the
test writes before each connect (the kernel's answer is replaced, nothing
else); as root, one test creates OS users and connects as each of them.
"""

from __future__ import annotations

import contextlib
import grp
import io
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import tierd
from tests.conftest import DaemonProcess, subprocess_env
from tierd import protocol as P
from tierd.backends.nvme import DATA_FILE, LOCK_FILE
from tierd.cli import main
from tierd.config import ServeConfig, resolve
from tierd.errors import AccessDenied, DaemonUnavailable, StateError, TierdError
from tierd.server import sockets
from tierd.server.sockets import GroupAccess, Peer, ctl_path

FAKE_PEER = """
import dataclasses, os, sys
from pathlib import Path
from tierd.server import sockets
real_peer_of = sockets.peer_of
def peer_of(conn):   # the uid and groups the test wrote, else the kernel's
    peer = real_peer_of(conn)
    text = Path(os.environ["TIERD_TEST_PEER"]).read_text().split()
    if not text:
        return peer
    uid, gid, *groups = map(int, text)
    return dataclasses.replace(peer, uid=uid, gid=gid, groups=tuple(groups))
sockets.peer_of = peer_of
from tierd.cli import main
sys.exit(main(sys.argv[1:]))
"""
OTHER, STRANGER = 12345, 12346   # uids no test process runs as


# ------------------------------------------------------------- decision
def test_the_daemons_user_root_and_the_groups_members_are_admitted_no_one_else():
    access = GroupAccess("trainers", 2000, daemon_uid=999)
    assert access.admits(999, set())               # the daemon's own user
    assert access.admits(0, {0})                   # root
    assert access.admits(1001, {1001, 2000})       # a member (supplementary group)
    assert access.admits(1002, {2000})             # a member (primary group)
    assert not access.admits(1003, {1003, 2001})
    assert not access.admits(1004, set())


def test_a_refusal_names_the_uid_its_groups_the_group_and_the_fix():
    access = GroupAccess("trainers", 2000, daemon_uid=999)
    with pytest.raises(AccessDenied) as info:
        access.check(Peer(pid=7, uid=1003, gid=1003, pidfd=None, groups=(2001,)))
    text = str(info.value)
    for part in ("uid 1003", "1003, 2001", "uid 999", "group trainers (gid 2000)",
                 "usermod -aG trainers", "supplementalGroups"):
        assert part in text, text
    access.check(Peer(pid=7, uid=1001, gid=1001, pidfd=None, groups=(2000,)))   # no raise


def test_a_peers_groups_are_the_kernels_view_of_the_process():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer = sockets.peer_of(a)
        if peer.pidfd is not None:
            os.close(peer.pidfd)
    finally:
        a.close()
        b.close()
    assert (peer.uid, peer.gid) == (os.geteuid(), os.getegid())
    assert peer.groups is not None, "SO_PEERGROUPS is in every kernel since 4.13"
    assert set(peer.groups) == set(os.getgroups())
    assert sockets.peer_gids(peer) == {os.getegid(), *os.getgroups()}


def test_without_the_kernels_groups_the_group_database_answers():
    me = pwd.getpwuid(os.getuid())
    known = Peer(pid=1, uid=me.pw_uid, gid=me.pw_gid, pidfd=None, groups=None)
    assert sockets.peer_gids(known) == set(os.getgrouplist(me.pw_name, me.pw_gid))
    unknown = Peer(pid=1, uid=4_000_000_000, gid=4242, pidfd=None, groups=None)
    assert sockets.peer_gids(unknown) == {4242}     # a pod's uid: only its own gid


def test_a_group_is_named_or_numbered():
    me = grp.getgrgid(os.getegid())
    assert GroupAccess.resolve(me.gr_name).gid == me.gr_gid
    assert GroupAccess.resolve(str(me.gr_gid)).name == me.gr_name
    unnamed = next(g for g in range(3_000_000_000, 3_000_001_000) if not _group_exists(g))
    assert GroupAccess.resolve(str(unnamed)).gid == unnamed   # a pod's group: no entry
    with pytest.raises(TierdError, match="no such group on this host"):
        GroupAccess.resolve("tierd-no-such-group")


def _group_exists(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


def test_the_group_is_set_by_flag_variable_or_file_and_checked(tmp_path):
    toml = tmp_path / "tierd.toml"
    toml.write_text('[serve]\ngroup = "trainers"\n')
    assert resolve({}, {}, toml).group == "trainers"
    assert resolve({}, {"TIERD_GROUP": "2000"}, toml).group == "2000"
    assert resolve({"group": "ml"}, {"TIERD_GROUP": "2000"}, toml).group == "ml"
    assert resolve({}, {}, None).group is None          # default: uid-only
    assert resolve({"group": ""}, {}, toml).group is None   # an empty flag unsets the file's
    with pytest.raises(ValueError, match="group"):
        ServeConfig(group="a b")


# ------------------------------------------------------ socket directory
@pytest.fixture
def reachable(tmp_path):
    """A directory every user may search (pytest's own are 0700), removed after."""
    top = Path(tempfile.mkdtemp(prefix="tierd-access-"))
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def own_group() -> GroupAccess:
    return GroupAccess.resolve(str(os.getegid()))


def test_a_socket_directory_made_for_a_group_is_0750_and_the_groups(reachable):
    sock = reachable / "run" / "deep" / "t.sock"
    sockets.prepare_socket_dir(sock, own_group())
    for d in (reachable / "run", sock.parent):
        st = d.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, os.getegid()), d


def test_without_a_group_the_directory_is_0700_as_before(reachable):
    sock = reachable / "run" / "t.sock"
    sockets.prepare_socket_dir(sock)
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_a_directory_the_group_cannot_search_is_refused_by_name(reachable):
    blocked = reachable / "private"
    blocked.mkdir(mode=0o700)
    os.chmod(blocked, 0o700)
    with pytest.raises(TierdError, match=f"cannot reach .*{blocked} \\(mode 700"):
        sockets.prepare_socket_dir(blocked / "t.sock", own_group())
    with pytest.raises(TierdError, match=f"{blocked} \\(mode 700"):   # an ancestor too
        sockets.prepare_socket_dir(blocked / "run" / "t.sock", own_group())
    os.chmod(blocked, 0o710)                                       # group may search now
    sockets.prepare_socket_dir(blocked / "t.sock", own_group())


@pytest.mark.skipif(os.geteuid() == 0, reason="root may give files to any group")
def test_a_daemon_outside_the_group_refuses_to_start_before_making_anything(reachable):
    other = next(g for g in grp.getgrall()
                 if g.gr_gid not in (os.getegid(), *os.getgroups()))
    access = GroupAccess(other.gr_name, other.gr_gid, os.getuid())
    with pytest.raises(TierdError, match="is not in group"):
        sockets.prepare_socket_dir(reachable / "run" / "t.sock", access)
    assert not (reachable / "run").exists()


# ------------------------------------------------------------ daemons
def serve(tmp: Path, sock: Path, *extra: str, peer_file: Path | None = None) -> DaemonProcess:
    """A real ``tierd serve``; with ``peer_file``, under the FAKE_PEER wrapper."""
    tmp.mkdir(parents=True, exist_ok=True)
    nvme, log = tmp / "nvme", tmp / "daemon.log"
    env = subprocess_env()
    head = [sys.executable, "-m", "tierd"]
    if peer_file is not None:
        peer_file.write_text("")
        env["TIERD_TEST_PEER"] = str(peer_file)
        head = [sys.executable, "-c", FAKE_PEER]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*head, "serve", "--nvme", str(nvme), "--socket", str(sock), "--pool", "32MiB",
             "--nvme-size", "64MiB", "--segment-size", "4MiB", "--io-threads", "1", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    d = DaemonProcess(proc, sock, nvme, log)
    deadline = time.monotonic() + 60
    while not ctl_path(sock).exists() or not _answers(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            d.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon did not start:\n{d.output()}")
        time.sleep(0.05)
    return d


def _answers(sock: Path) -> bool:
    try:
        tierd.connect(sock).close()
        return True
    except DaemonUnavailable:
        return False


@pytest.fixture
def daemons():
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        if d.stop() not in (0, None):
            raise AssertionError(f"daemon exited {d.process.returncode}:\n{d.output()}")


def as_peer(peer_file: Path, uid: int, gid: int, *groups: int) -> None:
    """The next connection reads as ``uid`` in ``gid`` and ``groups``."""
    peer_file.write_text(" ".join(map(str, (uid, gid, *groups))))


def mode_gid(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def test_without_a_group_only_the_daemons_user_reaches_the_sockets(tmp_path, daemons):
    sock = tmp_path / "run" / "t.sock"
    daemons.append(serve(tmp_path / "d", sock))
    assert mode_gid(sock.parent)[0] == 0o700
    for path in (sock, ctl_path(sock)):
        assert mode_gid(path)[0] & 0o077 == 0, path


def test_a_group_daemons_sockets_are_the_groups_and_its_user_works(reachable, daemons):
    sock = reachable / "run" / "t.sock"
    d = serve(reachable / "d", sock, "--group", str(os.getegid()))
    daemons.append(d)
    assert mode_gid(sock.parent) == (0o750, os.getegid())
    for path in (sock, ctl_path(sock)):
        assert mode_gid(path) == (0o660, os.getegid()), path
    with d.connect(job="mine") as c:
        c.put("w", torch.arange(4.0))
        assert torch.equal(c.get("w"), torch.arange(4.0))
    assert "members of group" in d.output()


def test_a_peer_outside_the_group_is_refused_with_the_reason(reachable, daemons):
    sock, peer = reachable / "run" / "t.sock", reachable / "peer"
    gid = os.getegid()
    d = serve(reachable / "d", sock, "--group", str(gid), peer_file=peer)
    daemons.append(d)
    as_peer(peer, OTHER, OTHER, 7)
    with pytest.raises(AccessDenied) as info:
        tierd.connect(sock, job="shared")
    assert f"uid {OTHER} (groups 7, {OTHER})" in str(info.value)
    assert f"the members of group {grp.getgrgid(gid).gr_name} (gid {gid})" in str(info.value)
    as_peer(peer, OTHER, OTHER, gid)                 # the same uid once in the group
    with tierd.connect(sock, job="shared") as c:
        c.put("w", torch.ones(3))
    as_peer(peer, STRANGER, gid)                     # the group as its primary one
    tierd.connect(sock).close()
    as_peer(peer, 0, 0)                              # root
    tierd.connect(sock).close()
    assert "refused a control connection" in d.output()


def test_a_named_job_admits_only_its_owner_and_says_whose_it_is(reachable, daemons):
    sock, peer = reachable / "run" / "t.sock", reachable / "peer"
    gid = os.getegid()
    daemons.append(serve(reachable / "d", sock, "--group", str(gid), peer_file=peer))
    as_peer(peer, OTHER, OTHER, gid)
    owner = tierd.connect(sock, job="llama")
    try:
        owner.put("w", torch.full((4,), 2.0))
        as_peer(peer, STRANGER, STRANGER, gid)       # a member, not the owner
        with pytest.raises(StateError) as info:
            tierd.connect(sock, job="llama")
        assert f"job 'llama' belongs to uid {OTHER}; uid {STRANGER} may not join" \
            in str(info.value)
        with tierd.connect(sock) as own:             # its default job is its own
            own.put("w", torch.zeros(2))
            assert own.job != "llama"
        as_peer(peer, OTHER, OTHER, gid)             # the owner again, in a second session
        with tierd.connect(sock, job="llama") as again:
            assert torch.equal(again.get("w"), torch.full((4,), 2.0))
        as_peer(peer, 0, 0)                          # root: allow_root_join is on
        with tierd.connect(sock, job="llama") as root:
            assert torch.equal(root.get("w"), torch.full((4,), 2.0))
    finally:
        owner.close()


def test_root_joins_no_one_elses_job_without_allow_root_join(reachable, daemons):
    sock, peer = reachable / "run" / "t.sock", reachable / "peer"
    gid = os.getegid()
    daemons.append(serve(reachable / "d", sock, "--group", str(gid),
                         "--allow-root-join", "false", peer_file=peer))
    as_peer(peer, OTHER, OTHER, gid)
    with tierd.connect(sock, job="llama"):
        as_peer(peer, 0, 0)
        with pytest.raises(StateError, match=f"belongs to uid {OTHER}; uid 0 may not join"):
            tierd.connect(sock, job="llama")


def segment_fds(sock: Path, job: str, ids: list[int]) -> list[int]:
    """The pool segments' descriptors as the daemon hands them to a job's client."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(str(ctl_path(sock)))
    try:
        conn.sendall(P.encode_ctl({"v": P.VERSION, "op": "hello", "job": job}))
        conn.recv(1 << 16)
        conn.sendall(P.encode_ctl({"segments": ids}))
        _data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 64)
        return fds
    finally:
        conn.close()


def test_the_nvme_file_manifests_and_pool_are_the_daemons_users_only(tmp_path, daemons):
    sock = tmp_path / "run" / "t.sock"
    d = serve(tmp_path / "d", sock)
    daemons.append(d)
    with d.connect(job="kept") as c:
        for i in range(12):                                  # 48 MiB through a 32 MiB pool
            c.put(f"t{i}", torch.full((1 << 20,), float(i)))
        c.commit("one")
        ids = sorted(c.segment_views())
        fds = segment_fds(sock, "kept", ids)
        try:
            assert fds and all(stat.S_IMODE(os.fstat(fd).st_mode) == 0o600 for fd in fds)
        finally:
            for fd in fds:
                os.close(fd)
    assert mode_gid(d.nvme)[0] == 0o700                      # made by the daemon
    made = [p for p in d.nvme.rglob("*")]
    assert d.nvme / DATA_FILE in made and d.nvme / LOCK_FILE in made
    assert any(p.suffix == ".commit" for p in made), made      # the commit's manifest
    for path in made:
        assert mode_gid(path)[0] & 0o077 == 0, (path, oct(mode_gid(path)[0]))
    assert mode_gid(sock.with_name(sock.name + ".lock"))[0] & 0o077 == 0


def test_a_data_file_readable_by_others_is_made_private_at_start(tmp_path, daemons):
    nvme = tmp_path / "d" / "nvme"
    nvme.mkdir(parents=True)
    (nvme / DATA_FILE).write_bytes(b"")
    os.chmod(nvme / DATA_FILE, 0o644)
    d = serve(tmp_path / "d", tmp_path / "run" / "t.sock")
    daemons.append(d)
    assert mode_gid(nvme / DATA_FILE)[0] == 0o600
    assert "had mode 644, readable by other users; now 0600" in d.output()


# --------------------------------------------------------- real users
def run_as(user: pwd.struct_passwd, fn) -> str:
    """``fn()`` in a forked child running as ``user`` with that user's groups
    (as a login gives them); its result, or the error it raised, as text."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        try:
            os.initgroups(user.pw_name, user.pw_gid)
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


def health(sock: Path):
    """``tierd health`` on ``sock``: its exit status and what it wrote to stderr."""
    def run() -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["health", "--socket", str(sock), "--timeout", "5"])
        return f"{code} {err.getvalue()}"
    return run


@pytest.fixture
def users():
    """OS users: alice and carol in group tierd-acc, bob outside it."""
    group = "tierd-acc"
    subprocess.run(["groupadd", group], capture_output=True)
    made = {}
    for name, groups in (("alice", [group]), ("bob", []), ("carol", [group])):
        login = f"tierd-acc-{name}"
        subprocess.run(["useradd", "--no-create-home", *(["-G", ",".join(groups)] if groups
                                                          else []), login], capture_output=True)
        made[name] = pwd.getpwnam(login)
    yield grp.getgrnam(group), made
    for user in made.values():
        subprocess.run(["userdel", user.pw_name], capture_output=True)
    subprocess.run(["groupdel", group], capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                    reason="needs root and useradd to create OS users")
def test_os_users_in_the_group_work_others_are_refused(reachable, daemons, users):
    group, u = users
    sock = reachable / "run" / "t.sock"
    daemons.append(serve(reachable / "d", sock, "--group", group.gr_name))

    def alice() -> str:
        with tierd.connect(sock, job="alice-job") as c:
            c.put("w", torch.ones(4))
            return f"OK {c.get('w').sum().item():g}"

    def try_connect(job: str | None) -> str:
        def run() -> str:
            try:
                tierd.connect(sock, job=job).close()
                return "CONNECTED"
            except TierdError as exc:
                return f"{type(exc).__name__}: {exc}"
        return run

    assert run_as(u["alice"], alice) == "OK 4"
    # bob: the file modes keep him out, and the client says why
    out = run_as(u["bob"], try_connect(None))
    assert out.startswith("AccessDenied: permission denied at") and f"uid {u['bob'].pw_uid}" \
        in out, out
    assert run_as(u["bob"], health(sock)).startswith("1 tierd health: unhealthy: permission "
                                                     "denied on")
    # carol: in the group, so she connects, but alice's job is alice's
    assert run_as(u["carol"], try_connect(None)) == "CONNECTED"
    out = run_as(u["carol"], try_connect("alice-job"))
    assert out.startswith("StateError") and \
        f"belongs to uid {u['alice'].pw_uid}; uid {u['carol'].pw_uid}" in out, out
    # with the modes opened by hand, the daemon's own check still refuses bob
    os.chmod(sock.parent, 0o755)
    for path in (sock, ctl_path(sock)):
        os.chmod(path, 0o666)
    out = run_as(u["bob"], try_connect(None))
    assert out.startswith(f"AccessDenied: uid {u['bob'].pw_uid} (groups ") and \
        f"members of group {group.gr_name}" in out, out
