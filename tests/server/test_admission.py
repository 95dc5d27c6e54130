"""Admission: a refused put changes nothing, so as much fits afterwards."""

from __future__ import annotations

import pytest
import torch

from tests.server.test_catalog import put, settle
from tierd.backends.hostpool import HostPool
from tierd.backends.nvme import NvmeStore
from tierd.errors import CapacityError
from tierd.protocol import TensorSpec
from tierd.server.catalog import Catalog

MiB = 1 << 20


@pytest.fixture
def catalog(tmp_path):
    nvme = NvmeStore(tmp_path, 32 * MiB)
    pool = HostPool(8 * MiB, segment_size=2 * MiB)
    cat = Catalog(pool, nvme)
    yield cat
    pool.close()
    nvme.close()


def fill(cat, s, prefix: str) -> int:
    """Put 1 MiB tensors until admission refuses; returns how many fit."""
    n = 0
    while True:
        try:
            put(cat, s, f"{prefix}{n}", MiB, n % 256)
        except CapacityError as exc:
            assert "pool + NVMe full" in str(exc)
            return n
        n += 1


def spec(key: str, nbytes: int) -> TensorSpec:
    return TensorSpec(key, "uint8", (nbytes,), nbytes)


def test_a_refused_reserve_keeps_no_slot_and_no_accounting(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    put(catalog, s, "a", MiB, 1)
    before = (catalog.pool.used_bytes, catalog.stored_bytes, catalog.admission.largest,
              catalog.jobs["job"].largest, catalog.jobs["job"].stored_bytes)
    # Larger than the pool, smaller than half of pool + NVMe: admission alone
    # would let it in; the reserve refuses it, the first spec's slot included.
    with pytest.raises(CapacityError, match="larger than the pool .*it can never be stored"):
        settle(catalog, catalog.reserve, s, (spec("b", MiB), spec("big", 12 * MiB)))
    after = (catalog.pool.used_bytes, catalog.stored_bytes, catalog.admission.largest,
             catalog.jobs["job"].largest, catalog.jobs["job"].stored_bytes)
    assert after == before and not s.reserved


def test_as_many_tensors_fit_after_a_refused_put(catalog):
    s = catalog.open_session(1, "job", pid=10, uid=0)
    fitted = fill(catalog, s, "k")
    catalog.delete(s, tuple(f"k{i}" for i in range(fitted)))
    with pytest.raises(CapacityError, match="larger than the pool .*it can never be stored"):
        put(catalog, s, "big", 12 * MiB, 0)
    assert fill(catalog, s, "m") == fitted


def test_daemon_fits_as_many_tensors_after_a_put_larger_than_the_pool(daemon_factory):
    d = daemon_factory(pool="4MiB", nvme_size="8MiB")
    one = torch.ones(MiB // 4)                       # 1 MiB of float32
    with d.connect(job="fill") as c:
        def count(prefix: str) -> int:
            n = 0
            while True:
                try:
                    c.put(f"{prefix}{n}", one)
                except CapacityError:
                    return n
                n += 1

        fitted = count("k")
        assert fitted > 4                             # the pool spilled to NVMe
        c.delete([f"k{i}" for i in range(fitted)])
        with pytest.raises(CapacityError, match="larger than the pool .*it can never be stored"):
            c.put("big", torch.ones(5 * MiB // 4))   # 5 MiB: above the pool, under half
        assert count("m") == fitted
        assert torch.equal(c.get(f"m{fitted - 1}"), one)
