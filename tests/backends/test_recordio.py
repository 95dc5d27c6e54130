"""Records in several extents (see the Note in tierd.backends.recordio): the
I/O cut at span boundaries moves exactly the record's bytes, and a record
written into scattered extents, its header across two of them, reads back
exact and is checked as strictly as one in a single extent."""

from __future__ import annotations

import mmap
import os
import random

import pytest
from hypothesis import given, settings, strategies as st

from tierd.backends import recordio
from tierd.backends.extents import PAGE
from tierd.backends.nvme import NvmeStore
from tierd.errors import IntegrityError


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.randoms(use_true_random=False),
       st.data())
def test_runs_move_exactly_the_record_bytes_asked_for(lengths, rng, data):
    """Spans at shuffled, gapped file offsets; any range of the record, cut
    into any buffers, lands in the right file bytes."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    where, cur = {}, 0
    for k in order:
        cur += rng.randint(0, 5)
        where[k], cur = cur, cur + lengths[k]
    spans = tuple((where[k], n) for k, n in enumerate(lengths))
    record = bytes(rng.randrange(256) for _ in range(sum(lengths)))
    disk = bytearray(cur)
    pos = 0
    for start, n in spans:
        disk[start:start + n] = record[pos:pos + n]
        pos += n
    a = data.draw(st.integers(0, len(record)))
    b = data.draw(st.integers(a, len(record)))
    edges = [a, *sorted(data.draw(st.lists(st.integers(a, b), max_size=3))), b]
    bufs = [bytearray(hi - lo) for lo, hi in zip(edges, edges[1:])]
    scatter = recordio.Scatter(spans)
    for offset, views in scatter.runs(a, bufs):
        for v in views:
            v[:] = disk[offset:offset + len(v)]
            offset += len(v)
    scatter.release()
    assert b"".join(bufs) == record[a:b]
    with pytest.raises(ValueError, match="run past its spans"):
        recordio.Scatter(spans).runs(len(record) - 1, [bytearray(2)])


@pytest.fixture
def store(tmp_path):
    s = NvmeStore(tmp_path, 64 * PAGE)
    yield s
    s.close()


def flip(store: NvmeStore, offset: int) -> None:
    fd = os.open(store.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x08]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_record_with_its_header_across_two_extents_reads_back_and_is_checked(store):
    meta = recordio.RecordMeta("k" * 5000, "job", "uint8", (5 * PAGE,), 5 * PAGE, 2)
    assert meta.header_len() == 2 * PAGE            # a long key: a two-page header
    spans = ((40 * PAGE, PAGE), (10 * PAGE, 3 * PAGE), (20 * PAGE, 3 * PAGE))
    for start, n in spans:
        store.extents.claim(start, n)
    buf, back = mmap.mmap(-1, 5 * PAGE), mmap.mmap(-1, 5 * PAGE)   # page aligned, as the pool
    buf[:] = random.Random(3).randbytes(5 * PAGE)
    data, out = memoryview(buf), memoryview(back)
    store.write_record(spans, meta, data)
    store.read_record(spans, meta, out)
    assert out == data
    with pytest.raises(IntegrityError, match="checksum mismatch"):   # spans out of order
        store.read_record((spans[0], spans[2], spans[1]), meta, out)
    flip(store, 10 * PAGE + 100)                    # the header's second page
    with pytest.raises(IntegrityError, match="'kkkk.*damaged"):
        store.read_record(spans, meta, out)
    flip(store, 10 * PAGE + 100)
    store.read_record(spans, meta, out)
    flip(store, 20 * PAGE + 5)                      # data in the last extent
    with pytest.raises(IntegrityError, match="checksum mismatch in bytes 0-"):
        store.read_record(spans, meta, out)
