"""Capacity: the embedded daemon sized from the model and the machine; attach
and tierd.optim fail before storing anything, naming sizes that work."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import tierd
import tierd.optim
from tierd.client import embedded
from tierd.client.attach import attach, detach, session_of
from tierd.client.attached import is_attached
from tierd.client.attach_config import AttachConfig, check_cap
from tierd.client.capacity import (
    GiB, MiB, DaemonRoom, Machine, Sizes, Sizing, StoreNeed, embedded_sizes, model_need,
    record_bytes, shortfall, slack, unsized_defaults)
from tierd.client.keys import ModelKeys
from tierd.client.store import LocalStore
from tierd.config import parse_size
from tierd.errors import CapacityError

# an 8B model in bf16 with AdamW (issue figures): 2 + 4 + 8 + 4 B per parameter
EIGHT_B = StoreNeed(params=16 * 10**9, master=32 * 10**9, optimizer=64 * 10**9,
                    gradients=32 * 10**9, largest=1_050_000_000, assumed_optimizer=True)
GPU_BOX = Machine(available_ram=120 * GiB, free_disk=60 * GiB)   # 128 GiB RAM, 64 GiB disk


def _mlp(width: int = 512, depth: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def _holds(room: DaemonRoom, need: StoreNeed) -> bool:
    return room.holds(need) and room.free(need.largest) >= need.total


# ---------------------------------------------------------------- sizing
def test_small_model_gets_the_usual_pool_and_a_small_nvme_file():
    need = StoreNeed(params=4 * MiB, gradients=4 * MiB, optimizer=8 * MiB, largest=MiB)
    sizes = embedded_sizes(need, Machine(available_ram=20 * GiB, free_disk=500 * GiB))
    assert sizes.pool == 10 * GiB                  # half the RAM (up to 32 GiB), as always
    assert sizes.nvme_size == GiB                  # not half the disk: starts quickly
    # a daemon started for no model (a benchmark's) keeps the old generous sizes
    assert unsized_defaults(Machine(available_ram=20 * GiB, free_disk=600 * GiB)) == \
        Sizes(10 * GiB, 256 * GiB)


def test_eight_b_on_the_gpu_box_spills_what_ram_cannot_hold_to_nvme():
    sizes = embedded_sizes(EIGHT_B, GPU_BOX)
    assert sizes.pool == GPU_BOX.pool_limit == 102 * GiB     # 15 % of the RAM kept
    spill = EIGHT_B.total + EIGHT_B.largest - sizes.pool
    # the spill (free bytes hold records however fragmented), as much again for
    # the copies of what is read back, and slack, within the disk
    assert sizes.nvme_size == min(GPU_BOX.nvme_limit, 2 * spill + slack(EIGHT_B))
    assert 0 < sizes.nvme_size <= GPU_BOX.nvme_limit == 56 * GiB
    assert _holds(DaemonRoom(pool=sizes.pool, nvme=sizes.nvme_size), EIGHT_B)
    # built in bf16 on the CPU: 16 GB less available now, given back by attach
    built = Machine(available_ram=GPU_BOX.available_ram - 16 * 10**9, free_disk=60 * GiB,
                    released=16 * 10**9)
    assert embedded_sizes(EIGHT_B, built) == sizes


def test_a_model_larger_than_the_pool_gets_nvme_for_copies_of_what_it_reads_back():
    roomy = Machine(available_ram=GPU_BOX.available_ram, free_disk=500 * GiB)
    sizes = embedded_sizes(EIGHT_B, roomy)
    spill = EIGHT_B.total + EIGHT_B.largest - sizes.pool
    assert spill > 0 and sizes.nvme_size == 2 * spill + slack(EIGHT_B)


def test_named_job_gets_commit_room_within_the_disk():
    need = StoreNeed(params=GiB, gradients=GiB, optimizer=2 * GiB, largest=64 * MiB)
    machine = Machine(available_ram=64 * GiB, free_disk=100 * GiB)
    plain = embedded_sizes(need, machine)
    named = embedded_sizes(need, machine, commits=True)
    assert plain.nvme_size == GiB and named.nvme_size >= 2 * need.total + need.largest
    small_disk = Machine(available_ram=64 * GiB, free_disk=6 * GiB)
    assert embedded_sizes(need, small_disk, commits=True).nvme_size == 3 * GiB   # half kept


def test_given_sizes_win_and_small_machines_keep_half():
    sizes = embedded_sizes(EIGHT_B, GPU_BOX, pool=GiB, nvme_size=2 * GiB)
    assert (sizes.pool, sizes.nvme_size) == (GiB, 2 * GiB)
    tiny = Machine(available_ram=6 * GiB, free_disk=6 * GiB)
    assert (tiny.pool_limit, tiny.nvme_limit) == (3 * GiB, 3 * GiB)


def test_record_overhead_is_counted():
    need = StoreNeed.of([("params", "a", 10), ("gradients", "b", 8192)], job="j")
    assert (need.params, need.gradients) == (8192, 12288)   # header page + data pages
    assert need.largest == 12288 == record_bytes("b", 8192, "j")
    assert StoreNeed.of([("params", "a", 10)], existing={"a"}).total == 0
    with pytest.raises(ValueError, match="kind 'moments'"):
        StoreNeed.of([("moments", "a", 10)])


# ---------------------------------------------------------------- the error text
def _flag(text: str, name: str) -> int:
    return parse_size(re.search(rf"{name}[ =](\d+[GM]iB)", text).group(1))


def test_user_daemon_error_names_serve_sizes_that_hold_it():
    room = DaemonRoom(pool=64 * GiB, nvme=32 * GiB, stored=3 * GiB, largest=100 * MiB,
                      tensors=40, sessions=2)
    text = shortfall(EIGHT_B, room, what="Llama", daemon="the daemon at /run/t.sock")
    assert "parameters 14.9 GiB + fp32 masters 29.8 GiB + optimizer state 59.6 GiB" in text
    assert "AdamW's two moments assumed" in text and "requires_grad_(False)" in text
    bigger = DaemonRoom(pool=_flag(text, "--pool"), nvme=_flag(text, "--nvme-size"),
                        stored=room.stored, largest=room.largest, tensors=40)
    assert _holds(bigger, EIGHT_B)
    assert shortfall(EIGHT_B, bigger, what="x", daemon="y") is None


def test_embedded_error_names_a_disk_that_would_hold_it():
    machine = Machine(available_ram=100 * GiB, free_disk=20 * GiB, nvme_dir="/cache/tierd")
    sizes = embedded_sizes(EIGHT_B, machine)
    text = shortfall(EIGHT_B, DaemonRoom(pool=sizes.pool, nvme=sizes.nvme_size),
                     what="Llama", daemon="the embedded daemon",
                     sizing=Sizing(machine, sizes))
    assert "TIERD_NVME" in text and "/cache/tierd" in text and "tierd serve" in text
    free = float(re.search(r"disk with at least ([\d.]+) GiB free", text).group(1))
    roomier = Machine(available_ram=100 * GiB, free_disk=int(free * GiB) + GiB)
    again = embedded_sizes(EIGHT_B, roomier)
    assert _holds(DaemonRoom(pool=again.pool, nvme=again.nvme_size), EIGHT_B)


# ---------------------------------------------------------------- attach and optim
def test_attach_too_big_for_the_daemon_stores_nothing_and_leaves_the_model(daemon_factory):
    daemon = daemon_factory(pool="4MiB", nvme_size="4MiB")   # training it needs ~12 MiB
    model = _mlp()
    params = list(model.parameters())
    before = copy.deepcopy(model.state_dict())
    client = tierd.connect(daemon)
    with pytest.raises(CapacityError) as err:
        attach(model, client=client)
    text = str(err.value)
    assert "cannot hold Sequential (787,968 parameters)" in text and "--nvme-size" in text
    assert client.stats()["tensors"] == 0 and client.stats()["stored_bytes"] == 0
    assert not is_attached(model) and list(model.parameters()) == params
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    x = torch.randn(2, 512)
    assert torch.equal(model(x), torch.func.functional_call(model, before, (x,)))
    # the model used for inference only needs its parameters
    frozen = attach(_mlp().requires_grad_(False), client=client)
    detach(frozen)
    client.close()
    # the sizes the error names hold it
    fits = daemon_factory(pool=f"{_flag(text, '--pool')}B",
                          nvme_size=f"{_flag(text, '--nvme-size')}B")
    detach(attach(model, client=tierd.connect(fits)))


def test_optimizer_checks_its_state_before_writing_any(daemon_factory):
    daemon = daemon_factory(pool="64MiB", nvme_size="64MiB")
    model = attach(_mlp(), client=tierd.connect(daemon))   # stores ~3 MiB of 64 + 64
    filler = tierd.connect(daemon, job="filler")
    for i in range(7):   # 105 MiB more: 5 MiB stay free, AdamW adds 9 MiB (SGD 3)
        filler.put(f"x{i}", torch.empty(15 * MiB, dtype=torch.uint8))
    client = session_of(model).client
    stored = client.stats()["stored_bytes"]
    with pytest.raises(CapacityError,
                       match=r"cannot hold AdamW's state and the gradients of 6 parameters"):
        tierd.optim.AdamW(model.parameters(), lr=1e-3)
    assert client.stats()["stored_bytes"] == stored
    assert client.keys(session_of(model).keys.all + "optim/") == []
    sgd = tierd.optim.SGD(model.parameters(), lr=0.1)   # adds only the gradients
    model(torch.randn(2, 512)).sum().backward()
    sgd.step()
    filler.delete("x0")
    tierd.optim.AdamW(model.parameters(), lr=1e-3)   # now it fits
    filler.close()
    detach(model)


# ---------------------------------------------------------------- the embedded daemon
@pytest.fixture
def own_embedded(monkeypatch, tmp_path):
    """A fresh embedded-daemon holder on a small made-up machine (1 GiB RAM)."""
    fresh = embedded._Embedded()
    monkeypatch.setattr(embedded, "_EMBEDDED", fresh)
    monkeypatch.setattr(embedded, "available_memory", lambda: GiB)
    monkeypatch.delenv("TIERD_SOCKET", raising=False)   # no socket configured and
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))   # no daemon at the default
    monkeypatch.setenv("TIERD_NVME", str(tmp_path / "nvme"))
    for var in ("TIERD_POOL", "TIERD_NVME_SIZE"):
        monkeypatch.delenv(var, raising=False)
    yield fresh
    fresh.stop()


def _stats(socket) -> dict:
    with tierd.connect(socket) as c:
        return c.stats()


def test_embedded_daemon_restarts_larger_only_when_it_holds_nothing(own_embedded, tmp_path):
    small = StoreNeed(params=MiB, largest=MiB)
    first = embedded.ensure_daemon(need=small)
    assert _stats(first)["pool_bytes"] == 512 * MiB and _stats(first)["nvme_bytes"] == GiB
    assert own_embedded.daemon.nvme.parent == tmp_path / "nvme"
    big = StoreNeed(params=GiB, gradients=GiB // 2, largest=64 * MiB)
    busy = tierd.connect(first)
    busy.put("w", torch.ones(1000))
    assert embedded.ensure_daemon(need=big) == first          # serves a client: kept
    text = embedded.room_problem(busy, big, "Big")
    assert "embedded daemon" in text and "detach that model first" in text
    assert str(tmp_path / "nvme") in text and "tierd serve --nvme DIR" in text
    busy.close()
    second = embedded.ensure_daemon(need=big)                  # idle now: started again
    assert second != first and not first.exists()
    stats = _stats(second)
    assert stats["pool_bytes"] == 512 * MiB and stats["nvme_bytes"] > GiB   # the rest on disk
    assert DaemonRoom.from_stats(stats).holds(big)


def test_tierd_pool_wins_over_the_model(own_embedded, monkeypatch):
    monkeypatch.setenv("TIERD_POOL", "96MiB")
    sock = embedded.ensure_daemon(need=StoreNeed(params=GiB, largest=MiB))
    assert _stats(sock)["pool_bytes"] == 96 * MiB
    assert own_embedded.daemon.sizing.pool_from == "TIERD_POOL"
    monkeypatch.setenv("TIERD_POOL", "lots")
    with pytest.raises(ValueError, match="TIERD_POOL='lots'"):
        embedded.start_daemon(need=StoreNeed())


def test_attach_sizes_the_embedded_daemon_and_restarts_it_when_idle(own_embedded, monkeypatch):
    monkeypatch.setattr(embedded, "available_memory", lambda: 64 * MiB)   # pool: 32 MiB
    monkeypatch.setenv("TIERD_NVME_SIZE", "16MiB")
    small = attach(_mlp(width=64, depth=1))            # no client: the embedded daemon
    first = own_embedded.daemon
    machine = first.sizing.machine
    assert machine.released == (64 * 64 + 64) * 4   # the CPU parameters attach frees
    assert first.sizing.sizes.pool == machine.pool_limit == (64 * MiB + machine.released) // 2
    assert first.sizing.sizes.nvme_size == 16 * MiB
    assert first.sizing.nvme_from == "TIERD_NVME_SIZE" and first.sizing.pool_from == ""
    detach(small)
    big = _mlp(width=1024, depth=6)                     # training it stores ~75 MB
    params = list(big.parameters())
    with pytest.raises(CapacityError) as err:
        attach(big)
    again = own_embedded.daemon
    assert again is not first and first.process.poll() is not None   # idle: started again
    assert "the embedded daemon" in str(err.value) and "TIERD_NVME_SIZE" in str(err.value)
    assert _stats(again.socket)["tensors"] == 0 and list(big.parameters()) == params


def test_gradients_count_after_the_first_step_only_where_they_stay():
    fused = StoreNeed(params=16, master=32, optimizer=64, gradients=32, device=40)
    kept = StoreNeed(params=16, master=32, optimizer=64, gradients=32, device=40,
                     gradients_kept=True)
    assert fused.first_step == kept.first_step == 80
    assert fused.total == max(80, 112 - 40) == 80      # freed as the first update uses them
    assert kept.total == 144 - 40                      # clipping, accumulation, CPU updates
    assert "freed as the update uses them" not in kept.describe()


# ---------------------------------------------------------------- frozen parameters
def _frozen_base(depth: int = 4) -> torch.nn.Sequential:
    """A frozen base (LoRA's shape of training) under a trainable last layer."""
    model = _mlp(width=64, depth=depth)
    for layer in model[:-1]:
        layer.requires_grad_(False)
    return model


def test_frozen_parameters_need_their_compute_copy_only():
    """[Note: frozen parameters]: what attach sizes the store for."""
    keys = ModelKeys.for_name("m")
    model = _frozen_base()
    need = model_need(model, torch.bfloat16, keys)
    named = list(model.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    assert 0 < len(trainable) < len(named)
    assert need.params == sum(record_bytes(keys.param(n), 2 * p.numel()) for n, p in named)
    assert need.master == sum(record_bytes(keys.master(n), 4 * p.numel()) for n, p in trainable)
    assert need.gradients == sum(record_bytes(keys.grad(n), 4 * p.numel())
                                 for n, p in trainable)
    assert need.optimizer == sum(record_bytes(keys.state(s, n), 4 * p.numel())
                                 for n, p in trainable for s in ("exp_avg", "exp_avg_sq"))


def test_a_frozen_unit_needs_its_compute_copy_on_the_device_only():
    model = _mlp(width=64, depth=2).requires_grad_(False)
    unit = 2 * sum(p.numel() for p in model[0].parameters())   # bf16, no optimizer state
    check_cap(model, AttachConfig(compute_dtype="bf16", gpu_memory_bytes=unit), unit)
    with pytest.raises(ValueError, match=f"{unit} bytes"):
        check_cap(model, AttachConfig(compute_dtype="bf16", gpu_memory_bytes=unit), unit - 1)


def test_training_a_frozen_base_stores_nothing_but_its_compute_copy():
    model = attach(_frozen_base(), client=LocalStore(), device="cpu", compute_dtype="bf16")
    opt = tierd.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                            accumulation_steps=2)   # gradients kept in the store
    for i in range(4):
        model(torch.randn(2, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    session = session_of(model)
    frozen = [tp for tp in session.params.values() if not tp.param.requires_grad]
    stored = set(session.client.keys(session.keys.all))
    for tp in session.params.values():
        held = {k for k in stored if k.endswith("/" + tp.name)}
        if tp in frozen:   # no master, gradient or moments
            assert held == {tp.key}, held
        else:
            assert {tp.master_key, tp.grad_key} <= held and len(held) >= 5, held
    values = session.read([tp.key for tp in frozen])
    assert all(values[tp.key].dtype == torch.bfloat16 for tp in frozen)
    # placement counts a frozen unit at its compute copy: no state, no gradient
    for unit in session.placer.unit_bytes():
        members = session.registry.members(session.units[unit.index])
        if all(tp in frozen for tp in members):
            compute = sum(2 * tp.param.numel() for tp in members)
            assert (unit.param_bytes, unit.state_bytes, unit.grad_bytes) == (compute, 0, 0)
            assert unit.stored_bytes == compute
    assert not any(tp in frozen for tp in opt._owned())
