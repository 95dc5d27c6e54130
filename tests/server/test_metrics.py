"""``--metrics-port``: Prometheus text from a live daemon (prometheus_client's server)."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tierd.errors import UnknownKey

NAMES = {"tierd_pool_bytes", "tierd_pool_used_bytes", "tierd_nvme_bytes",
         "tierd_nvme_used_bytes", "tierd_job_pool_used_bytes", "tierd_job_nvme_used_bytes",
         "tierd_moved_bytes", "tierd_evictions", "tierd_io_errors", "tierd_errors",
         "tierd_request_duration_seconds", "tierd_nvme_busy_seconds", "tierd_catalog_seconds"}


def metrics_url(daemon) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(r"metrics at (http://[0-9.]+:\d+/metrics)", daemon.output())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(f"no metrics line in the log:\n{daemon.output()}")


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    for s in families[family].samples:
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no {sample or family}{labels} in {families[family].samples}")


@pytest.fixture
def metered(daemon_factory):
    return daemon_factory(pool="16MiB", extra=("--segment-size", "4MiB", "--metrics-port", "0"))


def test_metrics_endpoint_serves_prometheus_text_with_the_named_metrics(metered):
    url = metrics_url(metered)
    assert url.startswith("http://127.0.0.1:")     # local unless configured otherwise
    with metered.connect(job="metrics-test") as c:
        for i in range(4):                         # 24 MiB into a 16 MiB pool: spills
            c.put(f"t{i}", torch.full(((6 << 20) // 4,), float(i)))
        assert torch.equal(c.get("t0"), torch.full(((6 << 20) // 4,), 0.0))   # back from NVMe
        with pytest.raises(UnknownKey):
            c.get("missing")
        families = scrape(url)
    assert NAMES <= set(families), sorted(NAMES - set(families))
    assert families["tierd_request_duration_seconds"].type == "histogram"
    assert value(families, "tierd_pool_bytes") == 16 << 20
    assert value(families, "tierd_moved_bytes", "tierd_moved_bytes_total",
                 direction="to_nvme") > 0
    assert value(families, "tierd_moved_bytes", "tierd_moved_bytes_total",
                 direction="to_pool") > 0
    assert value(families, "tierd_evictions", "tierd_evictions_total") > 0
    for direction in ("read", "write"):   # the spill and the read back took disk time
        assert value(families, "tierd_nvme_busy_seconds", "tierd_nvme_busy_seconds_total",
                     direction=direction) > 0
    assert value(families, "tierd_catalog_seconds", "tierd_catalog_seconds_total") > 0
    assert value(families, "tierd_errors", "tierd_errors_total", code="key") >= 1
    assert value(families, "tierd_job_pool_used_bytes", tierd_job="metrics-test") > 0
    assert value(families, "tierd_job_nvme_used_bytes", tierd_job="metrics-test") > 0
    hist = families["tierd_request_duration_seconds"]
    ops = {s.labels["op"] for s in hist.samples}
    assert {"reserve", "publish", "lease"} <= ops, ops
    for op in ops:
        count = value(families, hist.name, hist.name + "_count", op=op)
        assert count > 0
        assert value(families, hist.name, hist.name + "_bucket", op=op, le="+Inf") == count


def test_metrics_follow_the_jobs(metered):
    url = metrics_url(metered)
    with metered.connect(job="short-lived") as c:
        c.put("x", torch.zeros(1024))
        assert value(scrape(url), "tierd_job_tensors", tierd_job="short-lived") == 1
        c.delete(["x"])
        assert value(scrape(url), "tierd_job_tensors", tierd_job="short-lived") == 0


def test_metrics_server_stops_with_the_daemon(metered):
    url = metrics_url(metered)
    assert "tierd_pool_bytes" in scrape(url)
    assert metered.stop() == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=10)
