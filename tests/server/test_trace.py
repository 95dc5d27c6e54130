"""The daemon's timeline ([Note: the daemon's timeline] in tierd.server.trace):
a real daemon spilling to its NVMe file writes a line per request served and
per record moved, and the report splits the span by what was in flight."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

import tierd
from tierd.bench import trace_report

MiB = 1 << 20


def test_a_traced_daemon_writes_its_requests_and_records(daemon_factory, tmp_path):
    trace = tmp_path / "trace.jsonl"
    d = daemon_factory(pool="8MiB", nvme_size="64MiB",
                       extra=("--segment-size", "4MiB", "--trace", str(trace)))
    keys = [f"w/{i}" for i in range(6)]          # 12 MiB through an 8 MiB pool
    with tierd.connect(d.socket) as c:
        for i, k in enumerate(keys):
            c.put(k, torch.full((MiB // 2,), float(i)))
        for k in keys:                          # the first ones come back from NVMe
            c.lease([k])
            c.release([k])
        for i, k in enumerate(keys):
            assert torch.equal(c.get(k), torch.full((MiB // 2,), float(i)))
    d.stop()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    ops = {e["op"] for e in events if e["ev"] == "req"}
    assert {"Reserve", "Publish", "Lease", "Release"} <= ops
    reads = [e for e in events if e["ev"] == "io" and e["dir"] == "read"]
    writes = [e for e in events if e["ev"] == "io" and e["dir"] == "write"]
    assert reads and writes, events
    assert {e["key"] for e in reads} <= set(keys)
    assert all(e["bytes"] >= 2 * MiB and e["s"] >= 0 for e in reads + writes)
    leases = [e for e in events if e["ev"] == "req" and e["op"] == "Lease"]
    assert any(e["blocked"] for e in leases)    # a lease of a key on NVMe waits for its read
    assert all(e["key"] in keys and e["n"] == 1 for e in leases)

    report = trace_report.split(events)
    parts = (report["read_s"] + report["write_only_s"] + report["idle_lease_pending_s"]
             + report["idle_nothing_pending_s"])
    assert parts == pytest.approx(report["span_s"])
    assert report["read_gb"] == pytest.approx(sum(e["bytes"] for e in reads) / 1e9)
    assert report["lease_pending_s"] > 0


def test_a_daemon_without_a_trace_writes_none(daemon_factory, tmp_path):
    d = daemon_factory()
    with tierd.connect(d.socket) as c:
        c.put("k", torch.ones(4))
    d.stop()
    assert not list(tmp_path.rglob("*.jsonl"))


def test_the_report_reads_a_trace_and_says_what_it_split(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"t":2.0,"ev":"io","dir":"read","key":"a","bytes":1000000000,"s":1.0}\n'
        '{"t":3.0,"ev":"req","op":"Lease","sid":1,"n":1,"key":"a","at":null,"s":2.5,'
        '"blocked":true}\n{"t":3.5,"ev":"io","dir":"wri')   # a torn last line
    r = trace_report.main([str(path)])
    assert r["read_s"] == pytest.approx(1.0) and r["read_gb"] == pytest.approx(1.0)
    # asked at 0.5, answered at 3.0, read 1.0-2.0: idle with it pending 0.5-1.0 and 2.0-3.0
    assert r["idle_lease_pending_s"] == pytest.approx(1.5)
    assert "a read in flight 1.0 s" in capsys.readouterr().out
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert trace_report.main([str(packed)]) == r
    with pytest.raises(SystemExit, match="no events"):
        (tmp_path / "empty.jsonl").write_text("")
        trace_report.main([str(tmp_path / "empty.jsonl")])
