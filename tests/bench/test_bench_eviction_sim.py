"""tierd.bench.eviction_sim: the daemon's catalog in-process on a 70B's
blocks, scaled down; what a frozen model's step reads and writes."""

from __future__ import annotations

import json

import pytest

from tierd.bench import eviction_sim

# 12 blocks (20.5 GB at full scale) through a 16 GB pool, a file little
# larger than the spill; 1/2048 scale
SMALL = ["--layers", "12", "--pool-gb", "16", "--nvme-gb", "7", "--state-gb", "0.2",
         "--scale", "2048", "--steps", "4"]


def test_a_planned_step_through_a_spill_sized_file_writes_only_the_state(tmp_path):
    planned = eviction_sim.main(["--out", str(tmp_path), *SMALL])["rows"]
    unplanned = eviction_sim.main(["--out", str(tmp_path / "lru"), *SMALL, "--no-plan"])["rows"]
    must = 2 * (12 * sum(eviction_sim.Block().keys().values()) / 1e9 - 16)
    for p, u in zip(planned[1:], unplanned[1:]):
        assert p["written_gb"] <= 0.21, planned   # at most the state, 0.2 GB (34460ef: 6-8 GB)
        assert must <= p["read_gb"] <= 1.2 * u["read_gb"], (planned, unplanned)
        assert p["ahead_gb"] > 0 and u["ahead_gb"] == 0
    saved = json.loads((tmp_path / "eviction-sim.json").read_text())
    assert saved["rows"] == planned and saved["args"]["plan"] is True


@pytest.mark.parametrize("flag", ["--scale", "--layers", "--steps"])
def test_sizes_below_one_are_refused(tmp_path, flag, capsys):
    with pytest.raises(SystemExit):
        eviction_sim.main(["--out", str(tmp_path), flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
