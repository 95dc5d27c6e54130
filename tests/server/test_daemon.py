"""The daemon end to end: a real `tierd serve` process, real sockets and files."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

import tierd
from tierd import protocol as P
from tests.conftest import start_daemon, subprocess_env, tierd_command

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.float8_e4m3fn, torch.float8_e5m2]


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,),
                        dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_through_nvme_is_bit_exact(client, dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": random_tensor(dtype, shape, gen)
               for i, shape in enumerate([(3, 5), (1000,), (), (0, 4), (7, 1, 3)])}
    client.put_many(tensors)
    client.evict(list(tensors))
    assert client.stats()["pool_used_bytes"] == 0
    for key, t in tensors.items():
        assert same_bits(client.get(key), t)


def test_storing_three_times_the_pool_spills_and_all_comes_back(client):
    gen = torch.Generator().manual_seed(1)
    pool = client.stats()["pool_bytes"]
    tensors = {f"w{i}": random_tensor(torch.float32, (1 << 20,), gen)
               for i in range(3 * pool // (4 << 20))}
    for key, t in tensors.items():
        client.put(key, t)
    stats = client.stats()
    assert stats["nvme_used_bytes"] >= 2 * pool - (8 << 20)
    assert stats["pool_used_bytes"] <= pool
    for key, t in reversed(tensors.items()):
        assert same_bits(client.get(key), t)


def test_a_client_unmaps_segments_the_daemon_dropped(daemon_factory):
    """Segments the daemon drops (here: emptied for a tensor larger than a
    segment) leave the client's mappings too, so their memory is given back."""
    d = daemon_factory(pool="16MiB", nvme_size="64MiB", extra=("--segment-size", "4MiB"))
    client = tierd.connect(d)
    client.put("a", torch.ones(2 << 20, dtype=torch.float32))   # 8 MiB: a segment of its own
    first = set(client.control.views)
    client.delete("a")
    big = torch.ones(3 << 20, dtype=torch.float32)              # 12 MiB: the empty one goes
    client.put("b", big)
    assert first and not first & (set(client.control.views) | set(client.control.mmaps))
    assert same_bits(client.get("b"), big)
    client.close()


def test_prefetch_brings_keys_back_into_the_pool(client):
    t = torch.arange(4096, dtype=torch.int32)
    client.put_many({"a": t, "b": t + 1})
    client.evict(["a", "b"])
    client.prefetch(["a", "b"])
    deadline = time.monotonic() + 5
    while client.stats()["pool_used_bytes"] < 2 * t.nbytes:
        assert time.monotonic() < deadline, "prefetch never landed"
        time.sleep(0.01)
    assert torch.equal(client.get("b"), t + 1)


def test_overwrite_delete_and_keys(client):
    client.put("opt/0.m", torch.zeros(4))
    client.put("opt/0.m", torch.ones(4))
    client.put("opt/1.m", torch.ones(2))
    client.put("param/x", torch.ones(1))
    assert client.keys("opt/") == ["opt/0.m", "opt/1.m"]
    assert torch.equal(client.get("opt/0.m"), torch.ones(4))
    client.delete("opt/0.m")
    with pytest.raises(KeyError):
        client.get("opt/0.m")
    assert client.stats()["tensors"] == 2


def test_leases_pin_bytes_and_write_leases_make_new_versions(client):
    client.put("w", torch.zeros(1024))
    (lease,) = client.lease(["w"])
    assert torch.equal(lease.tensor, torch.zeros(1024))
    with pytest.raises(tierd.StateError, match="leased"):
        client.evict(["w"])
    client.release(["w"])
    (w,) = client.lease(["w"], write=True)
    w.tensor.fill_(3)
    client.release(["w"], written=True)
    client.evict(["w"])           # the written bytes are what reaches NVMe
    (again,) = client.lease(["w"])
    assert again.version == w.version + 1
    assert torch.equal(again.tensor, torch.full((1024,), 3.0))
    client.release(["w"])


def test_a_replaced_key_keeps_old_bytes_for_its_lease_holder(client):
    client.put("k", torch.zeros(256))
    (old,) = client.lease(["k"])
    client.put("k", torch.ones(256))
    assert torch.equal(old.tensor, torch.zeros(256))
    assert torch.equal(client.get("k"), torch.ones(256))
    client.release(["k"])


def test_bad_requests_get_clear_errors_and_lose_nothing(daemon, client):
    client.put("keep", torch.ones(8))
    with pytest.raises(KeyError, match="nope"):
        client.get("nope")
    with pytest.raises(tierd.CapacityError, match="--pool"):
        client.put("huge", torch.zeros(32 << 20))          # 128 MiB > 64 MiB pool
    with pytest.raises(tierd.StateError):
        client.release(["keep"])                            # not leased
    with pytest.raises(tierd.TierdError, match="cannot be stored"):
        client.put("obj", torch.zeros(2, dtype=torch.uint16)) if hasattr(torch, "uint16") \
            else client.put("obj", torch.zeros(2, dtype=torch.complex32))
    assert torch.equal(client.get("keep"), torch.ones(8))
    assert client.keys() == ["keep"]


def test_pool_and_nvme_full_is_a_capacity_error(daemon_factory):
    d = daemon_factory(pool="16MiB", nvme_size="16MiB")
    with d.connect() as c:
        with pytest.raises(tierd.CapacityError, match=r"pool \+ NVMe full"):
            for i in range(12):
                c.put(f"k{i}", torch.zeros(1 << 20))        # 4 MiB each, 48 MiB in all
        kept = c.keys()
        assert kept and all(torch.equal(c.get(k), torch.zeros(1 << 20)) for k in kept)


def test_concurrent_clients_in_threads_and_processes(daemon):
    errors = []

    def worker(n: int) -> None:
        try:
            with daemon.connect(job="shared") as c:
                for i in range(20):
                    t = torch.full((50_000,), float(n * 100 + i))
                    c.put(f"{n}/{i}", t)
                    assert torch.equal(c.get(f"{n}/{i}"), t)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    script = ("import tierd, torch, sys\n"
              "c = tierd.connect(sys.argv[1], job='shared')\n"
              "for i in range(20):\n"
              "    t = torch.full((50_000,), float(i))\n"
              "    c.put(f'p/{i}', t); assert torch.equal(c.get(f'p/{i}'), t)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(daemon.socket)], env=subprocess_env())
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert proc.wait(60) == 0
    assert not errors, errors
    with daemon.connect(job="shared") as c:
        assert len(c.keys()) == 100


def test_jobs_do_not_see_each_other(daemon):
    with daemon.connect(job="a") as a, daemon.connect(job="b") as b, daemon.connect() as mine:
        a.put("secret", torch.ones(4))
        with pytest.raises(KeyError):
            b.get("secret")
        with pytest.raises(KeyError):
            mine.get("secret")
        assert b.keys() == [] and a.keys() == ["secret"]


def test_a_dead_client_gives_back_its_leases(daemon, client):
    client.put("w", torch.ones(1 << 16))
    script = ("import tierd, sys, os\n"
              "c = tierd.connect(sys.argv[1], job=sys.argv[2])\n"
              "c.put('mine', __import__('torch').ones(1 << 16))\n"
              "c.lease(['mine'])\n"
              "print('leased', flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", script, str(daemon.socket), "victim"],
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert "leased" in out.stdout
    with daemon.connect(job="victim") as c:
        deadline = time.monotonic() + 1.0
        while True:
            try:
                c.evict(["mine"])     # refused while the dead client's lease is held
                break
            except tierd.StateError:
                assert time.monotonic() < deadline, "lease of a dead client not reclaimed in 1 s"
                time.sleep(0.02)


def test_no_daemon_is_reported_fast_with_the_path(tmp_path):
    start = time.monotonic()
    with pytest.raises(tierd.DaemonUnavailable, match=str(tmp_path / "none.sock")):
        tierd.connect(tmp_path / "none.sock")
    assert time.monotonic() - start < 2


def test_daemon_death_is_seen_by_a_connected_client(daemon):
    c = daemon.connect()
    c.put("x", torch.ones(3))
    daemon.stop(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(tierd.DaemonUnavailable):
        c.get("x")
    assert time.monotonic() - start < 2
    c.close()


def test_nvme_read_error_fails_that_request_and_daemon_keeps_serving(daemon, client):
    client.put_many({"lost": torch.ones(1 << 16), "safe": torch.zeros(1 << 16)})
    client.evict(["lost"])
    os.truncate(daemon.nvme / "tierd-nvme.dat", 0)   # the device "loses" its blocks
    with pytest.raises(tierd.IntegrityError, match="truncated"):
        client.get("lost")
    assert torch.equal(client.get("safe"), torch.zeros(1 << 16))
    assert client.stats()["io_errors"] >= 1


def test_sigterm_leaves_no_socket_file_or_shared_memory(daemon, client):
    client.put("x", torch.ones(1 << 20))
    shm_before = set(os.listdir("/dev/shm"))
    pid = daemon.process.pid
    if os.geteuid() == 0:   # the daemon is not dumpable: only root may look at its fds
        memfds = [p for p in os.listdir(f"/proc/{pid}/fd")
                  if "memfd:tierd" in os.readlink(f"/proc/{pid}/fd/{p}")]
        assert memfds, "the pool should be memfd segments"
    client.close()
    start = time.monotonic()
    assert daemon.stop(signal.SIGTERM, timeout=5) == 0
    assert time.monotonic() - start < 5
    assert not daemon.socket.exists()
    assert not daemon.socket.with_name("tierd.sock.ctl").exists()
    assert not (daemon.nvme / "tierd-nvme.dat").exists()
    assert set(os.listdir("/dev/shm")) <= shm_before


def _serve_fails(tmp_path, *args) -> str:
    out = subprocess.run(tierd_command("serve", *args), env=subprocess_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_serve_refuses_bad_arguments_with_one_line(tmp_path, daemon):
    sock = str(tmp_path / "x.sock")
    assert "available memory" in _serve_fails(tmp_path, "--nvme", str(tmp_path / "n"),
                                              "--pool", "100TiB", "--socket", sock)
    (tmp_path / "file").write_text("")
    assert "--nvme" in _serve_fails(tmp_path, "--nvme", str(tmp_path / "file" / "sub"),
                                    "--socket", sock)
    assert "live daemon" in _serve_fails(tmp_path, "--nvme", str(tmp_path / "n2"),
                                         "--socket", str(daemon.socket))
    assert "cannot read size" in _serve_fails(tmp_path, "--nvme", str(tmp_path / "n3"),
                                              "--pool", "lots", "--socket", sock)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.one_of(
    st.binary(max_size=64),
    st.builds(lambda op, body: msgpack.packb({"v": P.VERSION, "id": 1, "op": op, "body": body}),
              st.sampled_from(list(P.REQUESTS) + ["nope"]),
              st.dictionaries(st.sampled_from(["keys", "specs", "write", "prefix"]),
                              st.one_of(st.integers(-5, 5), st.text(max_size=4),
                                        st.lists(st.one_of(st.text(max_size=4), st.integers(-1, 3),
                                                           st.lists(st.integers(-1, 3), max_size=4)),
                                                 max_size=4)), max_size=3))),
    min_size=1, max_size=8))
def test_random_frames_never_take_the_daemon_down(client, frames):
    ctx = zmq.Context.instance()
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(f"ipc://{client.path}")
    for frame in frames:
        stranger.send(frame)                     # no session: must be refused
        client._sock.send(frame)                 # a real session sending garbage
    stranger.close()
    assert client.stats()["sessions"] >= 1       # still answering, still correct
    client.put("alive", torch.ones(2))
    assert torch.equal(client.get("alive"), torch.ones(2))


def test_garbage_on_the_control_socket_is_refused(daemon, client):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(daemon.socket.with_name("tierd.sock.ctl")))
    s.sendall(b"\x00\x00\x00\x05hello")
    s.settimeout(5)
    assert s.recv(1 << 16) is not None
    s.close()
    assert client.stats()["tensors"] == 0


def test_status_command_prints_the_stats(daemon, client):
    client.put("x", torch.ones(4))
    out = subprocess.run(tierd_command("status", "--json", "--socket", str(daemon.socket)),
                         env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"tensors": 1' in out.stdout
    table = subprocess.run(tierd_command("status", "--socket", str(daemon.socket)),
                           env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "pool" in table.stdout


async def test_async_client(daemon):
    c = await tierd.aconnect(daemon.socket)
    await c.put("a", torch.arange(10))
    assert torch.equal(await c.get("a"), torch.arange(10))
    await c.evict("a")
    assert (await c.stats())["pool_used_bytes"] == 0
    leases = await c.lease(["a"])
    assert torch.equal(leases[0].tensor, torch.arange(10))
    await c.release(["a"])
    with pytest.raises(KeyError):
        await c.get("b")
    await c.close()


@pytest.mark.parametrize("threads, spares", [("0", 0), ("2", 2)])
def test_pool_threads_make_segments_ahead_as_configured(daemon_factory, threads, spares):
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", threads))
    with d.connect() as c:
        c.put("w", torch.ones(1024))   # the job's first 16 MiB segment, then the spares
        assert c.stats()["pool_mapped_bytes"] == (1 + spares) * (16 << 20)
        assert torch.equal(c.get("w"), torch.ones(1024))


def test_a_reserve_that_needs_new_segments_waits_for_them_off_the_loop(daemon_factory):
    """[Note: a reserve waits for its segment off the loop]: a reserve of more
    segments than are made ahead (and of a tensor larger than a segment)
    has them begun on the pool's threads and runs once they are made: the
    daemon's loop makes or waits for none, and everything reads back."""
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", "2"))
    with d.connect() as c:
        values = {f"t{i}": torch.full((4 << 20,), float(i)) for i in range(6)}   # 16 MiB each
        values["big"] = torch.full((10 << 20,), 7.0)                              # 40 MiB
        c.put_many(values)
        c.put("small", torch.ones(16))
        assert c.stats()["pool_segment_waits"] == 0
        for key, value in values.items():
            assert torch.equal(c.get(key), value), key


def test_a_session_s_requests_wait_behind_its_reserve_that_waits_for_segments(
        daemon_factory):
    """[Note: a session's requests keep their order]: while a reserve waits
    off the loop for the segment of a tensor larger than a segment, the same
    client's next request, which needs none, waits behind it: a second
    reserve of the same key is refused, not the first, and nothing is lost."""
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", "2"))
    with d.connect() as c:
        first = c.reserve_async({"k": torch.empty(10 << 20)})   # 40 MiB
        second = c.reserve_async({"k": torch.empty(16)})
        (slot,) = first.result(timeout=30)
        with pytest.raises(tierd.StateError, match="k: "):
            second.result(timeout=30)
        slot.tensor.fill_(5.0)
        c.publish_async(["k"]).result(timeout=30)
        assert torch.equal(c.get("k"), torch.full((10 << 20,), 5.0))
        assert c.stats()["pool_segment_waits"] == 0


def test_growth_told_ahead_is_made_before_the_reserves_that_take_it(daemon_factory):
    """[Note: growth told ahead]: the segments of a job's expected tensors
    are made as spares at once; the puts then take them, mapping nothing new."""
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", "2"))
    with d.connect() as c:
        c.expect([40 << 20] + [1 << 20] * 100)   # a 40 MiB tensor, 100 MiB of small ones
        made = (40 << 20) + 7 * (16 << 20)
        stats = c.stats()   # spares, or already claimed ([Note: segments mapped ahead])
        assert made <= stats["pool_mapped_bytes"] <= made + 2 * (16 << 20)
        c.put("big", torch.zeros(10 << 20))      # 40 MiB: the segment made for it
        for i in range(100):
            c.put(f"s{i}", torch.zeros(1 << 18))
        stats = c.stats()
        assert stats["pool_mapped_bytes"] <= made + 2 * (16 << 20), stats   # + ahead's two
        assert torch.equal(c.get("s99"), torch.zeros(1 << 18))
        c.expect([])   # nothing: a no-op
        with pytest.raises(ValueError, match="sizes are >= 0"):
            c.expect([1 << 20, -1])
        assert c.stats()["pool_spare_bytes"] <= 2 * (16 << 20)   # the connection goes on


def test_growth_told_ahead_is_mapped_ahead_and_the_puts_map_nothing(daemon_factory):
    """[Note: segments mapped ahead]: ``expect`` returns once the client has
    claimed and mapped the segments made for it; the puts that then fill
    them map nothing where they wait, and read back what they wrote."""
    d = daemon_factory(pool="256MiB", extra=("--pool-threads", "2"))
    with d.connect() as c:
        c.expect([40 << 20] + [1 << 20] * 100)   # a 40 MiB tensor, 100 MiB of small ones
        expected = (40 << 20) + 7 * (16 << 20)
        assert c.control.ahead_bytes == expected and c.control.mapped_bytes == 0
        c.put("big", torch.full((10 << 20,), 2.0))
        for i in range(100):
            c.put(f"s{i}", torch.full((1 << 18,), float(i)))
        assert c.control.mapped_bytes == 0   # every put found its segment mapped
        assert torch.equal(c.get("big"), torch.full((10 << 20,), 2.0))
        assert torch.equal(c.get("s99"), torch.full((1 << 18,), 99.0))
        assert c.stats()["pool_mapped_bytes"] <= expected + 2 * (16 << 20)   # + ahead's two
