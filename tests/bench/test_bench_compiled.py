"""``python -m tierd.bench.compiled`` end to end on tiny Hugging Face GPT-2 and
Llama configs on the CPU (aot_eager backend, a real embedded daemon): the
JSON has a row per case and way with every field the issue asks for. Checks
the shape of the output, never a timing: figures are for people (and GPUs)."""

from __future__ import annotations

import json

import pytest

from tierd.bench import compiled

FIELDS = {"case", "model", "compiled", "allgpu_s", "tierd_s", "floor_s", "ratio", "ratio_to",
          "recompiles", "graph_breaks", "frames", "frames_per_step", "allgpu_frames_per_step",
          "peak_gb", "reserved_gb", "alloc_retries", "error", "allgpu_error",
          "units_by_place", "hooked_units"}
SMOKE = ["--tiny", "--device", "cpu", "--backend", "aot_eager", "--layers", "1", "--steps",
         "2", "--warmup", "2", "--pool-gib", "1", "--nvme-gib", "1"]


def run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "out"
    compiled.main(["--out", str(out), *SMOKE, *extra])
    result = json.loads((out / "compiled.json").read_text())
    assert result["device"] == "cpu" and result["commit"] is not None
    return result["rows"]


def check(row: dict) -> None:
    assert FIELDS <= set(row)
    assert row["error"] is None and row["allgpu_error"] is None, row
    assert row["allgpu_s"] > 0 and row["tierd_s"] > 0 and row["ratio"] > 0
    assert row["recompiles"] >= 0 and row["peak_gb"] is None   # no CUDA: no peak


def test_whole_model_compile_rows_of_gpt2_and_llama_with_a_floor_where_capped(tmp_path):
    rows = run(tmp_path, "--compiled", "whole", "--case", "GPT-2,cap")
    assert [(r["model"], r["case"]) for r in rows] == [
        ("GPT2LMHeadModel", "tiny GPT-2 B=2 T=16"),
        ("LlamaForCausalLM", "tiny Llama B=2 T=16, checkpointing, cap 2 MB")]
    for r in rows:
        check(r)
        assert r["compiled"] == "whole"
        assert r["frames"] > 0 and r["frames_per_step"] > 0   # it really was compiled
    plain, capped = rows
    assert plain["floor_s"] is None and plain["ratio_to"] == "allgpu"
    # capped: the floor is at least the all-GPU step, and the ratio is taken to it
    assert capped["floor_s"] >= capped["allgpu_s"] and capped["ratio_to"] == "floor"
    assert capped["ratio"] == pytest.approx(capped["tierd_s"] / capped["floor_s"])
    # the plan and the hooked units: on the CPU an uncapped model streams its
    # 2 units (no plan), hooked; the capped one keeps both whole, none hooked
    assert plain["units_by_place"] is None and plain["hooked_units"] == 2
    assert capped["units_by_place"] == {"resident": 2} and capped["hooked_units"] == 0


@pytest.mark.slow
def test_every_way_of_every_tiny_case(tmp_path):
    rows = run(tmp_path)
    ways = [r["compiled"] for r in rows]
    assert ways == ["eager"] + ["whole"] + ["regional"] + ["eager"] * 2 + ["whole"] * 2 \
        + ["regional"] * 2
    for r in rows:
        check(r)
        assert (r["frames"] == 0) == (r["compiled"] == "eager")
        assert (r["frames_per_step"] == 0) == (r["compiled"] == "eager")


def test_a_case_filter_that_matches_nothing_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compiled.main(["--out", str(tmp_path / "out"), "--tiny", "--case", "no such case"])
    assert "no case left to run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_setting_reaches_attach_and_the_optimizer_and_names_the_row(tmp_path, monkeypatch):
    attached, optimizers = [], []
    real_attach, real_adamw = compiled.attach, compiled.tierd.optim.AdamW

    def attach(model, **kwargs):
        attached.append(kwargs)
        return real_attach(model, **kwargs)

    def adamw(params, **kwargs):
        optimizers.append(kwargs)
        return real_adamw(params, **kwargs)
    monkeypatch.setattr(compiled, "attach", attach)
    monkeypatch.setattr(compiled.tierd.optim, "AdamW", adamw)
    rows = run(tmp_path, "--case", "tiny GPT-2", "--compiled", "eager", "--set",
               "forward_update_share=0", "--set", "optim.prefetch_bytes=131072")
    assert [r["case"] for r in rows] == [
        "tiny GPT-2 B=2 T=16, forward_update_share=0, optim.prefetch_bytes=131072"]
    check(rows[0])
    assert attached and all(kw["forward_update_share"] == 0 for kw in attached)
    assert optimizers and all(kw["prefetch_bytes"] == 131072 for kw in optimizers)


def test_a_malformed_setting_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compiled.main(["--out", str(tmp_path / "out"), "--tiny", "--set", "no_equals_sign"])
    assert "--set" in capsys.readouterr().err and not (tmp_path / "out").exists()
