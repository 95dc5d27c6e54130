"""A commit that cannot complete (disk full, I/O error) fails with a clear
error and leaves the previous commit whole."""

from __future__ import annotations

import errno

import pytest
import torch

import tierd
from tierd.backends.hostpool import HostPool
from tierd.backends.manifest import ManifestStore
from tierd.backends.nvme import Failpoints, NvmeStore
from tierd.errors import TierdError
from tierd.protocol import TensorSpec
from tierd.server.catalog import Blocked, Catalog, Direction
from tests.faults import harness

MiB = 1 << 20


class Store:
    """A catalog over real files with failpoints, driven as the daemon drives it."""

    def __init__(self, path, failpoints: Failpoints | None = None) -> None:
        self.failpoints = failpoints or Failpoints()
        self.nvme = NvmeStore(path, 32 * MiB, failpoints=self.failpoints)
        self.manifests = ManifestStore(path, failpoints=self.failpoints)
        self.pool = HostPool(8 * MiB, segment_size=8 * MiB)
        self.cat = Catalog(self.pool, self.nvme, manifests=self.manifests)
        self.cat.recover(self.manifests.load_all())
        self.s = self.cat.open_session(1, "job", pid=10, uid=0)

    def run_io(self) -> None:
        errors = []
        while started := self.cat.take_started():
            for t in started:
                view = t.slot.segment.view(t.slot.offset, t.nbytes)
                io = self.nvme.write_record if t.direction is Direction.TO_NVME \
                    else self.nvme.read_record
                error = None
                try:
                    io(t.disk.spans, t.entry.meta(), view)
                except TierdError as exc:
                    error = exc
                view.release()
                self.cat.finish(t, error)
                errors += [error] if error else []
        if errors:
            raise errors[0]

    def settle(self, call, *args):
        for _ in range(100):
            result = call(*args)
            self.run_io()
            if not isinstance(result, Blocked):
                return result
        raise AssertionError("never settled")

    def put(self, key: str, fill: int, nbytes: int = MiB) -> None:
        (p,) = self.settle(self.cat.reserve, self.s, (TensorSpec(key, "uint8", (nbytes,), nbytes),))
        self.pool.segments[p.segment].view(p.offset, nbytes)[:] = bytes([fill]) * nbytes
        self.cat.publish(self.s, (key,))

    def read(self, key: str) -> bytes:
        (p,) = self.settle(self.cat.lease, self.s, (key,), False)
        data = bytes(self.pool.segments[p.segment].view(p.offset, p.nbytes))
        self.cat.release(self.s, (key,), False)
        return data

    def commit(self, tag: str) -> None:
        plan = self.settle(self.cat.prepare_commit, self.s, tag)
        try:
            self.nvme.sync()
            self.manifests.write(plan.manifest)
        except TierdError as exc:
            self.cat.finish_commit(plan, exc)
            raise
        self.cat.finish_commit(plan, None)

    def crash(self) -> None:
        """Close the files as a crash would leave them (nothing removed)."""
        self.pool.close()
        self.nvme.close(remove=False)


@pytest.mark.parametrize("op, err, after", [("write", errno.ENOSPC, 0), ("write", errno.EIO, 1),
                                            ("sync", errno.EIO, 0), ("manifest", errno.ENOSPC, 0)])
def test_a_failing_commit_leaves_the_previous_one(tmp_path, op, err, after):
    store = Store(tmp_path)
    for i in range(4):
        store.put(f"k{i}", i)
    store.commit("good")
    store.put("k0", 100)                    # changed after the commit
    store.put("k9", 9)                      # new after the commit
    store.cat.delete(store.s, ("k3",))
    store.failpoints.arm(op, err, after=after)
    with pytest.raises(tierd.TierIOError, match=f"{'fsync' if op == 'sync' else ''}.*"
                       f"(No space left|Input/output error).*previous commit is untouched"):
        store.commit("doomed")
    assert store.cat.commit_tags(store.s) == ["good"]
    assert store.read("k0") == bytes([100]) * MiB      # live data unharmed too
    store.crash()
    again = Store(tmp_path)
    assert again.cat.commit_tags(again.s) == ["good"]
    assert again.cat.keys(again.s, "") == ["k0", "k1", "k2", "k3"]
    for i in range(4):
        assert again.read(f"k{i}") == bytes([i]) * MiB
    again.commit("after")                  # and the store commits again
    again.crash()


def test_superseded_records_stay_until_a_newer_commit(tmp_path):
    store = Store(tmp_path)
    store.put("k", 1)
    store.commit("one")
    used = store.nvme.extents.used
    for fill in (2, 3, 4):                 # overwrite and spill again and again
        store.put("k", fill)
        store.settle(store.cat.evict, store.s, ("k",))
    assert store.cat.held_only_bytes == MiB + 4096     # the committed version, once
    store.commit("two")
    assert store.cat.held_only_bytes == 0
    assert store.nvme.extents.used == used  # only the new version's record remains
    store.crash()


def test_nvme_full_during_a_commit_is_a_capacity_error_and_the_last_commit_survives(tmp_path):
    d = harness.start(tmp_path, pool="16MiB", nvme_size="8MiB")
    with d.connect(job="full") as c:
        c.put("w", torch.full((MiB,), 1.0))       # 4 MiB
        c.commit("first")
        c.put("w", torch.full((MiB,), 2.0))       # the committed record must stay
        with pytest.raises(tierd.CapacityError, match="NVMe tier full.*commit"):
            c.commit("second")
        assert c.commits() == ["first"]
    d.kill()
    d = harness.start(tmp_path, pool="16MiB", nvme_size="8MiB")
    with d.connect(job="full") as c:
        assert torch.equal(c.get("w"), torch.full((MiB,), 1.0))
    d.stop()
