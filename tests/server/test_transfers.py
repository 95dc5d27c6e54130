"""NVMe records moved with the sums on their own threads (see the Note in
tierd.server.transfers): bytes come back exact, damage in any piece or the
header is found, a failed write leaves nothing readable, and a real daemon
keeps every value under concurrent spills and fetches. Each runs on records
in one extent and on records scattered over many (see the Note on records in
several extents in tierd.backends.recordio)."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tierd
from tierd.backends import recordio
from tierd.backends.nvme import DATA_FILE, Failpoints, NvmeStore
from tierd.errors import IntegrityError, TierIOError
from tierd.server.transfers import BusyClock, RecordTransfers, checksum_threads

CHUNK = recordio.CHUNK
SIZES = (2 * CHUNK + 12 * 1024, 4096, CHUNK)   # three pieces (the last short), one page, one piece


def meta_of(i: int, nbytes: int) -> recordio.RecordMeta:
    return recordio.RecordMeta(f"k{i}", "job", "uint8", (nbytes,), nbytes, 1)


def fragment(extents, hole: int) -> None:
    """Leave only holes of ``hole`` bytes free, every other one, so no record
    larger than that has one extent (as a file after many spills)."""
    taken = [extents.alloc(hole) for _ in range(extents.size // hole)]
    for off in taken[::2]:
        extents.free(off)


def file_offset(spans, pos: int) -> int:
    """Where byte ``pos`` of a record lies in the data file."""
    scatter = recordio.Scatter(spans)
    try:
        return scatter.runs(pos, [b"x"])[0][0]
    finally:
        scatter.release()


class Records:
    """A store on a temp dir, its transfers, and aligned buffers of random
    bytes; ``scattered``: the records lie in many extents of 1 MiB + 4 KiB."""

    def __init__(self, directory, failpoints: Failpoints | None = None,
                 scattered: bool = False) -> None:
        self.store = NvmeStore(directory, 64 << 20, failpoints=failpoints)
        self.io = ThreadPoolExecutor(4)
        self.sums = ThreadPoolExecutor(2)
        self.rt = RecordTransfers(self.store, self.io, self.sums)
        self.metas = [meta_of(i, n) for i, n in enumerate(SIZES)]
        if scattered:
            fragment(self.store.extents, (1 << 20) + 4096)
        self.spans = [self.store.extents.alloc_spans(m.record_len()) for m in self.metas]
        assert (len(self.spans[0]) > 1) == scattered
        self.data = [self.buffer(n, fill=True) for n in SIZES]

    @staticmethod
    def buffer(nbytes: int, fill: bool = False) -> mmap.mmap:
        buf = mmap.mmap(-1, recordio.align_up(nbytes))   # page aligned, as pool slots are
        if fill:
            buf[:nbytes] = random.Random(nbytes).randbytes(nbytes)
        return buf

    def write_all(self) -> None:
        async def go():
            await asyncio.gather(*(self.rt.write(o, m, memoryview(d)[:m.nbytes])
                                   for o, m, d in zip(self.spans, self.metas, self.data)))
        asyncio.run(go())

    def read(self, i: int) -> bytes:
        out = self.buffer(self.metas[i].nbytes)
        view = memoryview(out)[:self.metas[i].nbytes]
        try:
            asyncio.run(self.rt.read(self.spans[i], self.metas[i], view))
            return bytes(view)
        finally:
            view.release()
            out.close()

    def damage(self, offset: int) -> None:
        fd = os.open(self.store.path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x01]), offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.io.shutdown()
        self.sums.shutdown()
        self.store.close()


@pytest.fixture(params=["one extent", "scattered"])
def records(tmp_path, request):
    r = Records(tmp_path, scattered=request.param == "scattered")
    yield r
    r.close()


def test_records_of_many_pieces_written_at_once_read_back_exact(records):
    records.write_all()
    for i, m in enumerate(records.metas):
        assert records.read(i) == records.data[i][:m.nbytes]


@pytest.mark.parametrize("piece", [0, 1, 2])
def test_a_flipped_byte_in_any_piece_is_an_integrity_error_naming_its_bytes(records, piece):
    records.write_all()
    at = records.metas[0].header_len() + piece * CHUNK + 777
    records.damage(file_offset(records.spans[0], at))
    end = min((piece + 1) * CHUNK, recordio.align_up(SIZES[0]))
    with pytest.raises(IntegrityError, match=rf"'k0'.*checksum mismatch in bytes "
                                             rf"{piece * CHUNK}-{end}"):
        records.read(0)
    assert records.read(1) == records.data[1][:SIZES[1]]   # the others are untouched


def test_a_flipped_byte_in_the_header_is_an_integrity_error(records):
    records.write_all()
    records.damage(records.spans[2][0][0] + recordio.PREFIX.size + 5)   # inside the meta
    with pytest.raises(IntegrityError, match="'k2'.*damaged"):
        records.read(2)


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("fail_at", ["a data piece", "the header"])
def test_a_failed_write_raises_and_leaves_no_readable_record(tmp_path, fail_at, scattered):
    fp = Failpoints()
    r = Records(tmp_path, failpoints=fp, scattered=scattered)
    try:
        scatter = recordio.Scatter(r.spans[0])
        data_writes = sum(len(scatter.runs(r.metas[0].header_len() + s, [bytes(n)]))
                          for s, n in recordio.pieces_of(SIZES[0]))
        scatter.release()
        fp.arm("write", errno.EIO, after=1 if fail_at == "a data piece" else data_writes)
        with pytest.raises(TierIOError, match="NVMe write"):
            asyncio.run(r.rt.write(r.spans[0], r.metas[0], memoryview(r.data[0])[:SIZES[0]]))
        with pytest.raises(IntegrityError, match="'k0'.*bad magic"):
            r.read(0)
    finally:
        r.close()


def test_the_busy_clock_counts_overlapping_spans_once():
    """[Note: the disk's busy time]: records in flight together are one span
    of busy time, idle time is not counted, an open span counts to now."""
    now = [100.0]
    clock = BusyClock(lambda: now[0])
    with clock:
        now[0] += 2.0
        with clock:          # a second record while the first is in flight
            now[0] += 1.0
        now[0] += 0.5
        assert clock.seconds() == 3.5
    now[0] += 10.0
    assert clock.seconds() == 3.5
    with clock:
        now[0] += 1.0
    assert clock.seconds() == 4.5


def test_records_count_their_busy_time_each_way(records):
    assert records.rt.busy_seconds() == {"nvme_read_busy_s": 0.0, "nvme_write_busy_s": 0.0}
    records.write_all()
    written = records.rt.busy_seconds()
    assert written["nvme_write_busy_s"] > 0 and written["nvme_read_busy_s"] == 0
    records.read(0)
    assert records.rt.busy_seconds()["nvme_read_busy_s"] > 0


def test_a_daemon_reports_the_seconds_its_disk_was_busy_each_way(daemon_factory):
    d = daemon_factory(pool="64MiB", nvme_size="256MiB")
    values = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(4)}   # 4 MiB each
    with tierd.connect(d.socket, job="busy") as c:
        t0 = time.monotonic()
        before = c.stats()
        for k, v in values.items():
            c.put(k, v)
        c.evict(list(values))
        for k, v in values.items():
            assert torch.equal(c.get(k), v)
        after = c.stats()
        wall = time.monotonic() - t0
    read = after["nvme_read_busy_s"] - before["nvme_read_busy_s"]
    written = after["nvme_write_busy_s"] - before["nvme_write_busy_s"]
    assert after["bytes_to_pool"] > before["bytes_to_pool"]
    assert 0 < read <= wall and 0 < written <= wall
    assert 0 < after["catalog_s"] - before["catalog_s"] <= wall   # the loop's own work


def test_checksum_threads_stay_within_the_io_threads_and_at_least_one():
    assert checksum_threads(1) == 1
    assert 1 <= checksum_threads(64) <= max(1, (os.cpu_count() or 2) // 2)


def test_concurrent_spills_and_fetches_keep_every_value(daemon_factory):
    """Three clients of one job evict, prefetch and read keys of their own at
    once, in a pool smaller than all their keys (48 of 66 MiB): records of one
    and two pieces cross in flight both ways, a read may have to wait for the
    others' swap-ins to land, and every read is the value put (on a
    fragmented file: tests/server/test_fragmentation.py)."""
    d = daemon_factory(pool="48MiB", nvme_size="256MiB")
    errors: list[BaseException] = []

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        values = {f"{seed}/big{i}": torch.randint(0, 255, (CHUNK + 2 * 1024 * 1024,), dtype=torch.uint8,
                                           generator=torch.Generator().manual_seed(seed * 10 + i))
                  for i in range(2)}
        values.update({f"{seed}/small{i}": torch.full((64 * 1024,), seed * 100 + i, dtype=torch.int32)
                       for i in range(8)})
        try:
            with tierd.connect(d.socket, job="stress") as c:
                for k, v in values.items():
                    c.put(k, v)
                keys = list(values)
                for _ in range(25):
                    subset = rng.sample(keys, rng.randint(1, 4))
                    match rng.randrange(3):
                        case 0:
                            c.evict(subset)
                        case 1:
                            c.prefetch(subset)
                        case 2:
                            k = rng.choice(keys)
                            assert torch.equal(c.get(k), values[k]), k
                for k, v in values.items():
                    assert torch.equal(c.get(k), v), k
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    with tierd.connect(d.socket, job="stress") as c:
        stats = c.stats()
    assert stats["bytes_to_nvme"] > 0 and stats["bytes_to_pool"] > 0 and stats["io_errors"] == 0
    assert (d.nvme / DATA_FILE).exists()


def test_a_lease_waits_for_prefetched_swap_ins_holding_the_pool(tmp_path):
    """A pool filled by swap-ins a prefetch began is not full: the lease waits
    for them to land, evicts one and reads its own key (it used to be refused
    with CapacityError while they were in flight)."""
    from tierd.backends.hostpool import HostPool
    from tierd.server.catalog import Blocked, Catalog
    from tests.server.test_catalog import put, settle

    mib = 1 << 20
    pool, store = HostPool(8 * mib, segment_size=8 * mib), NvmeStore(tmp_path, 32 * mib)
    cat = Catalog(pool, store)
    try:
        s = cat.open_session(1, "job", pid=10, uid=0)
        for i, key in enumerate("abc"):
            put(cat, s, key, 3 * mib, fill=i + 1)
        settle(cat, cat.evict, s, ("a", "b", "c"))
        cat.prefetch(s, ("a", "b"))          # 6 of 8 MiB filling, transfers not run yet
        result = cat.lease(s, ("c",), False)
        assert isinstance(result, Blocked) and result.wait
        (placed,) = settle(cat, cat.lease, s, ("c",), False)
        view = pool.segments[placed.segment].view(placed.offset, 3 * mib)
        assert bytes(view) == bytes([3]) * (3 * mib)
        view.release()
    finally:
        pool.close()
        store.close()


def test_a_write_cancelled_while_its_threads_still_write_ends_cancelled(records):
    """As at shutdown: the task is cancelled while I/O threads are still inside
    calls on its pieces (here a write into a full pipe); the caller sees
    CancelledError, and the threads finish their calls."""
    r, w = os.pipe()
    inside = threading.Event()
    write_from = records.store.write_from

    def blocking_write(offset, bufs):
        inside.set()
        os.writev(w, bufs)   # blocks, holding the buffers, until the pipe is drained
        write_from(offset, bufs)

    records.store.write_from = blocking_write

    async def go():
        m = records.metas[0]
        task = asyncio.create_task(records.rt.write(records.spans[0], m,
                                                    memoryview(records.data[0])[:m.nbytes]))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    def drain_pipe() -> None:
        while os.read(r, 1 << 20):
            pass

    drain = threading.Thread(target=drain_pipe)
    try:
        asyncio.run(go())
    finally:
        drain.start()
        records.io.shutdown(wait=True)
        os.close(w)
        drain.join(30)
        os.close(r)
