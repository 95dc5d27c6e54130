"""``python -m tierd.bench.bigmodel``: the ``--tiny`` CPU run trains each system
in its own process and writes the issue's schema; later calls merge into the
file; the watchdog ends an attempt that runs out of host memory or time; the
ladder stops at its first failure; a smaller batch follows only a GPU
out-of-memory in a step. Checks behaviour and the output's shape, never a
timing: figures are for people (and GPUs)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import ROOT, subprocess_env
from tierd.bench import bigmodel, bigmodel_results
from tierd.bench.bigmodel_attempt import meminfo, sweep_scratch
from tierd.bench.bigmodel_models import BASES, build_meta, shape_of
from tierd.bench.bigmodel_systems import CpuAdamW, RunSpec, deepspeed_config

SCHEMA = {"model": str, "system": str, "params": int, "batch": int,
          "tokens_per_s": (float, type(None)), "tflops": (float, type(None)),
          "peak_gpu_gb": float, "peak_host_gb": float, "error": (str, type(None))}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def bench(out, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "tierd.bench.bigmodel", "--out", str(out),
                           "--cache-dir", str(out / "cache"), *args], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_tiny_run_trains_each_system_and_merges_later_calls(tmp_path):
    # deepspeed is not installed here: its row must say so, not be left out
    systems = "tierd,fsdp2" if HAS_DEEPSPEED else "tierd,fsdp2,deepspeed"
    bench(tmp_path, "--tiny", "--systems", systems)
    result = json.loads((tmp_path / "bigmodel.json").read_text())
    assert result["device"] == "cpu" and result["commit"]
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == systems.split(",")
    tiny = shape_of("tiny")
    for system in ("tierd", "fsdp2"):
        r = rows[system]
        assert tuple(r)[:len(bigmodel_results.ROW_KEYS)] == bigmodel_results.ROW_KEYS
        for key, kind in SCHEMA.items():
            assert isinstance(r[key], kind), (system, key, r[key])
        assert r["error"] is None and r["model"] == "tiny" and r["batch"] == 2
        assert r["params"] == tiny.params == sum(p.numel() for p in build_meta(tiny, 32)
                                                 .parameters())
        assert len(r["step_times"]) == len(r["losses"]) == 1 + 2   # --tiny: 1 warm-up + 2
        assert all(math.isfinite(x) and x > 0 for x in r["losses"])
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_s"])
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * tiny.flops_per_token(32) / 1e12)
    assert list(rows["tierd"]["setup_phases"]) == ["build", "daemon", "attach", "optimizer"]
    if not HAS_DEEPSPEED:
        assert rows["deepspeed"]["error"].startswith("setup: import deepspeed: Module")
        assert "No module named 'deepspeed'" in rows["deepspeed"]["error"]
        assert rows["deepspeed"]["tokens_per_s"] is None
    assert result["largest"] == {"tierd": tiny.params, "fsdp2": tiny.params,
                                 "deepspeed": None}
    assert list((tmp_path / "cache").iterdir()) == []   # scratch and NVMe files gone

    # a ladder whose first rung is killed for host memory: one row, the
    # ladder stops there, and the rows of the first call stay
    floor = (meminfo()[0] + meminfo()[1]) / 2**30 + 1   # more than the machine has
    proc = bench(tmp_path, "--tiny", "--largest", "--systems", "tierd",
                 "--host-floor-gib", str(floor))
    merged = json.loads((tmp_path / "bigmodel.json").read_text())
    ladder = [r for r in merged["rows"] if r["model"].startswith("tiny-L")]
    assert [r["model"] for r in ladder] == ["tiny-L1"]
    assert "available memory fell to" in ladder[0]["error"]
    assert merged["rows"][:len(rows)] == result["rows"]
    assert merged["largest"] == result["largest"]
    assert "tiny-L1" in proc.stderr   # the summary table


def test_an_attempt_past_its_time_is_killed_and_its_row_says_so(tmp_path):
    bench(tmp_path, "--tiny", "--systems", "fsdp2", "--timeout", "0.5")
    (r,) = json.loads((tmp_path / "bigmodel.json").read_text())["rows"]
    assert r["error"].startswith("killed: ran past its 0.5 s limit (--timeout)")
    assert r["tokens_per_s"] is None
    assert not list((tmp_path / "cache").iterdir())   # its scratch is gone


def _workers(pid: int) -> list[int]:
    """The attempt processes ``pid`` started (not, say, its ``git rev-parse``)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and \
                    b"tierd.bench.bigmodel_worker" in cmdline:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_attempt_dies_with_the_bench_that_started_it(tmp_path, sig):
    # a long attempt, and its bench stopped from outside (as a caller's time limit would)
    cache = tmp_path / "cache"
    bench_proc = subprocess.Popen(
        [sys.executable, "-m", "tierd.bench.bigmodel", "--out", str(tmp_path), "--cache-dir",
         str(cache), "--tiny", "--systems", "fsdp2", "--steps", "100000"],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (workers := _workers(bench_proc.pid)):
            assert bench_proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        bench_proc.send_signal(sig)
        bench_proc.wait()
    deadline = time.monotonic() + 60
    while any(_running(w) for w in workers):
        assert time.monotonic() < deadline, f"attempt {workers} outlived its bench"
        time.sleep(0.1)
    left = list(cache.glob("bigmodel-*"))
    if sig == signal.SIGTERM:
        assert left == []   # the bench unwound: its attempt's scratch is gone
    else:   # nothing ran after SIGKILL: the next call sweeps it
        assert len(left) == 1 and sweep_scratch(cache) == left and not left[0].exists()


def test_the_sweep_leaves_the_scratch_of_a_running_bench(tmp_path):
    mine = tmp_path / "bigmodel-8B-tierd-B8-abc"
    mine.mkdir()
    (mine / "owner.pid").write_text(str(os.getpid()))
    other = tmp_path / "not-ours"
    other.mkdir()
    assert sweep_scratch(tmp_path) == [] and mine.exists() and other.exists()


def fake_attempt(outcomes: dict):
    """An ``attempt`` that returns what a worker would have, per batch."""
    tried = []

    def attempt(spec, timeout):
        tried.append(spec.batch)
        kind = outcomes[spec.batch]
        raw = {"phase": "step 1/3", "peak_gpu_gb": 1.0, "peak_host_gb": 2.0, "device": "x"}
        if kind == "ok":
            return {**raw, "done": True, "step_s": [1.0, 0.5, 0.5, 0.5, 0.5], "losses": [1.0]}
        return {**raw, "error": f"step 1/3: {kind}", "oom_in_step": kind == "OutOfMemoryError"}
    attempt.tried = tried
    return attempt


def test_a_smaller_batch_is_tried_only_after_a_gpu_out_of_memory(tmp_path):
    args = bigmodel.parse_args(["--out", str(tmp_path), "--batch", "8,2,4"])
    attempt = fake_attempt({8: "OutOfMemoryError", 4: "ok", 2: "ok"})
    r = bigmodel.best_batch("tierd", "8B", args, attempt)
    assert attempt.tried == [8, 4] and r["batch"] == 4 and r["error"] is None
    assert r["step_s"] == 0.5 and "B=8: out of GPU memory (step 1/3)" in r["notes"]

    attempt = fake_attempt({8: "CapacityError", 4: "ok", 2: "ok"})
    r = bigmodel.best_batch("tierd", "8B", args, attempt)
    assert attempt.tried == [8] and r["error"] == "step 1/3: CapacityError"

    attempt = fake_attempt({8: "OutOfMemoryError", 4: "OutOfMemoryError",
                            2: "OutOfMemoryError"})
    r = bigmodel.best_batch("fsdp2", "13B", args, attempt)
    assert attempt.tried == [8, 4, 2] and r["batch"] == 2
    assert r["error"].startswith("out of GPU memory at every batch tried")


def test_an_attempt_whose_timeout_does_not_fit_the_budget_is_not_started(tmp_path):
    args = bigmodel.parse_args(["--out", str(tmp_path), "--batch", "4", "--timeout", "300",
                                "--budget-s", "299"])
    attempt = fake_attempt({4: "ok"})
    r = bigmodel.best_batch("deepspeed", "13B", args, attempt)
    assert attempt.tried == [] and r["not_run"] and "--budget-s" in r["error"]
    assert r["params"] == shape_of("13B").params   # the row still says what it was


def test_a_worker_that_died_without_a_result_is_a_row_saying_how():
    spec = RunSpec(system="fsdp2", model="8B", batch=4, seq=2048, warmup=2, steps=3,
                   device="cuda")
    raw = {"phase": "step 1/5", "returncode": -9, "log_tail": "a\nlast line\n"}
    r = bigmodel_results.row(spec, raw, "abc", [])
    assert r["error"].startswith("the worker was killed by signal 9 (SIGKILL from outside")
    assert "(at step 1/5)" in r["error"] and r["error"].endswith("a | last line")
    assert r["tokens_per_s"] is None and r["commit"] == "abc"


def test_the_ladder_stops_at_its_first_failure():
    def run_model(system, model):
        return {"model": model, "system": system,
                "error": "killed" if shape_of(model).layers >= 48 else None}
    rows = bigmodel.climb("deepspeed", ["L24", "L32", "L48", "L64"], run_model)
    assert [(r["model"], r["error"]) for r in rows] == [("L24", None), ("L32", None),
                                                        ("L48", "killed")]


def test_merge_replaces_the_same_model_and_system_and_keeps_the_rest():
    def r(model, system, error=None, **extra):
        return {"model": model, "system": system, "params": shape_of(model).params,
                "error": error, **extra}
    old = {"commit": "a", "device": "H200", "rows": [r("8B", "tierd"), r("8B", "fsdp2", "x")]}
    new = [r("8B", "fsdp2"), r("L80", "tierd"), r("8B", "tierd", "not run", not_run=True),
           r("13B", "deepspeed", "not run", not_run=True)]
    merged = bigmodel_results.merge(old, new, "b")
    assert [(x["model"], x["system"], x["error"]) for x in merged["rows"]] == [
        ("8B", "tierd", None), ("8B", "fsdp2", None), ("L80", "tierd", None),
        ("13B", "deepspeed", "not run")]
    assert merged["commit"] == "b" and merged["device"] == "H200"
    assert merged["largest"] == {"tierd": shape_of("L80").params,
                                 "fsdp2": shape_of("8B").params, "deepspeed": None}


def test_model_names_and_sizes_match_the_llama_shapes():
    for name in ("8B", "13B"):
        assert shape_of(name).params == sum(p.numel() for p in build_meta(BASES[name], 2048)
                                            .parameters())
    assert round(shape_of("8B").params / 1e9, 2) == 8.03
    assert round(shape_of("13B").params / 1e9, 2) == 13.02
    assert shape_of("L80").layers == 80 and shape_of("L80").hidden == 4096
    assert shape_of("L33").params - shape_of("L32").params == shape_of("8B").layer_params
    with pytest.raises(ValueError, match="unknown model '7B'"):
        shape_of("7B")


def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys):
    for flags, says in ((["--systems", "tierd,megatron"], "unknown ['megatron']"),
                        (["--models", "8B,7B"], "unknown model '7B'"),
                        (["--batch", "4,x"], "--batch '4,x': give comma-separated"),
                        (["--tierd-nvme-gib", "8"], "--tierd-nvme-gib needs --tierd-pool-gib")):
        with pytest.raises(SystemExit) as exc:
            bigmodel.main(["--out", str(tmp_path / "out"), *flags])
        assert exc.value.code == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_deepspeed_is_configured_for_zero3_cpu_offload():
    cfg = deepspeed_config(batch=4, hidden=4096, lr=1e-5)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["bf16"] == {"enabled": True}
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == 1e-5
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["reduce_bucket_size"] == 4096 * 4096
    json.dumps(cfg)   # what DeepSpeed parses


def test_fsdp2_optimizer_falls_back_to_foreach_when_the_fused_kernel_fails_first():
    import torch
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.complex64))   # no fused kernel takes it
    p.grad = torch.ones(4, dtype=torch.complex64)
    notes = []
    opt = CpuAdamW([p], lr=0.1, notes=notes)
    opt.step()
    assert "foreach instead" in notes[1] and notes[-1] == "optimizer torch AdamW (foreach)"
    assert not torch.equal(p.detach(), torch.ones(4, dtype=torch.complex64))   # it updated
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_tiny_deepspeed_trains_with_cpu_adam(tmp_path):
    bench(tmp_path, "--tiny", "--systems", "deepspeed", timeout=600)
    (r,) = json.loads((tmp_path / "bigmodel.json").read_text())["rows"]
    assert r["error"] is None and "optimizer DeepSpeedCPUAdam" in r["notes"]
    assert all(math.isfinite(x) for x in r["losses"])


def test_flops_per_token_counts_matmul_parameters_and_attention():
    s = shape_of("8B")
    assert s.flops_per_token(2048) == 6 * (s.params - s.vocab * s.hidden) + \
        12 * 32 * 4096 * 2048


def test_tierd_rows_say_their_floor_and_what_crossed_nvme(tmp_path):
    # a daemon whose pool is smaller than the tiny model's store: state crosses NVMe
    proc = bench(tmp_path, "--tiny", "--systems", "tierd", "--models", "tiny-L2",
                 "--compute-ref", "tiny-L2", "--tierd-pool-gib", str(1 / 1024),
                 "--tierd-nvme-gib", "0.0625", "--steps", "3", timeout=400)
    result = json.loads((tmp_path / "bigmodel.json").read_text())
    ref, r = result["rows"]
    assert (ref["system"], ref["error"]) == ("allgpu", None)
    assert result["largest"] == {"tierd": shape_of("tiny-L2").params, "fsdp2": None,
                                 "deepspeed": None}   # the reference is no peer
    assert r["error"] is None, r["error"]
    disk = result["disk"]
    assert disk["mixed_each_way_GBps"] > 0 and r["disk_mixed_GBps"] == \
        disk["mixed_each_way_GBps"]
    # every step's bytes, and the measured steps' medians
    assert len(r["traffic"]) == 1 + 3
    assert r["nvme_read_gb"] == pytest.approx(
        sorted(s["nvme_read_bytes"] for s in r["traffic"][1:])[1] / 1e9)
    assert r["nvme_read_gb"] > 0 and r["nvme_write_gb"] > 0
    # what must cross: the store bytes a step moves beyond the pool
    assert r["pool_gb"] == pytest.approx(2**20 / 1e9)
    assert r["nvme_must_cross_gb"] == pytest.approx(r["step_store_gb"] - r["pool_gb"])
    assert r["nvme_s"] == pytest.approx(r["nvme_must_cross_gb"] / r["disk_mixed_GBps"])
    assert r["compute_ref"] == "tiny-L2" and r["compute_s"] == pytest.approx(ref["step_s"])
    assert r["pcie_s"] is None   # no PCIe on the CPU
    assert r["floor_s"] == max(r["compute_s"], r["nvme_s"])
    assert r["binding"] == ("nvme" if r["nvme_s"] > r["compute_s"] else "compute")
    assert r["target_s"] == pytest.approx(1.25 * r["floor_s"])
    assert r["to_floor"] == pytest.approx(r["step_s"] / r["floor_s"])
    assert "tiny-L2     tierd B=2: floor" in proc.stdout


def test_the_floor_is_the_longest_part_and_names_it():
    from tierd.bench import bigmodel_floor as bf
    s8, s80 = shape_of("L8"), shape_of("L80")
    ref = {"model": "L8", "system": "allgpu", "error": None, "step_s": 2.0, "hidden": 4096,
           "seq": 2048, "batch": 4, "layers": 8, "flops_per_token": s8.flops_per_token(2048)}
    row = {"model": "L80", "system": "tierd", "error": None, "step_s": 60.0, "hidden": 4096,
           "seq": 2048, "batch": 4, "layers": 80, "flops_per_token": s80.flops_per_token(2048),
           "pcie_both_ways_GBps": 100.0, "planned_pcie_gb": 268.0, "step_store_gb": 147.0,
           "pool_gb": 112.0, "disk_mixed_GBps": 1.0}
    other = {**ref, "batch": 8, "step_s": 1.0}          # another batch: not this row's
    rows = [other, ref, row]
    assert bf.compute_reference(row, rows) is ref
    (_, _, got) = bf.with_floors(rows)
    compute = 2.0 * s80.flops_per_token(2048) / s8.flops_per_token(2048)
    assert got["compute_s"] == pytest.approx(compute)
    assert got["pcie_s"] == pytest.approx(2.68)
    assert got["nvme_must_cross_gb"] == pytest.approx(35.0)
    assert got["nvme_s"] == pytest.approx(35.0)
    assert (got["floor_s"], got["binding"]) == (pytest.approx(35.0), "nvme")
    assert got["to_floor"] == pytest.approx(60 / 35)
    # a pool holding everything a step moves: nothing must cross, compute binds
    fits = bf.floor({**row, "pool_gb": 200.0}, ref)
    assert fits["nvme_s"] == 0 and fits["binding"] == "compute"
    # nothing to compute it from: no floor, said so
    bare = bf.floor({**row, "pcie_both_ways_GBps": None, "step_store_gb": None}, None)
    assert bare["floor_s"] is None and bare["binding"] is None
    nothing = bf.floor({**row, "pcie_both_ways_GBps": None, "pool_gb": 200.0}, None)
    assert nothing["nvme_s"] == 0 and nothing["floor_s"] is None and nothing["to_floor"] is None


def test_a_step_moves_the_store_bytes_of_every_unit_not_on_the_gpu():
    from tierd.bench.bigmodel_floor import step_store_bytes
    from tierd.client.placement import Place, UnitBytes
    units = [UnitBytes(i, param_bytes=2, state_bytes=12, grad_bytes=4) for i in range(5)]
    places = {0: Place.RESIDENT, 1: Place.WEIGHTS, 2: Place.CPU, 3: Place.STREAM}
    # 4 is in no plan: it streams
    assert step_store_bytes(units, places) == 0 + 12 + (2 + 12 + 4) + 14 + 14


def test_the_disk_probe_reads_and_writes_at_once(tmp_path):
    from tierd.bench.nvme import MiB, mixed_probe
    got = mixed_probe(tmp_path, 16 * MiB)
    assert got["bytes"] == 16 * MiB
    for key in ("write_GBps", "read_GBps", "mixed_read_GBps", "mixed_write_GBps",
                "mixed_each_way_GBps"):
        assert got[key] > 0, key
    # both ways ended within the time the figure is over
    assert got["mixed_each_way_GBps"] <= min(got["mixed_read_GBps"], got["mixed_write_GBps"])
    assert list(tmp_path.iterdir()) == []   # its file is gone
    with pytest.raises(ValueError, match="whole number of"):
        mixed_probe(tmp_path, 12 * MiB + 1)


def test_help_gives_the_past_the_pool_commands(capsys):
    with pytest.raises(SystemExit):
        bigmodel.main(["--help"])
    out = capsys.readouterr().out
    for model in ("L64", "L80"):
        line = next(x for x in out.splitlines() if f"--models {model}" in x)
        args = bigmodel.parse_args(line.split("python -m tierd.bench.bigmodel ")[1].split())
        assert args.systems == ["tierd"] and args.batches["tierd"] == [4]
        assert args.timeout <= args.budget_s <= 560   # one device call: 10 minutes at most
    assert "--compute-ref L8" in out


# ------------------------------------------------------------------ compact optimizer state
def test_tierd_rows_of_each_optimizer_state_sit_side_by_side(tmp_path):
    """One call with two settings: a tierd row each, saying its setting and
    the bytes it keeps per parameter; ``largest`` stays fp32 (like for like
    with the peers), ``largest_tierd`` is per setting."""
    bench(tmp_path, "--tiny", "--systems", "tierd", "--optimizer-state", "fp32,8bit-bf16",
          timeout=400)
    result = json.loads((tmp_path / "bigmodel.json").read_text())
    exact, small = result["rows"]
    tiny = shape_of("tiny")
    assert (exact["optimizer_state"], small["optimizer_state"]) == ("fp32", "8bit-bf16")
    assert exact["error"] is None and small["error"] is None, (exact["error"], small["error"])
    assert exact["bytes_per_param"] == 14.0 and small["bytes_per_param"] < 6.0
    assert "tierd.optim.AdamW(state='8bit', master='bf16')" in small["notes"]
    assert all(math.isfinite(x) for x in small["losses"])
    assert result["largest"] == {"tierd": tiny.params, "fsdp2": None, "deepspeed": None}
    assert result["largest_tierd"] == {"fp32": tiny.params, "8bit-bf16": tiny.params}


def test_rows_without_checkpointing_sit_beside_the_checkpointed_ones(tmp_path):
    """``--checkpointing off`` (compact state's freed memory can hold the
    activations instead of recomputing them): its rows are their own, each
    with its own log, and take a compute floor only from an all-GPU row
    that did not checkpoint either."""
    from tierd.bench import bigmodel_floor
    from tierd.bench.bigmodel_models import build
    assert build(shape_of("tiny"), 32, "cpu", torch.float32).is_gradient_checkpointing
    assert not build(shape_of("tiny"), 32, "cpu", torch.float32, False).is_gradient_checkpointing
    bench(tmp_path, "--tiny", "--systems", "tierd,allgpu")
    bench(tmp_path, "--tiny", "--systems", "tierd,allgpu", "--checkpointing", "off")
    rows = json.loads((tmp_path / "bigmodel.json").read_text())["rows"]
    assert [(r["system"], r["checkpointing"], r["error"]) for r in rows] == [
        ("tierd", True, None), ("allgpu", True, None), ("tierd", False, None),
        ("allgpu", False, None)]
    assert len({r["log"] for r in rows}) == 4
    for r in rows[::2]:
        ref = bigmodel_floor.compute_reference(r, rows)
        assert ref["checkpointing"] == r["checkpointing"]


def test_merge_keys_rows_by_model_system_and_optimizer_state():
    def r(state, error=None, **extra):
        row = {"model": "13B", "system": "tierd", "params": shape_of("13B").params,
               "error": error, **extra}
        return row if state is None else {**row, "optimizer_state": state}
    old = {"commit": "a", "device": "H200", "rows": [r(None, tokens_per_s=1.0)]}   # before
    merged = bigmodel_results.merge(old, [r("8bit-bf16", tokens_per_s=2.0)], "b")
    assert [(x.get("optimizer_state"), x["tokens_per_s"]) for x in merged["rows"]] == [
        (None, 1.0), ("8bit-bf16", 2.0)]
    merged = bigmodel_results.merge(merged, [r("fp32", tokens_per_s=3.0),
                                             r("8bit", "killed")], "c")
    assert [(x["optimizer_state"], x["tokens_per_s"] if x["error"] is None else x["error"])
            for x in merged["rows"]] == [("fp32", 3.0), ("8bit-bf16", 2.0), ("8bit", "killed")]
    big = {**r("8bit-bf16"), "model": "L156", "params": shape_of("L156").params}
    merged = bigmodel_results.merge(merged, [big], "d")
    assert merged["largest"]["tierd"] == shape_of("13B").params   # fp32 rows only
    assert merged["largest_tierd"] == {"fp32": shape_of("13B").params,
                                       "8bit-bf16": shape_of("L156").params, "8bit": None}


def test_compute_references_at_two_batches_both_stay_and_give_each_row_its_floor():
    """An all-GPU reference at B=1 after one at B=4 (an L156 row at B=1 beside
    an L80 row at B=4) keeps both: each tierd row's compute is its batch's."""
    def ref(batch, step_s):
        return {"model": "L8", "system": "allgpu", "error": None, "step_s": step_s,
                "batch": batch, **bigmodel_results._base("L8", "allgpu", 2048, "fp32")}
    def tierd(model, batch):
        return {"model": model, "system": "tierd", "error": None, "step_s": 9.0,
                "batch": batch, **bigmodel_results._base(model, "tierd", 2048, "8bit-bf16")}
    old = {"commit": "a", "device": "H200", "rows": [ref(4, 0.33), tierd("L80", 4)]}
    merged = bigmodel_results.merge(old, [ref(1, 0.11), tierd("L156", 1)], "b")
    assert [(x["model"], x["batch"]) for x in merged["rows"]] == [
        ("L8", 4), ("L80", 4), ("L8", 1), ("L156", 1)]
    rows = {x["model"]: x for x in merged["rows"]}
    for model, step_s in (("L80", 0.33), ("L156", 0.11)):
        per_token = rows[model]["flops_per_token"] / rows["L8"]["flops_per_token"]
        assert rows[model]["compute_s"] == pytest.approx(step_s * per_token)
    again = bigmodel_results.merge(merged, [ref(4, 0.30)], "c")   # the same batch replaces
    assert [x["step_s"] for x in again["rows"] if x["system"] == "allgpu"] == [0.30, 0.11]


def test_the_optimizer_state_is_tierds_and_one_of_the_compact_settings(tmp_path, capsys):
    for flags, says in ((["--optimizer-state", "int4"], "unknown ['int4']"),
                        (["--systems", "fsdp2", "--optimizer-state", "8bit"], "tierd's")):
        with pytest.raises(SystemExit) as exc:
            bigmodel.main(["--out", str(tmp_path / "out"), *flags])
        assert exc.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(ValueError, match="runs its own fp32 AdamW"):
        RunSpec(system="deepspeed", model="8B", batch=1, seq=8, warmup=0, steps=1,
                device="cpu", optimizer_state="8bit")
    # the peers of a call keep fp32 while tierd runs each setting asked for
    args = bigmodel.parse_args(["--out", str(tmp_path), "--optimizer-state", "8bit,bf16"])
    assert bigmodel.states("tierd", args) == ["8bit", "bf16"]
    assert bigmodel.states("fsdp2", args) == ["fp32"]


def test_the_compact_device_commands_fit_one_call_each():
    doc = bigmodel.__doc__
    text = doc[doc.index("Compact optimizer state"):doc.index("Each tierd row says")]
    lines = text.replace("\\\n", " ").splitlines()
    commands = [line.split("python -m tierd.bench.bigmodel ")[1].split("#")[0].split()
                for line in lines if "python -m tierd.bench.bigmodel " in line]
    calls = [bigmodel.parse_args(c) for c in commands]
    rows = [c for c in calls if c.systems == ["tierd"]]
    refs = [c for c in calls if c.systems == ["allgpu"]]
    speed, largest, unrecomputed = rows
    assert not unrecomputed.checkpointing and unrecomputed.models == speed.models
    assert set(unrecomputed.optimizer_states) == set(speed.optimizer_states)
    # each row's compute floor: an all-GPU model of its width at its batch, checkpointed
    # as it is
    assert [(shape_of(r.models[0]).hidden, r.batches["allgpu"], r.checkpointing)
            for r in refs] == [(shape_of(row.models[0]).hidden, row.batches["tierd"],
                                row.checkpointing) for row in (speed, largest, unrecomputed)]
    assert all(r.timeout <= 90 for r in refs)
    assert speed.models == ["13B"] and speed.optimizer_states == ["fp32", "8bit-bf16"]
    assert largest.optimizer_states == ["8bit-bf16"]
    assert shape_of(largest.models[0]).params >= 35e9
    for args in rows:
        assert args.budget_s <= 540   # under 9 minutes
        # every attempt of the call starts within the budget
        assert len(args.models) * len(args.optimizer_states) * args.timeout <= args.budget_s
