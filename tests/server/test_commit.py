"""Commits end to end: durable versions, restart, reconnect, export and import."""

from __future__ import annotations

import json
import struct
import subprocess

import pytest
import torch

import tierd
import tierd.archive
from tests.conftest import subprocess_env, tierd_command
from tests.faults import harness

MiB = 1 << 20


@pytest.fixture
def d(tmp_path):
    daemon = harness.start(tmp_path)
    yield daemon
    daemon.stop()


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"m/p/w": torch.randn(64, 32, generator=g), "m/p/b": torch.randn(32, generator=g),
            "m/p/h": torch.randn(8, generator=g).to(torch.bfloat16),
            "m/p/i": torch.arange(5, dtype=torch.int64), "m/p/empty": torch.empty(0, 3)}


def test_commit_survives_a_clean_restart_and_reconnecting_sees_it(d, tmp_path):
    with d.connect(job="run") as c:
        c.put_many(weights())
        info = c.commit("step-1")
        assert info["tag"] == "step-1" and info["tensors"] == 5
        assert info["written_bytes"] >= info["bytes"]
        c.put("m/p/w", torch.zeros(64, 32))           # not committed
        assert c.commit("step-2")["written_bytes"] == 64 * 32 * 4   # only the changed bytes
        c.put("m/p/w", torch.ones(64, 32))            # changed after the last commit
        c.put("m/p/extra", torch.ones(2))
    d.stop()                                           # SIGTERM keeps committed data
    d2 = harness.start(tmp_path)
    with d2.connect(job="run") as c:
        assert c.commits() == ["step-1", "step-2"]
        expect = weights() | {"m/p/w": torch.zeros(64, 32)}
        assert sorted(c.keys()) == sorted(expect)
        for k, t in expect.items():
            assert torch.equal(c.get(k), t)
    d2.stop()


def test_a_client_sees_the_daemon_die_and_reconnects_after_restart(d, tmp_path):
    c = d.connect(job="run")
    c.put("x", torch.ones(10))
    c.commit("one")
    d.kill()
    with pytest.raises(tierd.DaemonUnavailable):
        c.get("x")
    c.close()
    d2 = harness.start(tmp_path)
    with d2.connect(job="run") as c:
        assert torch.equal(c.get("x"), torch.ones(10))
    d2.stop()


def test_ephemeral_jobs_do_not_commit(d):
    with d.connect() as c:
        c.put("x", torch.ones(1))
        with pytest.raises(tierd.StateError, match="ephemeral.*job=NAME"):
            c.commit("nope")
        assert c.commits() == []


def test_a_write_leased_tensor_blocks_a_commit_with_the_fix(d):
    with d.connect(job="j") as c:
        c.put("x", torch.ones(4))
        c.lease(["x"], write=True)
        with pytest.raises(tierd.StateError, match="write-leased.*release"):
            c.commit("t")
        c.release(["x"], written=True)
        assert c.commit("t")["tensors"] == 1


def test_drop_job_forgets_its_commit(d, tmp_path):
    with d.connect(job="gone") as c:
        c.put("x", torch.ones(4))
        c.commit("t")
        c.drop_job()
    d.kill()
    d2 = harness.start(tmp_path)
    with d2.connect(job="gone") as c:
        assert c.keys() == [] and c.commits() == []
    d2.stop()


async def test_async_client_commits(d):
    async with await tierd.aconnect(d.socket, job="aj") as c:
        await c.put("x", torch.ones(3))
        assert (await c.commit("a"))["tensors"] == 1
        assert await c.commits() == ["a"]


def test_export_reads_back_with_safetensors_and_imports(d, tmp_path):
    with d.connect(job="run") as c:
        c.put_many(weights())
        c.commit("final")
        c.put("m/p/w", torch.zeros(64, 32))           # after the commit: not exported
    out = tmp_path / "model.safetensors"
    run = subprocess.run(tierd_command("export", "--nvme", str(d.nvme), "--job", "run",
                                       "--out", str(out), "--prefix", "m/p/"),
                         capture_output=True, text=True, env=subprocess_env())
    assert run.returncode == 0, run.stderr
    (n,) = struct.unpack("<Q", out.read_bytes()[:8])
    header = json.loads(out.read_bytes()[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"]["tierd_tag"] == "final"
    assert header["w"] == {"dtype": "F32", "shape": [64, 32], "data_offsets": [0, 8192]}
    expect = {k[len("m/p/"):]: t for k, t in weights().items()}
    safetensors = pytest.importorskip("safetensors.torch")
    loaded = safetensors.load_file(out)
    assert sorted(loaded) == sorted(expect)
    assert all(torch.equal(loaded[k], t) for k, t in expect.items())
    info = tierd.archive.import_file(d.socket, "copy", out, "imported", prefix="q/")
    assert info["tensors"] == 5
    with d.connect(job="copy") as c:
        assert all(torch.equal(c.get("q/" + k), t) for k, t in expect.items())


def test_export_names_the_fix_for_a_wrong_tag_or_no_commit(d, tmp_path):
    from tierd.archive import export_job
    with d.connect(job="run") as c:
        c.put("x", torch.ones(1))
        c.commit("last")
    with pytest.raises(tierd.TierdError, match="only its last commit 'last'"):
        export_job(d.nvme, "run", tmp_path / "x.safetensors", tag="older")
    with pytest.raises(tierd.TierdError, match="no commit"):
        export_job(d.nvme, "other", tmp_path / "x.safetensors")
    with pytest.raises(tierd.TierdError, match="no key of commit 'last' starts with 'm/p/'"):
        export_job(d.nvme, "run", tmp_path / "x.safetensors", prefix="m/p/")
    assert not (tmp_path / "x.safetensors").exists()
