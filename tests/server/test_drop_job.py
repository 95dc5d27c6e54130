"""``drop-job``: an unknown job is an error; a dropped job leaves status and /metrics."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.conftest import tierd_command, subprocess_env
from tests.server.test_catalog import catalog  # noqa: F401  (fixture)
from tests.server.test_metrics import metrics_url, scrape
from tierd.errors import UnknownKey


def _cli(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(tierd_command(*args, "--socket", str(daemon.socket)),
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)


def _metric_jobs(url: str) -> set[str]:
    fam = scrape(url)["tierd_job_tensors"]
    return {s.labels["tierd_job"] for s in fam.samples}


def test_catalog_refuses_to_drop_a_job_only_the_caller_opened(catalog):  # noqa: F811
    catalog.open_session(1, "nosuch", pid=10, uid=1000)
    with pytest.raises(UnknownKey, match="no job 'nosuch'"):
        catalog.drop_job("nosuch")
    catalog.close_session(1)
    assert "nosuch" not in catalog.jobs            # a name with nothing in it is forgotten
    with pytest.raises(UnknownKey, match="no job 'never'"):
        catalog.drop_job("never")


def test_catalog_drops_a_job_another_client_is_in(catalog):  # noqa: F811
    catalog.open_session(1, "shared", pid=10, uid=1000)
    catalog.open_session(2, "shared", pid=11, uid=1000)   # known: someone else is in it
    catalog.drop_job("shared")
    catalog.close_session(1)
    catalog.close_session(2)
    assert "shared" not in catalog.jobs


@pytest.fixture
def metered(daemon_factory):
    return daemon_factory(extra=("--metrics-port", "0"))


def test_drop_job_of_an_unknown_job_fails_and_leaves_no_trace(metered):
    proc = _cli(metered, "drop-job", "nosuch")
    assert proc.returncode == 2
    assert "no job 'nosuch'" in proc.stderr and "dropped" not in proc.stdout
    status = json.loads(_cli(metered, "status", "--all", "--json").stdout)
    assert "nosuch" not in status["jobs"]
    assert "nosuch" not in _metric_jobs(metrics_url(metered))


def test_a_dropped_job_disappears_from_status_and_metrics(metered):
    url = metrics_url(metered)
    with metered.connect(job="run1") as c:
        c.put("w", torch.ones(16))
    assert "run1" in json.loads(_cli(metered, "status", "--all", "--json").stdout)["jobs"]
    assert "run1" in _metric_jobs(url)
    proc = _cli(metered, "drop-job", "run1")
    assert proc.returncode == 0 and "dropped job 'run1' (1 tensors)" in proc.stdout, proc.stderr
    assert "run1" not in json.loads(_cli(metered, "status", "--all", "--json").stdout)["jobs"]
    assert "run1" not in _metric_jobs(url)
