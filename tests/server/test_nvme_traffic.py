"""NVMe traffic of a job whose state exceeds the pool: each byte beyond the
pool crosses at most once each way per step ([Note: eviction by next use],
[Note: cold tensors go first] in tierd.server.eviction).

A real daemon; the steps are what ``tierd.optim`` asks of it for streamed
state: lease a bucket's keys for writing, change them, release them as
written, demote them. Besides the state, the store holds tensors a step
never reads (the compute copies of units whose weights the GPU keeps).
"""

from __future__ import annotations

import asyncio
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tierd
from tierd.backends import recordio
from tierd.backends.nvme import NvmeStore
from tierd.server.transfers import RecordTransfers

KiB, MiB = 1 << 10, 1 << 20
POOL = 8 * MiB


def _steps(c, state: list[str], bucket: int, steps: int) -> list[tuple[int, int]]:
    """(bytes read from NVMe, bytes written to it) per step."""
    out = []
    for _ in range(steps):
        before = c.stats()
        for i in range(0, len(state), bucket):
            keys = state[i:i + bucket]
            for leased in c.lease(keys, write=True):
                leased.tensor.add_(1)
            c.release(keys, written=True)
            c.demote_async(keys)
        after = c.stats()
        out.append((after["bytes_to_pool"] - before["bytes_to_pool"],
                    after["bytes_to_nvme"] - before["bytes_to_nvme"]))
    return out


@pytest.mark.parametrize("key_bytes,bucket", [(256 * KiB, 3), (1 * MiB, 1)],
                         ids=["small-keys", "segment-sized-keys"])
def test_state_beyond_the_pool_crosses_once_each_way_per_step(daemon_factory, key_bytes,
                                                               bucket):
    # segment-sized keys (over an eighth of a segment) are evicted a segment at a time
    d = daemon_factory(pool="8MiB", nvme_size="96MiB", extra=("--segment-size", "4MiB"))
    state = [f"state/{i:03d}" for i in range(12 * MiB // key_bytes)]    # 1.5x the pool
    unread = [f"weights/{i:03d}" for i in range(3 * MiB // key_bytes)]  # never read again
    steps = 6
    with tierd.connect(d.socket) as c:
        for k in unread + state:
            c.put(k, torch.zeros(key_bytes // 4))
        for k in unread:   # read once (a first step that streamed everything), then never
            c.lease([k])
            c.release([k])
        per_step = _steps(c, state, bucket, steps)
        for k in state:
            assert torch.equal(c.get(k), torch.full((key_bytes // 4,), float(steps))), k
        for k in unread:
            assert torch.equal(c.get(k), torch.zeros(key_bytes // 4)), k
    beyond = len(state) * key_bytes - POOL
    # the bytes a lease pins while it is served: one bucket of room the cycle cannot use
    slack = bucket * key_bytes
    for read, written in per_step[-2:]:   # the unread tensors have left the pool by now
        assert beyond <= read <= beyond + slack, (per_step, beyond)
        assert beyond <= written <= beyond + slack, (per_step, beyond)



class HeldWrites(NvmeStore):
    """A store whose writes wait until ``go`` is set: a disk busy writing."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.writing = 0
        self._count = threading.Lock()

    def write_from(self, offset: int, bufs: list) -> None:
        with self._count:
            self.writing += 1
        self.go.wait(30)
        super().write_from(offset, bufs)


def test_a_read_does_not_wait_behind_a_large_write(tmp_path):
    """[Note: reads beside writes] in tierd.server.transfers: with a record of
    many pieces being written, a read asked for after it still gets a thread."""
    store = HeldWrites(tmp_path, 128 << 20)
    io, sums = ThreadPoolExecutor(4), ThreadPoolExecutor(1)
    rt = RecordTransfers(store, io, sums)
    small = recordio.RecordMeta("small", "job", "uint8", (4096,), 4096, 1)
    big = recordio.RecordMeta("big", "job", "uint8", (12 * recordio.CHUNK,),
                              12 * recordio.CHUNK, 1)   # 12 pieces, more than the threads
    small_at = store.extents.alloc_spans(small.record_len())
    big_at = store.extents.alloc_spans(big.record_len())
    src, back, data = mmap.mmap(-1, 4096), mmap.mmap(-1, 4096), mmap.mmap(-1, big.nbytes)
    src[:] = bytes(range(256)) * 16
    store.go.set()
    store.write_record(small_at, small, memoryview(src))   # on disk before the test
    store.go.clear()
    store.writing = 0

    async def go():
        write = asyncio.create_task(rt.write(big_at, big, memoryview(data)))
        await asyncio.sleep(0.2)             # the write's pieces are queued and held
        await asyncio.wait_for(rt.read(small_at, small, memoryview(back)), 20)
        assert not write.done()              # the read went past the held write
        held = store.writing
        store.go.set()
        await write
        return held

    try:
        held = asyncio.run(go())
    finally:
        store.go.set()
        io.shutdown()
        sums.shutdown()
        store.close()
    assert held == 3       # every thread but one was writing
    assert back[:] == src[:]


def test_training_past_the_pool_moves_what_does_not_fit_once_each_way(daemon_factory):
    """The same through tierd.attach and tierd.optim (on the CPU, with a
    device cap that keeps some units' weights there while their state
    streams): the compute copies those units never read again leave the
    pool, so after a few steps only the state that does not fit crosses NVMe,
    besides the buckets fetched ahead (the optimizer's prefetch window)."""
    from tierd.bench import bigmodel_floor
    from tierd.bench.bigmodel_models import Shape, build
    from tierd.client.attach import session_of
    import tierd.optim

    d = daemon_factory(pool="32MiB", nvme_size="512MiB", extra=("--segment-size", "4MiB"))
    shape = Shape(hidden=256, intermediate=512, layers=8, heads=4, kv_heads=2, vocab=1024)
    model = tierd.attach(build(shape, 32, "cpu", torch.bfloat16), client=tierd.connect(d),
                         device="cpu", compute_dtype="bf16", gpu_memory_bytes=40 * MiB)
    window = 1 * MiB
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-4, prefetch_bytes=window)
    session = session_of(model)
    ids = torch.randint(0, shape.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    per_step = []
    for _ in range(14):
        before = bigmodel_floor.traffic(session)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = bigmodel_floor.traffic(session)
        per_step.append({k: after[k] - before[k] for k in after})
        assert torch.isfinite(loss)
    plan = bigmodel_floor.plan_bytes(session)
    places = {p.value for p in session.placer.plan.places.values()}
    assert "weights" in places   # units whose compute copies the store keeps unread
    beyond = bigmodel_floor.must_cross(plan["step_store_bytes"], plan["pool_bytes"])
    assert beyond > 0, plan
    # at most two windows of buckets fetched ahead, and one bucket, above it,
    # over the last steps (a step's figure moves by a MB or two as the pool's
    # layout shifts: 2.1-4.6 MB over steps 6-11 here; the layout the first
    # update leaves, where it writes the measuring step's held gradients,
    # settles by step 11: 3.3-5.9 MB over steps 6-10, 1.6-3.1 over 11-24)
    slack = 3 * window
    for kind in ("nvme_read_bytes", "nvme_write_bytes"):
        last = [step[kind] for step in per_step[-4:]]
        assert sum(last) / len(last) <= beyond + slack, (kind, per_step, beyond)
