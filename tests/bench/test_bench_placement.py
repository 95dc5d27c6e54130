"""``python -m tierd.bench.placement --tiny`` end to end on the CPU, on tiny
Hugging Face models (GPT2LMHeadModel, LlamaForCausalLM from config): every
case gets a row with issue 29's fields, measured back to back and
synchronized, the capped cases a floor and their plan changes counted. Checks
the shape of the output and the figures' arithmetic, never a timing."""

from __future__ import annotations

import json

import pytest
import torch

from tierd.bench import allocator, placement, settings, steploop

FIELDS = ("case", "model", "allgpu_s", "tierd_s", "floor_s", "plan_changes", "worst_step_s",
          "first_step_s", "tierd_sync_s", "allgpu_sync_s", "tierd_run_s", "allgpu_run_s",
          "plan_changed_at", "placement_replans", "tierd_steps_s", "pcie_in_gb",
          "planned_pcie_gb", "tierd_diag", "allgpu_diag", "error", "commit")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("placement")
    placement.main(["--out", str(out), "--tiny", "--commit", "0" * 40])
    return out, json.loads((out / "placement.json").read_text())


def test_every_case_has_a_row_with_the_issues_fields(tiny):
    _, result = tiny
    assert result["commit"] == "0" * 40 and result["device"] == "cpu"
    rows = {r["case"]: r for r in result["rows"]}
    assert list(rows) == [c.name for c in placement.TINY]
    for case in placement.TINY:
        r = rows[case.name]
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["error"] is None and r["allgpu_error"] is None
        assert r["model"] == ("LlamaForCausalLM" if "Llama" in case.name else "GPT2LMHeadModel")
        for k in ("allgpu_s", "tierd_s", "tierd_sync_s", "allgpu_sync_s", "worst_step_s",
                  "first_step_s", "allgpu_worst_step_s", "allgpu_first_step_s"):
            assert r[k] > 0, k
        assert len(r["tierd_steps_s"]) == 6 and r["steady_steps"] == 4   # --tiny: 6, warm-up 2
        assert r["worst_step_s"] == max(r["tierd_steps_s"][2:])
        assert r["first_step_s"] == r["tierd_steps_s"][0]
        assert r["clock"] == "host"   # the CPU: no CUDA events
        assert "expandable_segments:True" not in r["allocator_settings"]   # not set on the CPU
        assert r["tierd_retries"] is r["tierd_mallocs"] is r["tierd_frees"] is None   # ... no allocator
        assert r["plan_changes"] == max(0, len(r["plan_changed_at"]) - 1)
        first = r["first_step_diag"]   # the optimizer told the daemon its first step's sizes
        assert first["pool_spare_gb_at_start"] > 0 and first["pool_segment_wait_s"] >= 0
        assert first["nvme_written_gb"] == first["nvme_read_gb"] == 0   # the pool holds it
        assert first["lease_wait_seconds"] >= first["lease_wait_grads_s"] >= 0
        assert first["pool_mapped_gb"] >= 0 and first["pool_map_seconds"] >= 0
        # the optimizer mapped the segments made for the first step as it was built
        assert first["pool_mapped_ahead_gb_at_start"] > 0 and r["optimizer_build_s"] > 0
        assert min(first[k] for k in ("host_forward_s", "host_backward_s", "host_step_s")) > 0
        samples = first["host_samples"]   # the lines the first step's host was on
        assert samples["samples"] > 0 and samples["lines"] and samples["interval_s"] > 0
        if "cap" in case.name:
            # on the CPU an explicit cap places, once, from the first step's measurement
            assert r["placement"] == "placed" and r["plan_changed_at"][0] <= 2
            assert r["floor_s"] >= r["allgpu_s"] and r["planned_pcie_gb"] > 0
        else:   # no cap on the CPU: no placement, so no floor (the target is all-GPU)
            assert r["placement"] == "off" and r["plan_changed_at"] == []
            assert r["floor_s"] is None


def test_case_reruns_its_cases_and_merges_them_into_the_results(tiny):
    out, before = tiny
    one = "tiny Llama B=2, checkpointing, cap 6 MB"
    placement.main(["--out", str(out), "--tiny", "--case", one, "--commit", "1" * 40])
    rows = json.loads((out / "placement.json").read_text())["rows"]
    assert [r["case"] for r in rows] == [r["case"] for r in before["rows"]]
    assert {r["case"]: r["commit"][0] for r in rows} == {
        c.name: "1" if c.name == one else "0" for c in placement.TINY}


def test_a_model_whose_state_cannot_fit_the_device_gets_a_row_without_the_reference(
        tmp_path, monkeypatch):
    # the 13B case on the H200: the device's memory as if it were a few bytes
    monkeypatch.setattr(placement, "device_bytes", lambda device: 1000)
    placement.main(["--out", str(tmp_path), "--tiny", "--case", "tiny GPT-2 B=2, cap"])
    [row] = json.loads((tmp_path / "placement.json").read_text())["rows"]
    assert row["allgpu_s"] is None and row["allgpu_diag"] is None
    assert "does not fit" in row["allgpu_error"]
    assert row["error"] is None and row["tierd_s"] > 0 and row["placement"] == "placed"
    assert row["floor_s"] is None   # no all-GPU step, and the CPU profiles no compute stream


def test_a_setting_runs_beside_the_defaults_in_rows_of_its_own(tiny, tmp_path):
    out, before = tiny
    placement.main(["--out", str(out), "--tiny", "--case", "tiny GPT-2 B=2, cap",
                    "--set", "prefetch_bytes=65536", "--commit", "2" * 40])
    rows = {r["case"]: r for r in json.loads((out / "placement.json").read_text())["rows"]}
    new = rows["tiny GPT-2 B=2, cap 6 MB, prefetch_bytes=65536"]
    assert new["options"] == {"gpu_memory_bytes": 6_000_000, "prefetch_bytes": 65536}
    assert new["error"] is None and new["tierd_s"] > 0
    assert rows["tiny GPT-2 B=2, cap 6 MB"]["commit"] == "0" * 40   # the default row stays
    # a case that names the key keeps its own value and name
    [kept] = settings.with_settings([placement.Case("c", "m", 1, {"prefetch_bytes": 1})],
                                    ["prefetch_bytes=2"])
    assert kept.name == "c" and kept.options == {"prefetch_bytes": 1}


def test_an_optim_setting_goes_to_the_optimizer(tiny, monkeypatch):
    out, _ = tiny
    made = []
    real = placement.tierd.optim.AdamW

    def adamw(params, **kwargs):
        made.append(kwargs)
        return real(params, **kwargs)
    monkeypatch.setattr(placement.tierd.optim, "AdamW", adamw)
    placement.main(["--out", str(out), "--tiny", "--case", "tiny GPT-2 B=2, cap",
                    "--set", "optim.prefetch_bytes=131072", "--commit", "2" * 40])
    rows = {r["case"]: r for r in json.loads((out / "placement.json").read_text())["rows"]}
    new = rows["tiny GPT-2 B=2, cap 6 MB, optim.prefetch_bytes=131072"]
    assert new["error"] is None and new["options"]["optim.prefetch_bytes"] == 131072
    assert made and all(kw == {"lr": 1e-4, "prefetch_bytes": 131072} for kw in made)


@pytest.mark.parametrize("bad", ["forward_update_share", "=1", "x=not a literal",
                                 "optim.=1", "optim.a.b=1"])
def test_a_setting_that_is_not_key_equals_literal_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        placement.main(["--out", "unused", "--tiny", "--set", bad])
    assert "--set" in capsys.readouterr().err


def test_steps_must_exceed_the_warmup(capsys):
    with pytest.raises(SystemExit):
        placement.main(["--out", "unused", "--steps", "3", "--warmup", "3"])
    assert "--steps=3 must exceed --warmup=3" in capsys.readouterr().err


def test_the_summary_takes_the_last_steps_and_the_worst_after_warmup():
    seconds = [9.0, 4.0] + [1.0] * 30 + [3.0] + [2.0] * 19
    s = steploop.summary(seconds, warmup=3)
    assert s["steady_steps"] == 20 and s["median_s"] == 2.0
    assert s["worst_step_s"] == 3.0 and s["first_step_s"] == 9.0
    assert steploop.summary(seconds[:5], warmup=3)["steady_steps"] == 2   # fewer: what is left
    with pytest.raises(ValueError, match="3 steps with warmup=3"):
        steploop.summary(seconds[:3], warmup=3)


def test_plan_changes_leave_out_the_first_plan_only():
    assert placement.plan_changes([None, "A", "A"]) == ([2], 0)
    # a step outgrew A: everything streamed for a step, then B
    assert placement.plan_changes([None, "A", None, "B", "B"]) == ([2, 3, 4], 2)
    assert placement.plan_changes(["A", "B"], before="A") == ([2], 1)   # placed at attach
    assert placement.plan_changes([None, None]) == ([], 0)   # no placement


def test_the_reference_is_left_out_only_where_its_state_cannot_fit():
    h200 = 150_000_000_000
    why = placement.reference_misfit(placement.MODELS["llama-13B"].params(1024), h200)
    assert "13.2B parameters" in why and "211 GB" in why and "150 GB" in why
    assert placement.reference_misfit(placement.MODELS["llama-8B"].params(1024), h200) is None
    assert placement.reference_misfit(10**12, None) is None   # the CPU: no device memory


def test_a_floor_without_the_all_gpu_step_uses_tierds_own_compute():
    # the reference does not fit: tierd's compute-stream busy time stands in
    row = {"allgpu_s": None, "tierd_diag": {"compute_busy_s": 0.7}, "planned_pcie_gb": 50.0}
    assert placement.floor(row, 100e9) == 0.7
    assert placement.floor({**row, "planned_pcie_gb": 100.0}, 100e9) == 1.0   # PCIe-bound
    assert placement.floor({**row, "allgpu_s": 0.9}, 100e9) == 0.9
    assert placement.floor({**row, "tierd_diag": None}, 100e9) is None   # CPU: no profile


def test_a_profile_of_no_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        placement.main(["--out", "unused", "--profile-steps", "0"])
    assert "--profile-steps=0 must be at least 1" in capsys.readouterr().err


def test_case_is_a_regular_expression_so_one_row_can_be_chosen_alone(capsys):
    names = [c.name for c in placement.CASES]
    assert [n for n in names if placement.matches(n, "cap 48 GB")] == [
        "GPT-2 1.3B B=8, cap 48 GB", "GPT-2 1.3B B=8, cap 48 GB, updates in backward"]
    assert [n for n in names if placement.matches(n, "cap 48 GB$")] == [
        "GPT-2 1.3B B=8, cap 48 GB"]
    with pytest.raises(SystemExit):
        placement.main(["--out", "unused", "--case", "cap (48"])
    assert "--case 'cap (48' is not a regular expression" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cache_is_split_by_the_stream_its_blocks_serve():
    """``cache_by_stream``: a block allocated and freed on a side stream stays
    cached for that stream only, and is reported there, not under the
    compute stream."""
    device = torch.device("cuda")
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        block = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    kept = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del block
    torch.cuda.synchronize()
    got = allocator.cache_by_stream(device, {"compute": torch.cuda.current_stream(device),
                                             "side": side, "absent": None})
    assert got["side"]["reserved_gb"] >= (256 << 20) / placement.GB
    assert got["side"]["allocated_gb"] == 0
    assert got["compute"]["allocated_gb"] >= (64 << 20) / placement.GB
    del kept
