"""Random sequences of requests against the catalog, with some transfers left
in flight across later requests: after each step the pool, the NVMe allocator
and admission agree with the slots and extents still in use, and every key
reads back what was last written to it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings, strategies as st

from tests.server.test_catalog import run_io
from tierd.backends.hostpool import HostPool
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError, StateError, UnknownKey
from tierd.protocol import TensorSpec
from tierd.server.catalog import Blocked, Catalog, Direction, Residency, Transfer
from tierd.server.records import stored_size
from tierd.server.slots import ExtentState, SlotState

KiB, MiB = 1 << 10, 1 << 20
KEYS = ["a", "b", "c", "d"]
ON_A_TENSOR = {"read", "hold", "write", "evict", "delete", "prefetch", "evict_later",
               "prefetch_later"}

ops = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(KEYS),
              st.sampled_from([4 * KiB, 300 * KiB, MiB, 3 * MiB, 12 * MiB])),
    st.tuples(st.sampled_from(["read", "hold", "unhold", "write", "evict", "delete",
                               "prefetch", "reserve", "abort", "evict_later",
                               "prefetch_later"]), st.sampled_from(KEYS)),
    st.tuples(st.sampled_from(["commit", "reconnect", "io"]), st.just("")),
), min_size=8, max_size=30)


class Driver:
    """A catalog over an 8 MiB pool and 32 MiB of NVMe, with a model of what
    each key holds; ``other`` is a second session of the job holding leases."""

    def __init__(self, path: Path) -> None:
        self.pool = HostPool(8 * MiB, segment_size=2 * MiB)
        self.nvme = NvmeStore(path, 32 * MiB)
        self.cat = Catalog(self.pool, self.nvme)
        self.s = self.cat.open_session(1, "job", pid=10, uid=0)
        self.other = self.cat.open_session(2, "job", pid=11, uid=0)
        self.next_sid = 3
        self.expect: dict[str, int] = {}   # key -> fill byte of its last version
        self.fill = 0
        self.largest = 0   # the largest tensor admitted so far (what admission keeps free)
        self.pending: list[Transfer] = []   # begun, carried out only at an "io" step

    def run_pending(self) -> None:
        pending, self.pending = self.pending, []
        for t in pending:
            view = t.slot.segment.view(t.slot.offset, t.nbytes)
            if t.direction is Direction.TO_NVME:
                self.nvme.write_record(t.disk.spans, t.entry.meta(), view)
            else:
                self.nvme.read_record(t.disk.spans, t.entry.meta(), view)
            view.release()
            self.cat.finish(t, None)

    def settle(self, call, *args):
        """As the daemon: carry out what the call waits for and retry it."""
        for _ in range(100):
            result = call(*args)
            if not isinstance(result, Blocked):
                run_io(self.cat)
                return result
            self.run_pending()
            run_io(self.cat)
        raise AssertionError("never settled")

    def close(self) -> None:
        self.pool.close()
        self.nvme.close()

    def view(self, p):
        return self.pool.segments[p.segment].view(p.offset, p.nbytes)

    def put(self, key: str, nbytes: int) -> None:
        self.fill = self.fill % 250 + 1
        (p,) = self.settle(self.cat.reserve, self.s, (TensorSpec(key, "uint8", (nbytes,),
                                                                      nbytes),))
        self.largest = max(self.largest, stored_size(key, "job", nbytes))
        self.view(p)[:] = bytes([self.fill]) * nbytes
        self.cat.publish(self.s, (key,))
        self.expect[key] = self.fill

    def read(self, key: str) -> None:
        (p,) = self.settle(self.cat.lease, self.s, (key,), False)
        v = self.view(p)
        assert (v[0], v[-1]) == (self.expect[key],) * 2, key
        v.release()
        self.cat.release(self.s, (key,), False)

    def write(self, key: str) -> None:
        (p,) = self.settle(self.cat.lease, self.s, (key,), True)
        self.fill = self.fill % 250 + 1
        self.view(p)[:] = bytes([self.fill]) * p.nbytes
        self.cat.release(self.s, (key,), True)
        self.expect[key] = self.fill

    def step(self, op: str, key: str, size: int = 0) -> None:
        cat, s = self.cat, self.s
        if op in ON_A_TENSOR and key not in self.expect:
            self.put(key, MiB)   # so that most steps act on a stored tensor
        match op:
            case "put":
                self.put(key, size)
            case "read":
                self.read(key)
            case "hold":
                self.settle(cat.lease, self.other, (key,), False)
            case "unhold":
                cat.release(self.other, (key,), False)
            case "write":
                self.write(key)
            case "evict":
                self.settle(cat.evict, s, (key,))
            case "delete":
                cat.delete(s, (key,))
                self.expect.pop(key, None)
            case "prefetch":
                cat.prefetch(s, (key,))
                run_io(cat)
            case "evict_later":
                cat.evict(s, (key,))
                self.pending += cat.take_started()
            case "prefetch_later":
                cat.prefetch(s, (key,))
                self.pending += cat.take_started()
            case "io":
                self.run_pending()
            case "reserve":
                self.settle(cat.reserve, s, (TensorSpec(key, "uint8", (KiB,), KiB),))
                self.largest = max(self.largest, stored_size(key, "job", KiB))
            case "abort":
                cat.abort(s, (key,))
            case "commit":
                cat.finish_commit(self.settle(cat.prepare_commit, s, "t"), None)
            case "reconnect":   # the lease holder goes away, a new one comes
                cat.close_session(self.other.id)
                self.other = cat.open_session(self.next_sid, "job", pid=12, uid=0)
                self.next_sid += 1

    def check(self) -> None:
        cat = self.cat
        sessions = list(cat.sessions.values())
        slots = {id(x): x for x in
                 [e.slot for e in cat.entries.values() if e.slot is not None]
                 + [slot for sess in sessions for _, slot in sess.reserved.values()]
                 + [r[1] for sess in sessions for recs in sess.leases.values() for r in recs]
                 + [t.slot for t in self.pending]}
        disks = {id(x): x for x in
                 [e.disk for e in cat.entries.values() if e.disk is not None]
                 + [d for job in cat.jobs.values() for d in job.committed]
                 + [t.disk for t in self.pending]}
        assert all(x.state is not SlotState.FREED for x in slots.values())
        assert all(x.state is not ExtentState.FREED for x in disks.values())
        assert self.pool.used_bytes == sum(x.nbytes for x in slots.values())
        assert self.nvme.extents.used == sum(x.nbytes for x in disks.values())
        assert cat.admission.largest == self.largest
        assert cat.admission.held_only_bytes == sum(
            x.nbytes for x in disks.values() if x.state is ExtentState.HELD)
        assert cat.stored_bytes == sum(
            stored_size(k, j, e.spec.nbytes) for (j, k), e in cat.entries.items()) + sum(
            stored_size(k, "job", spec.nbytes) for sess in sessions
            for k, (spec, _) in sess.reserved.items())
        moving = {id(t.entry) for t in self.pending}
        for e in cat.entries.values():
            if id(e) in moving:
                assert e.state in (Residency.WRITING_BACK, Residency.READING_IN)
            elif e.state is Residency.IN_POOL:
                assert e.slot.state in (SlotState.READY, SlotState.WRITE_LEASED)
            else:
                assert e.slot is None and e.disk.state is ExtentState.CURRENT
        assert sorted(k for (_, k) in cat.entries) == sorted(self.expect)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_requests_keep_every_byte_accounted_for(steps):
    with tempfile.TemporaryDirectory() as tmp:
        d = Driver(Path(tmp))
        try:
            for op, key, *size in steps:
                try:
                    d.step(op, key, *size)
                except (CapacityError, StateError, UnknownKey):
                    d.pending += d.cat.take_started()   # what it began before refusing
                d.check()
            d.run_pending()
            d.check()
            for key in list(d.expect):
                d.read(key)
        finally:
            d.close()


def test_an_evict_into_a_full_nvme_frees_copies_of_tensors_in_the_pool(tmp_path):
    """Admission counts each tensor once: when NVMe's bytes are taken by a
    clean copy of a tensor that is also in the pool, that copy gives way to
    an explicit evict (it was refused with "NVMe tier full")."""
    from tests.server.test_catalog import put, read, settle

    pool, nvme = HostPool(16 * MiB, segment_size=8 * MiB), NvmeStore(tmp_path, 16 * MiB)
    cat = Catalog(pool, nvme)
    try:
        s = cat.open_session(1, "job", pid=10, uid=0)
        for fill, key in enumerate("acd", start=1):
            put(cat, s, key, 6 * MiB, fill)
        settle(cat, cat.evict, s, ("a",))
        assert read(cat, s, "a") == bytes([1]) * 8      # back in the pool, its copy kept
        settle(cat, cat.evict, s, ("c",))
        assert nvme.extents.free_bytes < stored_size("d", "job", 6 * MiB)
        settle(cat, cat.evict, s, ("d",))
        a = cat.entries[("job", "a")]
        assert a.state is Residency.IN_POOL and a.disk is None and a.dirty
        assert [read(cat, s, k) for k in "acd"] == [bytes([f]) * 8 for f in (1, 2, 3)]
    finally:
        pool.close()
        nvme.close()
