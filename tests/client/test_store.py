"""The in-process store follows the daemon's lease rules (the client parts'
unit tests rely on it); the same calls against a real daemon agree."""

from __future__ import annotations

import pytest
import torch

from tierd.client.store import LocalStore, Store
from tierd.errors import CapacityError, StateError, UnknownKey


def test_put_get_round_trip_bit_exact_and_keys_by_prefix():
    s = LocalStore()
    t = torch.randn(5, dtype=torch.bfloat16)
    s.put_many({"m/a": t, "m/b": torch.arange(3), "x": torch.ones(1)})
    assert torch.equal(s.get("m/a"), t) and s.keys("m/") == ["m/a", "m/b"]
    with pytest.raises(UnknownKey):
        s.get("nope")


def test_write_lease_is_exclusive_and_written_release_makes_a_new_version():
    s = LocalStore()
    s.put("k", torch.zeros(2))
    (w,) = s.lease_async(["k"], write=True).result()
    with pytest.raises(StateError, match="leased for writing"):
        s.lease_async(["k"]).result()
    w.tensor.fill_(7)
    s.release(["k"], written=True)
    (r,) = s.lease_async(["k"]).result()
    assert r.version == w.version + 1 and r.tensor.tolist() == [7.0, 7.0]
    with pytest.raises(StateError, match="leased for reading"):
        s.lease_async(["k"], write=True).result()
    with pytest.raises(StateError, match="read-only"):
        s.release(["k"], written=True)
    s.release(["k"])
    with pytest.raises(StateError, match="does not lease"):
        s.release(["k"])


def test_reserved_versions_are_invisible_until_published_and_abort_gives_back():
    s = LocalStore()
    s.put("k", torch.ones(2))
    (slot,) = s.reserve_async({"k": torch.empty(2)}).result()
    slot.tensor.fill_(3)
    assert s.get("k").tolist() == [1.0, 1.0]
    s.publish_async(["k"]).result()
    assert s.get("k").tolist() == [3.0, 3.0]
    s.reserve_async({"new": torch.empty(4)}).result()
    assert "new" not in s.keys()
    s.abort(["new"])
    with pytest.raises(StateError, match="not reserved"):
        s.publish_async(["new"]).result()


def test_capacity_refuses_and_loses_nothing():
    s = LocalStore(pool_bytes=64)
    s.put("a", torch.zeros(8))   # 32 B
    with pytest.raises(CapacityError):
        s.put("b", torch.zeros(16))
    assert s.keys() == ["a"] and s.used_bytes == 32
    s.put("b", torch.zeros(8))


def test_commit_and_restart_keep_exactly_the_last_commit():
    s = LocalStore(job="run1")
    s.put("a", torch.ones(2))
    s.commit("step-1")
    s.put("a", torch.full((2,), 5.0))
    s.put("b", torch.ones(1))
    s.restart()
    assert s.keys() == ["a"] and s.get("a").tolist() == [1.0, 1.0] and s.commits() == ["step-1"]
    with pytest.raises(StateError, match="never committed"):
        LocalStore().commit("x")


def test_both_stores_implement_the_protocol(daemon):
    import tierd
    with tierd.connect(daemon) as client:
        assert isinstance(client, Store) and isinstance(LocalStore(), Store)
        for s in (client, LocalStore()):   # the same rules on both
            s.put_many({"k": torch.ones(2)})
            (w,) = s.lease_async(["k"], write=True).result()
            with pytest.raises(StateError):
                s.lease_async(["k"]).result()
            w.tensor.fill_(2)
            s.release(["k"], written=True)
            assert s.get("k").tolist() == [2.0, 2.0]


def test_put_zeros_reads_zeros_on_both_stores_where_other_values_lay(daemon):
    import tierd
    meta = {"z/a": torch.empty(512, 1024, device="meta"),          # 2 MiB
            "z/b": torch.empty(3, 5, dtype=torch.bfloat16, device="meta")}
    with tierd.connect(daemon) as client:
        for s in (client, LocalStore()):
            s.put_many({"old": torch.full((512, 1024), 3.0)})
            s.delete(["old"])                            # its pool bytes are free, not zero
            s.put_zeros(meta)
            got = s.get_many(list(meta))
            assert torch.equal(got["z/a"], torch.zeros(512, 1024))
            assert torch.equal(got["z/b"], torch.zeros(3, 5, dtype=torch.bfloat16))
            s.put_zeros({"z/a": torch.empty(2, device="meta")})   # a new version, as put
            assert s.get("z/a").tolist() == [0.0, 0.0]


def test_put_many_converts_to_the_dtypes_asked_for_bitwise(daemon):
    import tierd
    src = torch.randn(1000) * 1000
    with tierd.connect(daemon) as client:
        for s in (client, LocalStore()):
            s.put_many({"bf": src, "f64": src, "same": src},
                       dtypes={"bf": torch.bfloat16, "f64": torch.float64})
            got = s.get_many(["bf", "f64", "same"])
            assert got["bf"].dtype == torch.bfloat16 and torch.equal(got["bf"], src.bfloat16())
            assert got["f64"].dtype == torch.float64 and torch.equal(got["f64"], src.double())
            assert torch.equal(got["same"], src)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def test_copy_in_converts_bitwise_from_either_device_in_pieces(device, monkeypatch):
    from tierd.client import connection
    monkeypatch.setattr(connection, "COPY_PIECE", 4096)   # 1000 x 7 fp32: 7 pieces
    src = (torch.randn(1000, 7) * 100).to(device)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        dst = torch.empty(1000, 7, dtype=dtype)
        connection.copy_in(dst, src)
        assert torch.equal(dst, src.cpu().to(dtype))
    half = src.to(torch.bfloat16).t()   # not contiguous, another dtype
    dst = torch.empty(7, 1000)
    connection.copy_in(dst, half)
    assert torch.equal(dst, half.cpu().float())


@pytest.mark.parametrize("threads", [4, 1])
def test_a_segment_the_daemon_zeroed_is_mapped_with_its_page_tables(daemon_factory, tmp_path,
                                                                     threads):
    """[Note: mapping a segment with its page tables]: with 4 pool threads the
    daemon zeroes a new segment's pages, and the client maps them all at once
    (the kernel maps 16 pages a fault) instead of faulting on each page as it
    writes; with fewer it does not, and the client's writes zero them."""
    import os
    import resource
    from pathlib import Path

    if tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) < (5, 14):
        pytest.skip("no MADV_POPULATE_WRITE before Linux 5.14: the daemon cannot zero ahead")
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    if threads < 4 and thp.exists() and not any(
            f"[{m}]" in thp.read_text() for m in ("never", "deny", "advise")):
        pytest.skip("shared memory in huge pages: far fewer faults than 4 KiB pages")
    config = tmp_path / "tierd.toml"
    config.write_text(f"[serve]\npool-threads = {threads}\n")
    client = daemon_factory(pool="256MiB", extra=("--config", str(config))).connect()
    try:
        big = torch.ones((17 << 20) // 4)   # past a 16 MiB segment: a segment of its own
        pages = big.nbytes // 4096
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        client.put("w", big)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert torch.equal(client.get("w"), big)
        if threads >= 4:
            assert faults < pages // 8, (faults, pages)
        else:
            assert faults > pages // 2, (faults, pages)
    finally:
        client.close()


@pytest.fixture
def small_lookahead(monkeypatch):
    """put_batches reserves at most one batch past the one it copies."""
    from tierd.client import connection
    monkeypatch.setattr(connection, "PUT_AHEAD", 1)
    monkeypatch.setattr(connection, "SHARED_SOURCE_PIECE", 4096)   # several pieces a tensor


def test_put_batches_stores_each_batch_bitwise_made_lazily_and_reported_in_order(
        daemon, small_lookahead):
    """[Note: pipelined puts]: every batch is stored as put_many stores it (a
    source under two keys converted to each dtype, read a piece at a time:
    [Note: one read of a shared source]); a batch is made only when the
    lookahead asks for it, and reported once readable, in order."""
    import tierd
    torch.manual_seed(0)
    sources = [torch.randn(3000) * 100 for _ in range(8)]
    strided = torch.randn(40, 30).t()   # not contiguous: copied whole, twice
    with tierd.connect(daemon) as client:
        for store in (client, LocalStore()):
            reported = []

            def batches():
                for i, src in enumerate(sources):
                    if i >= 2:   # made only once the batch two before is stored (sent before)
                        assert f"m/{i - 2}" in store.keys("m/")
                    yield ({f"m/{i}": src, f"p/{i}": src, f"s/{i}": strided},
                           {f"p/{i}": torch.bfloat16})

            def published(i: int) -> None:
                assert torch.equal(store.get(f"p/{i}"), sources[i].bfloat16())
                reported.append(i)

            store.put_batches(batches(), published)
            assert reported == list(range(len(sources)))
            got = store.get_many([f"{k}/{i}" for i in range(len(sources)) for k in "mps"])
            for i, src in enumerate(sources):
                assert torch.equal(got[f"m/{i}"], src)
                assert got[f"p/{i}"].dtype == torch.bfloat16
                assert torch.equal(got[f"p/{i}"], src.bfloat16())
                assert torch.equal(got[f"s/{i}"], strided)
            store.delete(list(got))


@pytest.mark.parametrize("failure", ["a batch the store refuses", "making a batch fails"])
def test_put_batches_keeps_what_it_reported_and_gives_back_the_rest(daemon, small_lookahead,
                                                                    failure):
    """An error mid-way is raised, the batches reported stay stored, and no
    slot of the others stays reserved (the pool holds exactly the stored)."""
    import tierd
    from tierd.errors import TierdError
    src = torch.randn(4096)

    def batches():
        for i in range(6):
            if i == 4:
                if failure == "making a batch fails":
                    raise TierdError("a value could not be read")
                yield {f"k/{i}": torch.empty(4096, device="meta")}, None
            yield {f"k/{i}": src}, None

    with tierd.connect(daemon) as client:
        reported = []
        with pytest.raises(TierdError, match="could not be read|meta tensor"):
            client.put_batches(batches(), reported.append)
        assert client.keys("k/") == [f"k/{i}" for i in reported]
        assert reported == list(range(len(reported))) and len(reported) >= 2
        for k in client.keys("k/"):
            assert torch.equal(client.get(k), src)
        client.delete(client.keys("k/"))
        assert client.stats()["pool_used_bytes"] == 0   # nothing left reserved
        client.put_batches([({"k/5": src}, None)])   # a key reserved before is free again
        assert torch.equal(client.get("k/5"), src)
