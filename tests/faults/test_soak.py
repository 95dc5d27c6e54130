"""Soak (opt-in: ``pytest -m slow tests/faults/test_soak.py -s``): 8 clients x 32
requests in flight over a pool kept full, random sizes 4 KiB - 64 MiB, random
put/get/evict/delete checked against an in-memory model of what each key holds.
No mismatch, no deadlock, daemon memory stable."""

from __future__ import annotations

import asyncio
import math
import os
import random
import time

import pytest
import torch

import tierd
from tests.faults import harness

CLIENTS, IN_FLIGHT = 8, 32
SECONDS = float(os.environ.get("TIERD_SOAK_SECONDS", 120))
MIN_SIZE, MAX_SIZE = 4 << 10, 64 << 20


def payload(seed: int, n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(seed))


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):   # private memory; the pool is shared
                return int(line.split()[1]) << 10
    return 0


class Stats:
    def __init__(self) -> None:
        self.ops = self.bytes_checked = self.capacity = 0


async def worker(c: tierd.AsyncClient, key: str, rng: random.Random, stop: float,
                 stats: Stats) -> None:
    model: tuple[int, int] | None = None    # (seed, size) the key must hold
    while time.monotonic() < stop:
        op = rng.random()
        if op < 0.4 or model is None:
            size = int(math.exp(rng.uniform(math.log(MIN_SIZE), math.log(MAX_SIZE))))
            seed = rng.getrandbits(32)
            try:
                await c.put(key, payload(seed, size))
                model = (seed, size)
            except tierd.CapacityError:
                stats.capacity += 1          # refused whole: the old value stays
                await asyncio.sleep(0.01)
        elif op < 0.75:
            try:
                got = await c.get(key)
            except tierd.CapacityError:      # every slot leased by the other requests:
                stats.capacity += 1          # the daemon refuses rather than queues
                await asyncio.sleep(0.01)
                continue
            assert torch.equal(got, payload(*model)), f"{key}: bytes differ from the model"
            stats.bytes_checked += model[1]
        elif op < 0.9:
            await c.evict([key])
        else:
            await c.delete([key])
            model = None
            with pytest.raises(KeyError):
                await c.get(key)
        stats.ops += 1


async def soak(d: harness.Daemon, seed: int) -> tuple[Stats, list[int]]:
    clients = [await tierd.aconnect(d.socket, job=f"soak{i}") for i in range(CLIENTS)]
    stats, rng = Stats(), random.Random(seed)
    stop = time.monotonic() + SECONDS
    memory: list[int] = []

    async def sample() -> None:
        while time.monotonic() < stop:
            memory.append(rss(d.process.pid))
            await asyncio.sleep(1)

    try:
        await asyncio.wait_for(asyncio.gather(sample(), *(
            worker(c, f"t{j}", random.Random(rng.getrandbits(32)), stop, stats)
            for c in clients for j in range(IN_FLIGHT))), SECONDS + 300)
    finally:
        for c in clients:
            await c.close()
    return stats, memory


@pytest.mark.slow
def test_soak_against_a_model(tmp_path):
    d = harness.start(tmp_path, pool="1GiB", nvme_size="6GiB")
    try:
        stats, memory = asyncio.run(soak(d, 6))
        assert d.alive()
        with d.connect() as c:
            final = c.stats()
    finally:
        d.stop()
    half = memory[len(memory) // 2]
    print(f"\nsoak: {stats.ops} ops in {SECONDS:.0f} s, {stats.bytes_checked / 2**30:.1f} GiB "
          f"checked, {stats.capacity} capacity refusals, {final['evictions']} evictions, "
          f"{final['bytes_to_nvme'] / 2**30:.1f} GiB to NVMe, {final['bytes_to_pool'] / 2**30:.1f} "
          f"GiB to pool; daemon private RSS {memory[0] >> 20} -> {half >> 20} -> {memory[-1] >> 20} MiB")
    assert stats.ops > CLIENTS * IN_FLIGHT
    assert memory[-1] <= half * 1.2 + (64 << 20), "daemon memory kept growing"
