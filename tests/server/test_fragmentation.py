"""A fragmented NVMe file still takes every record its free bytes can hold
(see the Note on records in several extents in tierd.backends.recordio):
through a real daemon and its data file, a tensor larger than any free extent
spills, reads back exact, is committed, survives a kill -9 and is read back
after the restart; damage in any of its extents is still an IntegrityError;
concurrent spills and fetches through the holes keep every value; and a job
committed in the one-extent manifest format of earlier daemons is still
recovered."""

from __future__ import annotations

import os
import random
import threading
import zlib
from pathlib import Path

import msgpack
import pytest
import torch

from safetensors import safe_open

import tierd
from tierd.archive import export_job
from tierd.backends.manifest import ManifestStore
from tierd.backends.nvme import DATA_FILE
from tests.faults import harness

MIB = 1 << 20
JOB = "fragmented"
SMALL = 60          # 1 MiB tensors: 60 records fill most of the 64 MiB file
BIG = 12 * MIB      # larger than any hole they leave


def small(i: int) -> torch.Tensor:
    return torch.full((MIB // 4,), i, dtype=torch.int32)


def big() -> torch.Tensor:
    return torch.randint(0, 255, (BIG,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(17))


def fragment(c: tierd.Client) -> list[str]:
    """Spill 60 records of 1 MiB + a page, then delete every other one: 30 MiB
    free in holes of 1 MiB + 4 KiB and a short tail. The kept keys."""
    keys = [f"s{i:02d}" for i in range(SMALL)]
    for k, i in zip(keys, range(SMALL)):
        c.put(k, small(i))
    c.evict(keys)
    c.delete(keys[1::2])
    return keys[::2]


@pytest.fixture
def fragmented(tmp_path):
    d = harness.start(tmp_path / "d", pool="16MiB", nvme_size="64MiB")
    c = d.connect(job=JOB)
    yield d, c, fragment(c)
    c.close()
    d.stop()


def test_a_tensor_larger_than_any_free_extent_spills_and_survives_a_restart(fragmented,
                                                                             tmp_path):
    d, c, kept = fragmented
    stats = c.stats()
    free = stats["nvme_bytes"] - stats["nvme_used_bytes"]
    assert stats["nvme_largest_free_bytes"] < BIG < free   # bytes suffice, no extent does
    c.put("big", big())
    c.evict(["big"])                     # refused before: "NVMe tier full"
    assert c.stats()["jobs"][JOB]["pool_used_bytes"] == 0
    assert torch.equal(c.get("big"), big())
    c.commit("scattered")
    c.evict(["big"])
    d.kill()
    d = harness.start(tmp_path / "d", pool="16MiB", nvme_size="64MiB")
    try:
        with d.connect(job=JOB) as again:
            assert torch.equal(again.get("big"), big())
            for k in kept:
                assert torch.equal(again.get(k), small(int(k[1:])))
        # export reads the spans too ("big" alone: the prefix "b", stripped)
        n, _ = export_job(d.nvme, JOB, tmp_path / "out.safetensors", prefix="b")
        with safe_open(tmp_path / "out.safetensors", "pt") as f:
            assert n == 1 and torch.equal(f.get_tensor("ig"), big())
    finally:
        d.stop()


def record_spans(d: harness.Daemon, key: str) -> tuple[tuple[int, int], ...]:
    (t,) = [t for t in ManifestStore(d.nvme).find(JOB).tensors if t.key == key]
    return t.spans


def flip_byte(d: harness.Daemon, offset: int) -> None:
    fd = os.open(d.nvme / DATA_FILE, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x20]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("extent", ["first", "last"])
def test_damage_in_any_extent_of_a_scattered_record_is_an_integrity_error(fragmented,
                                                                          extent):
    d, c, kept = fragmented
    c.put("big", big())
    c.commit("scattered")
    c.evict(["big"])
    spans = record_spans(d, "big")
    assert len(spans) > 1
    start, length = spans[0] if extent == "first" else spans[-1]
    flip_byte(d, start + length - 5)     # data bytes in either (the header is a page)
    with pytest.raises(tierd.IntegrityError, match="'big'.*checksum mismatch"):
        c.get("big")
    assert torch.equal(c.get(kept[-1]), small(SMALL - 2))   # the daemon serves on
    c.delete(["big"])
    c.put("fresh", torch.ones(8))
    assert torch.equal(c.get("fresh"), torch.ones(8))


def as_format_1(path: Path) -> None:
    """Rewrite a manifest as a daemon before multi-extent records wrote it:
    format 1, each tensor [key, dtype, shape, nbytes, version, offset, extent_len]."""
    outer = msgpack.unpackb(path.read_bytes())
    body = msgpack.unpackb(outer["body"])
    tensors = []
    for key, dtype, shape, nbytes, version, spans in body["tensors"]:
        assert len(spans) == 1, "format 1 holds one extent per record"
        tensors.append([key, dtype, shape, nbytes, version, spans[0][0], spans[0][1]])
    body.update(format=1, tensors=tensors)
    raw = msgpack.packb(body)
    path.write_bytes(msgpack.packb({"crc": zlib.crc32(raw), "body": raw}))


def test_a_commit_in_the_one_extent_format_of_earlier_daemons_is_recovered(tmp_path):
    d = harness.start(tmp_path / "d", pool="16MiB", nvme_size="64MiB")
    values = {"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(3, 5)}
    with d.connect(job=JOB) as c:
        c.put_many(values)
        c.commit("old")
    d.stop()
    as_format_1(ManifestStore(d.nvme).path(JOB))
    d = harness.start(tmp_path / "d", pool="16MiB", nvme_size="64MiB")
    try:
        with d.connect(job=JOB) as c:
            for k, v in values.items():
                assert torch.equal(c.get(k), v)
            assert c.commits()[-1] == "old"
            c.put("a", torch.zeros(7))
            c.commit("new")       # written in today's format, over the old one's records
        assert "quarantined" not in d.output()
    finally:
        d.stop()
    assert ManifestStore(d.nvme).find(JOB).tag == "new"


def test_concurrent_spills_and_fetches_through_the_holes_keep_every_value(fragmented):
    """Three clients rewrite, evict, prefetch and read their own keys at once:
    their 3 MiB records fit no hole, so every one of them is scattered, and
    swap-ins read them while others are written."""
    d, c, kept = fragmented
    errors: list[BaseException] = []

    def value(seed: int, i: int, step: int) -> torch.Tensor:
        n = 3 * MIB + 8192 if i < 2 else 64 * 1024
        return torch.randint(0, 255, (n,), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(seed * 1000 + i * 10 + step))

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        step = {i: 0 for i in range(6)}
        key = lambda i: f"{seed}/t{i}"   # noqa: E731
        try:
            with d.connect(job=JOB) as cc:
                for i in step:
                    cc.put(key(i), value(seed, i, 0))
                for _ in range(12):
                    subset = rng.sample(list(step), rng.randint(1, 3))
                    match rng.randrange(4):
                        case 0:
                            cc.evict([key(i) for i in subset])
                        case 1:
                            cc.prefetch([key(i) for i in subset])
                        case 2:
                            step[subset[0]] += 1
                            cc.put(key(subset[0]), value(seed, subset[0], step[subset[0]]))
                        case 3:
                            i = subset[0]
                            assert torch.equal(cc.get(key(i)), value(seed, i, step[i])), key(i)
                cc.evict([key(i) for i in step])
                for i, s in step.items():
                    assert torch.equal(cc.get(key(i)), value(seed, i, s)), key(i)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    for k in kept:
        assert torch.equal(c.get(k), small(int(k[1:])))
    assert c.stats()["io_errors"] == 0
