"""The catalog driven directly: plain calls, transfers carried out inline."""

from __future__ import annotations

import pytest

from tierd.backends.hostpool import HostPool
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError, StateError, TierIOError, UnknownKey
from tierd.protocol import TensorSpec
from tierd.server.catalog import Blocked, Catalog, Direction, Residency
from tierd.server.records import Entry
from tierd.server.slots import DiskExtent, ExtentState, PoolSlot, SlotState

MiB = 1 << 20


@pytest.fixture
def catalog(tmp_path):
    nvme = NvmeStore(tmp_path, 32 * MiB)
    pool = HostPool(8 * MiB, segment_size=8 * MiB)
    cat = Catalog(pool, nvme)
    yield cat
    pool.close()
    nvme.close()


def run_io(cat: Catalog, fail: bool = False) -> int:
    """Carry out every started transfer (as the daemon would); returns how many."""
    n = 0
    while started := cat.take_started():
        for t in started:
            view = t.slot.segment.view(t.slot.offset, t.nbytes)
            error = None
            if fail:
                error = TierIOError("injected")
            elif t.direction is Direction.TO_NVME:
                cat.nvme.write_record(t.disk.spans, t.entry.meta(), view)
            else:
                cat.nvme.read_record(t.disk.spans, t.entry.meta(), view)
            view.release()
            cat.finish(t, error)
            n += 1
    return n


def settle(cat, call, *args):
    """Retry ``call`` as the daemon does until it is not Blocked."""
    for _ in range(100):
        result = call(*args)
        if not isinstance(result, Blocked):
            run_io(cat)
            return result
        run_io(cat)
    raise AssertionError("never settled")


def put(cat, s, key, nbytes, fill: int):
    (p,) = settle(cat, cat.reserve, s, (TensorSpec(key, "uint8", (nbytes,), nbytes),))
    cat.pool.segments[p.segment].view(p.offset, nbytes)[:] = bytes([fill]) * nbytes
    cat.publish(s, (key,))


def read(cat, s, key) -> bytes:
    (p,) = settle(cat, cat.lease, s, (key,), False)
    data = bytes(cat.pool.segments[p.segment].view(p.offset, 8))
    cat.release(s, (key,), False)
    return data


def test_lru_eviction_spills_least_recently_used_first(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    for i in range(4):
        put(catalog, s, f"k{i}", 2 * MiB, i)
    read(catalog, s, "k0")                       # k0 is now most recently used
    put(catalog, s, "k4", 2 * MiB, 4)            # pool holds 4: one must go
    states = {k: catalog.entries[("job", k)].state for k in ("k0", "k1", "k2", "k3", "k4")}
    assert states["k1"] is Residency.ON_NVME
    assert states["k0"] is Residency.IN_POOL and states["k4"] is Residency.IN_POOL
    assert read(catalog, s, "k1") == bytes([1]) * 8


def test_leased_tensors_are_never_evicted(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    for i in range(4):
        put(catalog, s, f"k{i}", 2 * MiB, i)
    settle(catalog, catalog.lease, s, ("k0", "k1", "k2", "k3"), False)
    with pytest.raises(CapacityError, match="nothing evictable"):
        settle(catalog, catalog.reserve, s, (TensorSpec("x", "uint8", (MiB,), MiB),))
    catalog.release(s, ("k0", "k1", "k2", "k3"), False)
    put(catalog, s, "x", MiB, 9)
    assert read(catalog, s, "x") == bytes([9]) * 8


def test_dead_session_gives_back_leases_and_reserved_slots(catalog):
    owner = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, owner, "k", MiB, 1)
    other = catalog.open_session(2, "job", pid=11, uid=0)
    settle(catalog, catalog.lease, other, ("k",), False)
    settle(catalog, catalog.reserve, other, (TensorSpec("half", "uint8", (MiB,), MiB),))
    used = catalog.pool.used_bytes
    catalog.close_session(2)
    assert catalog.pool.used_bytes == used - MiB      # the unpublished slot is freed
    assert settle(catalog, catalog.evict, owner, ("k",)) is None   # lease gone
    assert "half" not in catalog.keys(owner, "")


def test_ephemeral_job_ends_with_its_last_session(catalog):
    s = catalog.open_session(1, None, pid=10, uid=0)
    put(catalog, s, "k", MiB, 1)
    assert catalog.stored_bytes == MiB + 4096    # the data and its NVMe record header
    catalog.close_session(1)
    assert catalog.pool.used_bytes == 0 and catalog.stored_bytes == 0
    assert "session-1" not in catalog.jobs


def test_another_user_cannot_join_a_job(catalog):
    catalog.open_session(1, "alice-job", pid=10, uid=1000)
    with pytest.raises(StateError, match="belongs to uid 1000"):
        catalog.open_session(2, "alice-job", pid=11, uid=1001)


def test_write_lease_conflicts_are_refused(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "k", MiB, 1)
    settle(catalog, catalog.lease, s, ("k",), False)
    with pytest.raises(StateError, match="to itself"):
        catalog.lease(s, ("k",), True)
    catalog.release(s, ("k",), False)
    settle(catalog, catalog.lease, s, ("k",), True)
    with pytest.raises(StateError, match="leased for writing"):
        catalog.lease(s, ("k",), False)
    catalog.release(s, ("k",), True)
    settle(catalog, catalog.lease, s, ("k",), False)
    with pytest.raises(StateError, match="read-only"):
        catalog.release(s, ("k",), True)
    catalog.release(s, ("k",), False)             # the failed call changed nothing
    assert catalog.entries[("job", "k")].version == 2


def test_failed_write_back_keeps_the_tensor_readable(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "k", MiB, 7)
    assert isinstance(catalog.evict(s, ("k",)), Blocked)
    run_io(catalog, fail=True)
    entry = catalog.entries[("job", "k")]
    assert entry.state is Residency.IN_POOL and entry.dirty
    assert catalog.nvme.extents.used == 0
    assert read(catalog, s, "k") == bytes([7]) * 8


def test_delete_during_write_back_frees_everything_when_it_lands(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "k", MiB, 7)
    catalog.evict(s, ("k",))
    catalog.delete(s, ("k",))
    run_io(catalog)
    assert catalog.pool.used_bytes == 0 and catalog.nvme.extents.used == 0
    with pytest.raises(UnknownKey):
        catalog.lease(s, ("k",), False)


def test_admission_keeps_room_to_swap(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    n = 0
    with pytest.raises(CapacityError, match="pool \\+ NVMe full"):
        while True:
            put(catalog, s, f"k{n}", 4 * MiB, n % 256)
            n += 1
    record = 4 * MiB + 4096                       # data and its NVMe record header
    assert n == (40 * MiB - record) // record     # one largest record kept free
    for i in range(n):                            # every key still readable
        assert read(catalog, s, f"k{i}") == bytes([i]) * 8


def test_a_job_below_its_fair_share_takes_room_from_the_one_above(tmp_path):
    nvme = NvmeStore(tmp_path, 64 * MiB)
    pool = HostPool(8 * MiB, segment_size=2 * MiB)
    cat = Catalog(pool, nvme)
    hog = cat.open_session(1, "hog", pid=10, uid=0)
    for i in range(4):
        put(cat, hog, f"k{i}", 2 * MiB, i)        # the hog fills the pool
    late = cat.open_session(2, "late", pid=11, uid=0)
    for i in range(2):
        put(cat, late, f"m{i}", 2 * MiB, 10 + i)  # the newcomer still gets room
    assert pool.job_used_bytes("late") == 4 * MiB
    assert pool.job_used_bytes("hog") == 4 * MiB  # down to its fair share, no further
    put(cat, late, "m2", 2 * MiB, 12)             # now at its share: spills its own
    assert pool.job_used_bytes("hog") == 4 * MiB
    for i in range(4):
        assert read(cat, hog, f"k{i}") == bytes([i]) * 8
    pool.close()
    nvme.close()


def test_quotas_spill_own_tensors_then_refuse(tmp_path):
    nvme = NvmeStore(tmp_path, 64 * MiB)
    pool = HostPool(16 * MiB, segment_size=4 * MiB)
    quotas = {"small": (4 * MiB, 8 * MiB)}
    cat = Catalog(pool, nvme, quotas=lambda job: quotas.get(job, (0, 0)))
    small = cat.open_session(1, "small", pid=10, uid=0)
    other = cat.open_session(2, "other", pid=11, uid=0)
    put(cat, other, "o", 4 * MiB, 1)
    for i in range(4):          # 8 MiB of 2 MiB tensors (+ a 4 KiB header each)
        put(cat, small, f"k{i}", 2 * MiB, i)
    assert pool.job_used_bytes("small") <= 4 * MiB   # spilled its own to NVMe
    assert cat.jobs["small"].nvme_used >= 4 * MiB
    with pytest.raises(CapacityError, match="over quota"):
        put(cat, small, "k4", 2 * MiB, 5)
    put(cat, other, "o2", 4 * MiB, 2)             # the other job is unaffected
    assert read(cat, other, "o") == bytes([1]) * 8
    pool.close()
    nvme.close()


# ---------------------------------------------------------------- lifecycles
def new_slot(catalog, state=SlotState.RESERVED) -> PoolSlot:
    seg, off = catalog.pool.allocate("job", MiB)
    return PoolSlot(seg, off, MiB, "k", state)


def test_slot_lifecycle_frees_only_after_the_last_holder(catalog):
    slot = new_slot(catalog)
    slot.published()
    slot.add_reader()
    slot.add_reader()
    assert not slot.end_read() and slot.state is SlotState.READY
    assert not slot.retire() and slot.state is SlotState.RETIRED   # one lease still reads it
    assert slot.end_read() and slot.state is SlotState.FREED
    written = new_slot(catalog)
    written.published()
    written.lease_write()
    assert not written.retire()          # replaced while write-leased: waits for the writer
    assert written.end_write() and written.state is SlotState.FREED
    filling = new_slot(catalog, SlotState.FILLING)
    assert not filling.retire() and filling.filled()   # the entry went during the swap-in
    idle = new_slot(catalog)
    idle.published()
    assert idle.retire() and idle.state is SlotState.FREED


@pytest.mark.parametrize("transition, state, match", [
    ("add_reader", SlotState.RESERVED, "^k: pool slot is RESERVED, expected READY"),
    ("end_write", SlotState.RESERVED, "pool slot is RESERVED, expected WRITE_LEASED"),
    ("filled", SlotState.RESERVED, "pool slot is RESERVED, expected FILLING"),
    ("retire", SlotState.RESERVED, "pool slot is RESERVED, expected READY"),
    ("published", SlotState.FILLING, "pool slot is FILLING, expected RESERVED"),
    ("end_read", SlotState.FILLING, "pool slot is FILLING, expected READY"),
])
def test_illegal_slot_transitions_name_the_key_and_state(catalog, transition, state, match):
    slot = new_slot(catalog, state)
    with pytest.raises(StateError, match=match):
        getattr(slot, transition)()
    assert slot.state is state and slot.readers == 0     # unchanged


def test_slot_refuses_double_use(catalog):
    slot = new_slot(catalog)
    slot.published()
    with pytest.raises(StateError, match="no reader"):
        slot.end_read()
    slot.add_reader()
    with pytest.raises(StateError, match="needs the tensor to itself"):
        slot.lease_write()
    assert slot.end_read() is False
    assert slot.retire()
    with pytest.raises(StateError, match="is FREED"):
        slot.retire()
    with pytest.raises(StateError, match="a new pool slot is RESERVED or FILLING, not READY"):
        new_slot(catalog, SlotState.READY)


def test_extent_lifecycle_keeps_what_a_commit_or_a_reader_needs():
    disk = DiskExtent(((0, 8192),), "job", "k")
    disk.written()
    disk.hold()
    disk.add_reader()
    assert not disk.retire() and disk.state is ExtentState.HELD   # a commit names it
    assert not disk.unhold() and disk.state is ExtentState.DRAINING   # a swap-in reads it
    assert disk.end_read() and disk.state is ExtentState.FREED
    failed = DiskExtent(((0, 8192),), "job", "k")
    assert failed.abandon() and failed.state is ExtentState.FREED
    plain = DiskExtent(((0, 8192),), "job", "k", ExtentState.CURRENT)
    assert plain.retire()


@pytest.mark.parametrize("transition, match", [
    ("add_reader", "^k: NVMe extent at 0 is WRITING, expected CURRENT"),
    ("hold", "NVMe extent at 0 is WRITING, expected CURRENT"),
    ("retire", "NVMe extent at 0 is WRITING, expected CURRENT"),
    ("unhold", "NVMe extent at 0 is WRITING, expected CURRENT or HELD"),
])
def test_illegal_extent_transitions_name_the_key_and_state(transition, match):
    disk = DiskExtent(((0, 8192),), "job", "k")
    with pytest.raises(StateError, match=match):
        getattr(disk, transition)()
    assert disk.state is ExtentState.WRITING


def test_extent_refuses_unbalanced_counts():
    disk = DiskExtent(((0, 8192),), "job", "k", ExtentState.CURRENT)
    with pytest.raises(StateError, match="no hold"):
        disk.unhold()
    with pytest.raises(StateError, match="no reader"):
        disk.end_read()
    with pytest.raises(StateError, match="is CURRENT, expected WRITING"):
        disk.abandon()


def test_residency_transitions_raise_state_errors(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "k", MiB, 1)
    entry: Entry = catalog.entries[("job", "k")]
    with pytest.raises(StateError, match="^k: tensor has no clean NVMe copy"):
        entry.to_on_nvme()
    with pytest.raises(StateError, match="^k: tensor is IN_POOL, expected WRITING_BACK"):
        entry.to_in_pool()
    assert entry.state is Residency.IN_POOL and read(catalog, s, "k") == bytes([1]) * 8


def test_superseded_commit_records_count_against_admission_until_the_next_commit(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "k", MiB, 1)
    catalog.finish_commit(settle(catalog, catalog.prepare_commit, s, "one"), None)
    record = catalog.entries[("job", "k")].disk
    put(catalog, s, "k", MiB, 2)                        # a new version: the old record is HELD
    assert record.state is ExtentState.HELD
    assert catalog.admission.held_only_bytes == record.nbytes
    catalog.finish_commit(settle(catalog, catalog.prepare_commit, s, "two"), None)
    assert record.state is ExtentState.FREED and catalog.admission.held_only_bytes == 0
    assert catalog.nvme.extents.used == catalog.entries[("job", "k")].disk.nbytes


def _write(cat, s, key, nbytes, fill: int) -> None:
    (p,) = settle(cat, cat.lease, s, (key,), True)
    cat.pool.segments[p.segment].view(p.offset, nbytes)[:] = bytes([fill]) * nbytes
    cat.release(s, (key,), True)


def test_a_large_tensor_empties_whole_segments_not_scattered_tensors(tmp_path):
    """[Note: room for a large tensor]: the pinned segments keep their tensors."""
    nvme = NvmeStore(tmp_path, 64 * MiB)
    pool = HostPool(16 * MiB, segment_size=4 * MiB)
    cat = Catalog(pool, nvme)
    s = cat.open_session(1, "job", pid=10, uid=0)
    keys = [f"k{i}" for i in range(16)]          # 1 MiB each: 4 per segment
    for i, k in enumerate(keys):
        put(cat, s, k, MiB, i)
    segment = {k: cat.entries[("job", k)].slot.segment.id for k in keys}
    pinned = list(dict.fromkeys(segment.values()))[:3]
    held = tuple(next(k for k in keys if segment[k] == sid) for sid in pinned)
    settle(cat, cat.lease, s, held, False)       # one leased tensor in 3 of 4 segments
    for k in reversed(keys):                     # the free segment's tensors are hottest
        if segment[k] not in pinned:
            read(cat, s, k)
    put(cat, s, "big", 3 * MiB, 99)
    for k in keys:   # room came from the one segment nothing pins
        if segment[k] in pinned:
            assert cat.entries[("job", k)].state is Residency.IN_POOL, k
    assert cat.entries[("job", "big")].slot.segment.id not in pinned
    cat.release(s, held, False)
    put(cat, s, "huger", 6 * MiB, 98)            # above a segment: two whole ones go
    for i, k in enumerate(keys):
        assert read(cat, s, k) == bytes([i]) * 8
    assert read(cat, s, "big") == bytes([99]) * 8 and read(cat, s, "huger") == bytes([98]) * 8
    pool.close()
    nvme.close()


def test_nvme_copies_of_pooled_tensors_give_way_to_dirty_ones(tmp_path):
    """Tensors read back from NVMe keep a clean copy there; when NVMe is full
    those copies make room, so everything admitted stays writable."""
    nvme = NvmeStore(tmp_path, 12 * MiB)
    pool = HostPool(8 * MiB, segment_size=8 * MiB)
    cat = Catalog(pool, nvme)
    s = cat.open_session(1, "job", pid=10, uid=0)
    keys = [f"k{i}" for i in range(8)]           # 2 MiB each: 16 MiB in 20 MiB of tiers
    for i, k in enumerate(keys):
        put(cat, s, k, 2 * MiB, i)
    settle(cat, cat.lease, s, ("k0", "k1"), False)   # read back and kept: clean copies
    for rnd in range(3):
        for i, k in enumerate(keys[2:], 2):
            _write(cat, s, k, 2 * MiB, 10 * rnd + i)
    cat.release(s, ("k0", "k1"), False)
    for i, k in enumerate(keys):
        assert read(cat, s, k) == bytes([20 + i if i >= 2 else i]) * 8
    pool.close()
    nvme.close()


def test_a_zero_reserve_reads_zeros_in_fresh_and_in_reused_bytes(catalog):
    s = catalog.open_session(1, None, pid=1, uid=0)
    put(catalog, s, "used", 2 * MiB, fill=7)
    catalog.delete(s, ("used",))                       # its bytes go back, still 7s
    specs = (TensorSpec("again", "uint8", (2 * MiB,), 2 * MiB),      # reuses them
             TensorSpec("fresh", "uint8", (MiB + 5,), MiB + 5))      # past them: never written
    placed = settle(catalog, catalog.reserve, s, specs, True)
    assert placed[0].offset == 0 and placed[1].offset >= 2 * MiB
    # only the reused bytes took a write, and the daemon's stats count them
    assert catalog.stats()["pool_zeroed_bytes"] == 2 * MiB
    for p in placed:
        assert bytes(catalog.pool.segments[p.segment].view(p.offset, p.nbytes)) == bytes(p.nbytes)
    catalog.publish(s, ("again", "fresh"))
    assert read(catalog, s, "again") == bytes(8)
    # without zero a reserve leaves what was there (the writer fills it)
    catalog.delete(s, ("again",))
    put(catalog, s, "x", 2 * MiB, fill=9)
    catalog.delete(s, ("x",))
    (p,) = settle(catalog, catalog.reserve, s, (TensorSpec("y", "uint8", (8,), 8),))
    assert bytes(catalog.pool.segments[p.segment].view(p.offset, 8)) == bytes([9]) * 8
