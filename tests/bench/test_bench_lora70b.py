"""``python -m tierd.bench.lora70b --tiny`` on the CPU: the same code as the
70B run on a model of a few hundred kB built from config through
``attach(meta_model, init=True)``. Checks the rows' fields and arithmetic,
the FLOP count against torch's, the caps and the merging of results files;
never a timing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tierd.bench import lora70b
from tierd.bench.lora70b import FULL, TINY, Case

COMMIT = "0" * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora70b")
    lora70b.main(["--out", str(out), "--tiny", "--layers", "6", "--commit", COMMIT,
                  "--steps", "5", "--warmup", "2",
                  "--case", "lora-24g,lora-default,generate-80g,peer-80g"])
    path = out / f"lora70b-cpu-{COMMIT[:7]}.json"
    return out, json.loads(path.read_text())


def test_training_rows_have_the_step_times_and_the_larger_floor(tiny):
    _, result = tiny
    assert result["commit"] == COMMIT and result["device"] == "cpu"
    rows = {r["case"]: r for r in result["rows"]}
    for name in ("lora-24g", "lora-default"):
        r = rows[name]
        assert r["error"] is None, r["error"]
        assert r["shape"]["layers"] == 6 and r["lora_rank"] == 16 and r["batch"] == 1
        assert r["steps_run"] == 5 and len(r["steps_s"]) == 5 and r["steady_steps"] == 3
        assert r["first_step_s"] == r["steps_s"][0]
        assert r["worst_step_s"] == max(r["steps_s"][2:])
        assert r["tierd_s"] > 0 and r["tflops"] > 0
        assert r["step_flops"] == lora70b.lora_step_flops(replace(TINY, layers=6), 32, 16)
        assert r["compute_floor_s"] == pytest.approx(r["step_flops"] / (r["tflops"] * 1e12))
        parts = {"compute": r["compute_floor_s"], "pcie": r["pcie_floor_s"]}
        if name != "allgpu":   # a tierd row: the disk's part, measured by the probe
            assert r["disk_read_gbps"] > 0 and r["nvme_floor_s"] is not None
            parts["nvme"] = r["nvme_floor_s"]
        assert r["floor_s"] == max(parts.values())
        assert r["binding"] == max(parts, key=parts.get)
        assert r["build_s"] > 0 and r["host_peak_rss_gb"] >= r["host_peak_anon_gb"] > 0
    capped = rows["lora-24g"]
    # on the CPU only a cap places: some units stay, the rest stream every step
    assert capped["placement"] == "placed" and 0 < capped["resident_gb"] < capped["cap_gb"]
    assert capped["pcie_in_gb"] > 0 and capped["plan_changes"] == 0
    # the tiny model fits the test daemon's pool: nothing crosses NVMe
    assert capped["nvme_read_gb"] == capped["nvme_write_gb"] == 0 and capped["pool_gb"] > 0
    assert capped["nvme_read_busy_s"] == 0 and capped["lease_wait_s"] >= 0
    assert rows["lora-default"]["placement"] == "off" and rows["lora-default"]["cap_gb"] is None
    assert rows["build"]["built_by"] in ("lora-24g", "lora-default", "generate-80g")


def test_generation_row_counts_its_tokens_and_the_peer_without_cuda_says_so(tiny):
    _, result = tiny
    rows = {r["case"]: r for r in result["rows"]}
    gen = rows["generate-80g"]
    assert gen["error"] is None, gen["error"]
    assert gen["new_tokens"] == 6 and len(gen["token_s"]) == 6 and gen["prompt"] == 8
    assert gen["first_token_s"] == gen["token_s"][0] and not gen["stopped_by_budget"]
    assert gen["tokens_per_s"] == pytest.approx(6 / sum(gen["token_s"]))
    assert gen["decode_tokens_per_s"] == pytest.approx(3 / sum(gen["token_s"][3:]))
    # the prompt's forward was measured, the tokens ran on the plan
    assert gen["placement"] == "placed" and gen["pcie_in_gb_per_token"] > 0
    peer = rows["peer-80g"]
    assert "CUDA" in peer["error"] and peer["case"] == "peer-80g"


def test_a_rerun_replaces_its_case_and_keeps_the_others(tiny, tmp_path):
    out, before = tiny
    path = out / f"lora70b-cpu-{COMMIT[:7]}.json"
    again = {"commit": COMMIT, "device": "cpu",
             "rows": [{"case": "peer-80g", "error": "again"}, {"case": "new", "error": None}]}
    merged = lora70b.merged(path, again)
    cases = [r["case"] for r in before["rows"]]
    assert [r["case"] for r in merged["rows"]] == cases + ["new"]
    assert next(r for r in merged["rows"] if r["case"] == "peer-80g")["error"] == "again"
    # --merge: a file brought back from the device into the results folder
    source = tmp_path / "from-device" / path.name
    source.parent.mkdir()
    source.write_text(json.dumps(again))
    lora70b.main(["--merge", str(source), "--out", str(out)])
    assert json.loads(path.read_text()) == merged


def test_step_flops_match_torchs_count_of_the_matmuls():
    from peft import get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaForCausalLM

    from tierd.bench.bigmodel_models import checkpointed, llama_config
    shape, seq = replace(TINY, hidden=128, intermediate=512, vocab=1000, layers=3), 64
    torch.manual_seed(0)
    model = get_peft_model(checkpointed(LlamaForCausalLM(llama_config(shape, seq))),
                           lora70b.lora_config(16)).train()
    ids = torch.randint(0, shape.vocab, (1, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    # torch counts the matrix products (not the CPU's fused attention: added
    # from the formula); the formula is an estimate from above, within 10 %
    counted = counter.get_total_flops() + lora70b.attention_flops(shape, seq)
    assert counted <= lora70b.lora_step_flops(shape, seq, 16) <= 1.1 * counted


def test_caps_are_the_cases_on_the_full_shape_and_at_least_a_unit_when_scaled():
    case = Case("c", "train", 24)
    full = lora70b.meta_model(FULL, 2048, 16, train=True)
    assert lora70b.cap_bytes(case, FULL, full) == 24_000_000_000
    assert lora70b.cap_bytes(Case("d", "train"), FULL, full) is None
    for shape in (replace(FULL, layers=4), TINY):
        model = lora70b.meta_model(shape, 2048, 16, train=True)
        cap = lora70b.cap_bytes(case, shape, model)
        assert cap >= lora70b.least_cap(model) * 5 // 4
        assert cap >= 24_000_000_000 * shape.params // FULL.params


def test_unknown_cases_and_too_few_steps_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        lora70b.main(["--out", str(tmp_path), "--tiny", "--case", "lora-99g"])
    assert "lora-99g" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lora70b.main(["--out", str(tmp_path), "--tiny", "--steps", "2", "--warmup", "3"])


def test_a_setting_reaches_attach_and_names_its_row(tmp_path):
    """``--set``: the setting is attach's for the tierd cases (the adapters, a
    few kB here, resident below the size given), and their rows are named for
    it, kept beside the rows at the defaults."""
    from tierd.client.attached import session_of
    common = ["--out", str(tmp_path), "--tiny", "--layers", "2", "--commit", COMMIT,
              "--steps", "3", "--warmup", "1", "--case", "lora-24g"]
    def adapters_resident(argv):
        args = lora70b.parse_args(common + argv)
        model, _ = lora70b.build_attached(lora70b.BY_NAME["lora-24g"], replace(TINY, layers=2),
                                          args, torch.device("cpu"), train=True)
        session = session_of(model)
        adapters = [tp for tp in session.registry.params.values() if "lora_" in tp.name]
        return session.config.resident_below_bytes, [tp.resident for tp in adapters]
    below, resident = adapters_resident(["--set", "resident_below_bytes=8192"])
    assert below == 8192 and all(resident)
    below, resident = adapters_resident([])
    assert below == 0 and not all(resident)
    lora70b.main(common)
    lora70b.main(common + ["--set", "resident_below_bytes=8192"])
    rows = {r["case"]: r for r in json.loads(
        (tmp_path / f"lora70b-cpu-{COMMIT[:7]}.json").read_text())["rows"]}
    kept = rows["lora-24g, resident_below_bytes=8192"]
    assert rows["lora-24g"]["error"] is None and kept["error"] is None, kept["error"]
    assert kept["steps_run"] == 3 and rows["build"]["built_by"] == kept["case"]


def test_a_malformed_setting_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        lora70b.main(["--out", str(tmp_path), "--tiny", "--set", "resident_below_bytes"])
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.json"))


def test_on_the_70b_shape_the_adapter_rule_keeps_what_one_mib_kept():
    """[Note: adapters stay on the device] (tierd.client.registry): on the
    bench's 70B shape (meta device) the default rule keeps exactly the
    parameters ``resident_below_bytes=1 MiB`` kept trainable in the H200 row
    it cites: every adapter, nothing of the base."""
    from tierd.client import registry
    model = lora70b.meta_model(FULL, 2048, 16, train=True)
    kept = set().union(*(registry.adapters(ps) for _, ps in registry.unit_parameters(model)))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    below = {id(p) for p in model.parameters()
             if p.requires_grad and p.numel() * p.element_size() < 1 << 20}
    assert kept == trainable == below and len(kept) == 80 * 4 * 2
