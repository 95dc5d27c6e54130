"""Damaged NVMe bytes are an IntegrityError naming the key, never wrong data;
the daemon stays up and the undamaged tensors stay readable."""

from __future__ import annotations

import os

import pytest
import torch

import tierd
from tierd.backends.manifest import ManifestStore
from tierd.backends.nvme import DATA_FILE
from tierd.backends.recordio import RecordMeta
from tests.faults import harness

JOB = "precious"


@pytest.fixture
def committed(tmp_path):
    """A daemon whose job committed two tensors, both evicted to NVMe."""
    d = harness.start(tmp_path)
    c = d.connect(job=JOB)
    c.put_many({"victim": torch.arange(300_000, dtype=torch.float32),
                "bystander": torch.full((1000,), 7, dtype=torch.int64)})
    c.commit("base")
    c.evict(["victim", "bystander"])
    yield d, c
    c.close()
    d.stop()


def record_of(d: harness.Daemon, key: str) -> tuple[int, int]:
    """(offset of the record, offset of its data) in the data file."""
    (t,) = [t for t in ManifestStore(d.nvme).find(JOB).tensors if t.key == key]
    meta = RecordMeta(key, JOB, t.dtype, t.shape, t.nbytes, t.version)
    return t.offset, t.offset + meta.header_len()


def damage(d: harness.Daemon, offset: int, data: bytes) -> None:
    fd = os.open(d.nvme / DATA_FILE, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def flip_bit(d: harness.Daemon, offset: int) -> None:
    fd = os.open(d.nvme / DATA_FILE, os.O_RDONLY)
    byte = os.pread(fd, 1, offset)
    os.close(fd)
    damage(d, offset, bytes([byte[0] ^ 0x10]))


def still_serving(d: harness.Daemon, c: tierd.Client) -> None:
    assert d.alive()
    assert torch.equal(c.get("bystander"), torch.full((1000,), 7, dtype=torch.int64))
    c.put("fresh", torch.ones(4))
    assert torch.equal(c.get("fresh"), torch.ones(4))


def test_a_flipped_bit_in_the_data_is_an_integrity_error(committed):
    d, c = committed
    _, data = record_of(d, "victim")
    flip_bit(d, data + 123_457)
    with pytest.raises(tierd.IntegrityError, match="'victim'.*checksum mismatch"):
        c.get("victim")
    still_serving(d, c)


def test_a_flipped_bit_in_the_header_is_an_integrity_error(committed):
    d, c = committed
    record, _ = record_of(d, "victim")
    flip_bit(d, record + 40)
    with pytest.raises(tierd.IntegrityError, match="'victim'"):
        c.get("victim")
    still_serving(d, c)


def test_a_zeroed_record_is_an_integrity_error(committed):
    d, c = committed
    record, _ = record_of(d, "victim")
    damage(d, record, bytes(8192))
    with pytest.raises(tierd.IntegrityError, match="'victim'.*bad magic"):
        c.get("victim")
    still_serving(d, c)


def test_a_truncated_file_is_an_integrity_error(committed):
    d, c = committed
    _, data = record_of(d, "victim")
    os.truncate(d.nvme / DATA_FILE, data + 4096)
    with pytest.raises(tierd.IntegrityError, match="truncated"):
        c.get("victim")
    assert d.alive()


def test_damage_found_after_a_restart_is_an_integrity_error(committed, tmp_path):
    d, c = committed
    _, data = record_of(d, "victim")
    c.close()
    d.kill()
    flip_bit(d, data)
    d = harness.start(tmp_path)
    with d.connect(job=JOB) as c2:
        with pytest.raises(tierd.IntegrityError, match="'victim'"):
            c2.get("victim")
        still_serving(d, c2)
    d.stop()


def test_a_damaged_manifest_is_quarantined_and_the_daemon_starts(committed, tmp_path):
    d, c = committed
    c.close()
    d.kill()
    path = ManifestStore(d.nvme).path(JOB)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    d = harness.start(tmp_path)
    try:
        with d.connect(job=JOB) as c2:
            assert c2.keys() == []           # never a wrong byte: the job is not restored
            (q,) = c2.stats()["quarantined"]
        assert "is damaged" in q["reason"] and not path.exists()
        assert os.path.exists(q["file"])     # the file is kept aside to inspect
    finally:
        d.stop()
