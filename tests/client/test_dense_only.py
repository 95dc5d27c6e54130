"""Only dense tensors can be stored: a sparse, nested or meta value is refused
with a tierd error naming the key and "dense tensors only", before anything is
reserved, by the socket client and the in-process store alike."""

from __future__ import annotations

import warnings

import pytest
import torch

import tierd
from tierd.client.store import LocalStore

with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # nested and CSR tensors warn that they are prototypes
    CASES = {
        "sparse_coo": torch.ones(3, 3).to_sparse(),
        "sparse_csr": torch.ones(3, 3).to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "meta": torch.empty(3, device="meta"),
    }


@pytest.fixture(params=["daemon", "local"])
def store(request):
    if request.param == "local":
        yield LocalStore()
        return
    c = request.getfixturevalue("daemon").connect()
    yield c
    c.close()


@pytest.mark.parametrize("kind", CASES)
def test_putting_a_tensor_that_is_not_dense_is_a_clear_error(store, kind):
    store.put_many({"kept": torch.arange(4.0)})
    with pytest.raises(tierd.TierdError, match=rf"'bad': a {kind}.*dense tensors only"):
        store.put_many({"ok": torch.ones(2), "bad": CASES[kind]})
    assert store.keys() == ["kept"]   # nothing of the refused put was stored
    assert torch.equal(store.get("kept"), torch.arange(4.0))


@pytest.mark.parametrize("kind", ["sparse_coo", "nested"])
def test_put_zeros_refuses_what_is_not_dense_but_takes_a_meta_shape(store, kind):
    with pytest.raises(tierd.TierdError, match="dense tensors only"):
        store.put_zeros({"z": CASES[kind]})
    store.put_zeros({"z": CASES["meta"]})
    assert torch.equal(store.get("z"), torch.zeros(3))
