"""Commit manifests name each record by its extents, in today's format (a
list of spans) and in format 1 (one offset and length) of earlier daemons;
a manifest whose extents cannot be its records is moved aside."""

from __future__ import annotations

import msgpack
import pytest

from tierd.backends.extents import PAGE, align_up
from tierd.backends.manifest import CommittedTensor, Manifest, ManifestStore, next_manifest
from tierd.backends.recordio import RecordMeta

JOB = "run1"


def tensor(key: str, nbytes: int, spans) -> CommittedTensor:
    return CommittedTensor(key, "uint8", (nbytes,), nbytes, 3, tuple(spans))


def record_len(key: str, nbytes: int) -> int:
    return align_up(RecordMeta(key, JOB, "uint8", (nbytes,), nbytes, 3).record_len())


def test_a_record_in_several_extents_round_trips_through_a_manifest(tmp_path):
    n = 10 * PAGE
    assert record_len("big", n) == 11 * PAGE
    t = tensor("big", n, [(40 * PAGE, 6 * PAGE), (PAGE, 5 * PAGE)])
    m = next_manifest(None, JOB, 1000, "s1", (t, tensor("one", 10, [(20 * PAGE, 2 * PAGE)])))
    store = ManifestStore(tmp_path)
    store.write(m)
    (loaded,) = store.load_all(64 * PAGE)
    assert loaded == m and loaded.tensors[0].offset == 40 * PAGE
    assert loaded.tensors[0].extent_len == 11 * PAGE


def test_a_format_1_body_reads_as_one_extent_per_record():
    body = msgpack.packb({"format": 1, "job": JOB, "owner_uid": 0, "seq": 4, "tag": "t",
                          "created": 1.5, "history": [["t", 4, 1.5]],
                          "tensors": [["k", "float32", [2, 3], 24, 7, 8192, 8192]]})
    m = Manifest.from_body(body)
    assert m.tensors == (CommittedTensor("k", "float32", (2, 3), 24, 7, ((8192, 8192),)),)
    assert Manifest.from_body(m.to_body()) == m      # written back in today's format


@pytest.mark.parametrize("spans, why", [
    ([(PAGE, 5 * PAGE)], "not page-aligned extents of its record's"),            # too short
    ([(PAGE, 5 * PAGE), (100, 6 * PAGE)], "not page-aligned extents"),
    ([(PAGE, 5 * PAGE), (62 * PAGE, 6 * PAGE)], "outside the"),
    ([(PAGE, 5 * PAGE), (4 * PAGE, 6 * PAGE)], "overlapping"),                    # itself
])
def test_a_manifest_whose_extents_cannot_hold_its_records_is_moved_aside(tmp_path, spans,
                                                                         why):
    store = ManifestStore(tmp_path)
    store.write(next_manifest(None, JOB, 0, "bad", (tensor("big", 10 * PAGE, spans),)))
    store.write(next_manifest(None, "other", 0, "good",
                              (tensor("k", 10, [(30 * PAGE, 2 * PAGE)]),)))
    (good,) = store.load_all(64 * PAGE)
    assert good.job == "other"
    (aside,) = store.quarantined()
    assert why in aside["reason"]
