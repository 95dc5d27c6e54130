"""Training resume: commit at step 3, kill -9 the daemon, restart it on the same
NVMe dir, attach a fresh model with resume=True: steps 4-6 as if nothing happened."""

from __future__ import annotations

import pytest
import torch

import tierd
import tierd.optim
from tierd.client.attach import attach, session_of
from tierd.errors import DaemonUnavailable, StateError
from tests.client.models import assert_same_weights, batches, gpt2, train
from tests.faults import harness

JOB = "resume"
DATA = batches(6)


def _uninterrupted(workdir) -> tuple[list[float], dict]:
    d = harness.start(workdir)
    try:
        model = attach(gpt2(), client=d.connect(job=JOB), name="m")
        opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        losses = train(model, opt, DATA[:3])
        tierd.commit(model, opt, 3)
        losses += train(model, opt, DATA[3:])
        return losses, model.state_dict()
    finally:
        d.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _uninterrupted(tmp_path_factory.mktemp("reference"))


def test_kill_after_commit_resumes_with_the_same_losses_and_weights(tmp_path, reference):
    want_losses, want_weights = reference
    d = harness.start(tmp_path)
    client = d.connect(job=JOB)
    model = attach(gpt2(), client=client, name="m")
    opt = tierd.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    assert train(model, opt, DATA[:3]) == want_losses[:3]
    info = tierd.commit(model, opt, 3)
    assert info["tag"] == "step-3"
    train(model, opt, DATA[3:4])   # step 4, never committed
    d.kill()
    with pytest.raises(DaemonUnavailable):
        client.stats()

    d = harness.start(tmp_path)   # same NVMe dir: recovers the commit
    try:
        fresh = gpt2(seed=123)     # other random weights: the commit's must win
        resumed = attach(fresh, client=d.connect(job=JOB), name="m", resume=True)
        assert tierd.resumed_step(resumed) == 3
        opt = tierd.optim.AdamW(resumed.parameters(), lr=1e-3, weight_decay=0.01)
        assert train(resumed, opt, DATA[3:]) == want_losses[3:]
        got = resumed.state_dict()
        assert got.keys() == want_weights.keys()
        for name, value in want_weights.items():
            assert torch.equal(got[name], value), name
    finally:
        d.stop()


def test_training_process_ends_daemon_keeps_the_job_sgd_momentum_resumes(tmp_path):
    d = harness.start(tmp_path)
    try:
        ref = gpt2()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, foreach=False)
        model = attach(gpt2(), job=JOB, client=d.connect(job=JOB))   # name defaults to job
        opt = tierd.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        assert train(model, opt, DATA[:2]) == train(ref, ref_opt, DATA[:2])
        tierd.commit(model, opt, 2)
        session_of(model).client.close()   # the process ends without detaching
        again = attach(gpt2(seed=7), client=d.connect(job=JOB), name=JOB, resume=True)
        opt2 = tierd.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
        assert train(again, opt2, DATA[2:4]) == train(ref, ref_opt, DATA[2:4])
        assert_same_weights(again, ref)
    finally:
        d.stop()


def test_resume_without_a_commit_or_in_the_default_job_raises(tmp_path):
    d = harness.start(tmp_path)
    try:
        with pytest.raises(StateError, match="no commit to resume from"):
            attach(gpt2(), client=d.connect(job="never"), name="m", resume=True)
        with pytest.raises(StateError, match="default job"):
            attach(gpt2(), client=d.connect(), name="m", resume=True)
        with pytest.raises(ValueError, match="name="):
            attach(gpt2(), client=d.connect(job="never"), resume=True)
        model = attach(gpt2(), client=d.connect(job="other"), name="m")
        tierd.commit(model, None, 0)
        with pytest.raises(StateError, match="name="):
            attach(gpt2(), client=d.connect(job="other"), name="wrong", resume=True)
    finally:
        d.stop()
