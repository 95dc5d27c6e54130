"""``python -m tierd.bench.cycle --quick`` end to end through real daemons:
demoting cuts the NVMe traffic of a working set larger than the pool, and
prefetching ahead moves no more bytes. Checks bytes, never a timing."""

from __future__ import annotations

import json

from tierd.bench import cycle


def test_cycle_writes_every_policy_and_demoting_reads_less(tmp_path):
    assert cycle.main(["--dir", str(tmp_path / "nvme"), "--out", str(tmp_path / "out"),
                       "--quick", "--ahead", "1"]) == 0
    result = json.loads((tmp_path / "out" / "cycle.json").read_text())
    lru, demoted, ahead = result["policies"]
    assert (lru["demote"], demoted["demote"], ahead["demote"]) == (False, True, True)
    assert (lru["ahead"], demoted["ahead"], ahead["ahead"]) == (0, 0, 1)
    working_set = result["working_set_bytes"]
    assert lru["median_read_bytes"] == working_set   # least recently used misses every key
    assert demoted["median_read_bytes"] < working_set / 2
    assert ahead["median_read_bytes"] <= demoted["median_read_bytes"] + result["key_bytes"]
    assert result["ahead_time_ratio"] > 0
