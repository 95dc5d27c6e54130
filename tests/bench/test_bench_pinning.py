"""``python -m tierd.bench.pinning`` on the CPU: the page tables of segments
zeroed through another mapping are measured, CUDA's registration is left
out, and the result is written where asked."""

from __future__ import annotations

import json

from tierd.bench import pinning


def test_the_cpu_run_measures_page_tables_and_writes_its_json(tmp_path):
    result = pinning.main(["--out", str(tmp_path), "--gib", "0.25"])
    written = json.loads((tmp_path / "pinning-cpu.json").read_text())
    assert written == result and result["device"] == "cpu"
    assert result["segments"] == 1 and result["populate_read_s_per_gib"] > 0
    assert not any(k.startswith(("idle_", "busy_")) for k in result)


def test_segments_read_zero_through_the_client_mapping_and_close_cleanly():
    segs = pinning.segments(2, 1 << 20)
    try:
        for fd, daemon, client in segs:
            daemon[:4] = b"tier"
            assert client[:4] == b"tier" and client[4:8] == bytes(4)
    finally:
        pinning.close(segs)
