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


def test_with_a_clock_the_planned_step_keeps_the_disk_busy(tmp_path):
    """``--disk-gbps``: transfers take time, so leases find reads ahead still
    in flight. A lease that had to evict a dirty tensor into a full file,
    with no clean victim, used to fail (CapacityError "NVMe tier full")
    although those reads would land as clean victims: it waits for them
    now. The disk is busy nearly all of each step, whose time is the disk's."""
    rows = eviction_sim.main(["--out", str(tmp_path), *SMALL, "--disk-gbps", "1.8"])["rows"]
    for r in rows[1:]:
        assert r["disk_s"] == pytest.approx((r["read_gb"] + r["written_gb"]) / 1.8, rel=0.05)
        assert 0.9 * r["step_s"] <= r["disk_s"] <= r["step_s"], rows
        assert r["waited_s"] < r["step_s"] and r["ahead_gb"] > 0


def test_blocks_with_adapters_lease_them_and_split_the_state_over_them(tmp_path):
    """``--rank``: each block's lease names its norms and adapters too (the
    catalog's entries, its cost), the state is stored per adapter, and the
    frozen weights' traffic stays what it was."""
    keys = eviction_sim.Block(rank=16).keys()
    assert {"input_norm", "post_norm", "q.lora_A", "o.lora_B"} <= set(keys)
    assert keys["k.lora_B"] == 2 * 1024 * 16 and len(eviction_sim.Block(rank=16).adapters()) == 8
    # scaled down, each small tensor takes a page: a larger file for them
    roomy = [*SMALL[:4], "--nvme-gb", "12", *SMALL[6:]]
    rows = eviction_sim.main(["--out", str(tmp_path), *roomy, "--rank", "16"])["rows"]
    plain = eviction_sim.main(["--out", str(tmp_path / "plain"), *roomy])["rows"]
    for r, p in zip(rows[2:], plain[2:]):   # once the first copies are made
        assert r["catalog_s"] > 0 and r["written_gb"] <= 0.25, rows
        assert r["read_gb"] >= p["read_gb"], (rows, plain)   # the small tensors take room too


@pytest.mark.parametrize("flag", ["--scale", "--layers", "--steps"])
def test_sizes_below_one_are_refused(tmp_path, flag, capsys):
    with pytest.raises(SystemExit):
        eviction_sim.main(["--out", str(tmp_path), flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err


def test_a_plan_told_late_reads_ahead_only_from_then(tmp_path, capsys):
    """``--plan-from``: the client tells its plan at its third step, after
    steps evicted least recently used first; before it nothing is read
    ahead, after it the misses are."""
    rows = eviction_sim.main(["--out", str(tmp_path), *SMALL, "--plan-from", "2"])["rows"]
    assert [r["ahead_gb"] > 0 for r in rows] == [False, False, True, True], rows
    assert json.loads((tmp_path / "eviction-sim.json").read_text())["args"]["plan_from"] == 2
    with pytest.raises(SystemExit):
        eviction_sim.main(["--out", str(tmp_path), "--plan-from", "-1"])
    assert "--plan-from must be at least 0" in capsys.readouterr().err


def test_the_blocks_that_cycle_move_to_the_ones_eviction_by_next_use_picks(tmp_path):
    """A plan told late finds the blocks the first steps spilled cycling
    through NVMe, while the backward's best victims (its first blocks, next
    used at the end of the next forward) have no NVMe copy. Reading ahead
    then evicted nothing until the backward had used blocks with copies,
    and the disk idled (12.3 s a step, 10.8 s of disk, before the change);
    the read-ahead now writes such a victim, giving up the copies of blocks
    it keeps whose uses lie closer together, and the blocks that cycle move
    to both ends of the zigzag: the disk is busy through the step and,
    once they have moved, nothing but the state is written."""
    args = ["--layers", "24", "--pool-gb", "32", "--nvme-gb", "14", "--state-gb", "0.2",
            "--scale", "2048", "--steps", "8", "--plan-from", "2", "--disk-gbps", "1.8"]
    rows = eviction_sim.main(["--out", str(tmp_path), *args])["rows"]
    for r in rows[-2:]:
        assert r["disk_s"] >= 0.95 * r["step_s"], rows
        assert r["written_gb"] <= 0.21, rows
