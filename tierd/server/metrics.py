"""Prometheus metrics for ``tierd serve --metrics-port`` (prometheus_client).

:class:`Metrics` is what the daemon feeds: request latencies and error
replies go into prometheus_client's histogram and counter, and
:meth:`Metrics.render` adds the catalog's figures (pool, NVMe, jobs, traffic)
as metric families of that moment. :func:`serve_metrics` runs
prometheus_client's HTTP server (a thread) for as long as the daemon runs.

[Note: scrapes read the catalog on the loop]
The catalog is plain code owned by the daemon's event loop; the HTTP server
answers in its own threads. A scrape therefore asks the loop for a snapshot
(``run_coroutine_threadsafe``) and waits for it, so the figures are read
between two requests, never while one changes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tierd.errors import TierdError

log = logging.getLogger("tierd.metrics")

#: Request latency buckets in seconds: a pool hit is ~100 µs, an NVMe swap-in ms to s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)
#: Seconds a scrape waits for the daemon's loop before it fails.
SCRAPE_TIMEOUT = 10.0

_GAUGES = (("tierd_pool_bytes", "pool_bytes", "Host pool budget in bytes."),
           ("tierd_pool_used_bytes", "pool_used_bytes", "Pool bytes held by tensors."),
           ("tierd_pool_mapped_bytes", "pool_mapped_bytes",
            "Pool bytes of created shared-memory segments."),
           ("tierd_nvme_bytes", "nvme_bytes", "Bytes preallocated on the NVMe tier."),
           ("tierd_nvme_used_bytes", "nvme_used_bytes", "NVMe bytes held by tensors."),
           ("tierd_tensors", "tensors", "Tensors stored."),
           ("tierd_sessions", "sessions", "Connected client sessions."))
_JOB_GAUGES = (("tierd_job_pool_used_bytes", "pool_used_bytes",
                "Pool bytes held by a job's tensors."),
               ("tierd_job_nvme_used_bytes", "nvme_used_bytes",
                "NVMe bytes held by a job's tensors."),
               ("tierd_job_tensors", "tensors", "Tensors of a job."),
               ("tierd_job_sessions", "sessions", "Sessions in a job."))


class Snapshot:
    """Metric families of one moment: a prometheus_client collector;
    ``str()`` of it is the exposition text."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self.families)

    def __str__(self) -> str:
        return generate_latest(self).decode()   # type: ignore[arg-type]


class Metrics:
    """What the daemon observes, plus the catalog's figures on :meth:`render`.

    Example:
        >>> m = Metrics(); m.observe("lease", 0.0002); m.error("capacity")
        >>> 'tierd_errors_total{code="capacity"} 1.0' in str(m.render(stats))  # doctest: +SKIP
    """

    def __init__(self) -> None:
        # A registry of its own: two daemons in one process (tests) never share counters.
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram("tierd_request_duration_seconds",
                                 "Time from a request's arrival to its reply, by op.",
                                 ["op"], buckets=BUCKETS, registry=self.registry)
        self.errors = Counter("tierd_errors", "Error replies sent, by error code.", ["code"],
                              registry=self.registry)

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op).observe(seconds)

    def error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def render(self, stats: dict) -> Snapshot:
        """The catalog's ``stats()`` and these counters as one :class:`Snapshot`."""
        return Snapshot([*stats_families(stats), *self.registry.collect()])


def stats_families(stats: dict) -> list[Metric]:
    """The catalog's figures as gauges (sizes, per job) and counters (traffic)."""
    out: list[Metric] = [GaugeMetricFamily(name, help_, value=stats[key])
                         for name, key, help_ in _GAUGES]
    build = GaugeMetricFamily("tierd_build_info", "Always 1; the daemon's version in a label.",
                              labels=["version"])
    build.add_metric([stats.get("version", "unknown")], 1)
    out += [build, GaugeMetricFamily("tierd_uptime_seconds", "Seconds since the daemon started.",
                                     value=stats.get("uptime_s", 0))]
    jobs = sorted(stats["jobs"].items())
    for name, key, help_ in _JOB_GAUGES:
        # not "job": Prometheus sets its own job label on every scraped series
        # (the scrape job), which would rename ours to exported_job
        family = GaugeMetricFamily(name, help_, labels=["tierd_job"])
        for job, row in jobs:
            family.add_metric([job], row[key])
        out.append(family)
    moved = CounterMetricFamily("tierd_moved_bytes",
                                "Bytes moved between pool and NVMe, by direction.",
                                labels=["direction"])
    moved.add_metric(["to_nvme"], stats["bytes_to_nvme"])
    moved.add_metric(["to_pool"], stats["bytes_to_pool"])
    out += [moved,
            CounterMetricFamily("tierd_evictions", "Tensors evicted from the pool to NVMe.",
                                value=stats["evictions"]),
            CounterMetricFamily("tierd_io_errors", "Failed NVMe reads and writes.",
                                value=stats["io_errors"])]
    if "nvme_read_busy_s" in stats:   # the daemon's, beside the catalog's
        busy = CounterMetricFamily("tierd_nvme_busy_seconds",
                                   "Seconds the NVMe tier had a record in flight, by direction.",
                                   labels=["direction"])
        busy.add_metric(["read"], stats["nvme_read_busy_s"])
        busy.add_metric(["write"], stats["nvme_write_busy_s"])
        out += [busy, CounterMetricFamily(
            "tierd_catalog_seconds", "Seconds the daemon's loop spent serving requests "
            "in its catalog (time no transfer starts).", value=stats["catalog_s"])]
    return out


class _OnLoop:
    """The registry prometheus_client's server collects from: each scrape runs
    ``render`` on the daemon's loop ([Note: scrapes read the catalog on the loop])."""

    def __init__(self, loop: asyncio.AbstractEventLoop, render: Callable[[], Snapshot]) -> None:
        self.loop, self.render = loop, render

    async def _snapshot(self) -> Snapshot:
        return self.render()

    def collect(self) -> Iterable[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop)
        return future.result(SCRAPE_TIMEOUT).collect()


async def serve_metrics(host: str, port: int, render: Callable[[], Snapshot]) -> None:
    """Serve ``render()`` at ``http://host:port/metrics`` until cancelled."""
    try:
        httpd, _ = start_http_server(port, host, registry=_OnLoop(asyncio.get_running_loop(),
                                                                  render))
    except OSError as exc:
        raise TierdError(f"metrics server cannot listen on {host}:{port}: "
                         f"{exc.strerror or exc}; pick another --metrics-port") from None
    log.info("metrics at http://%s:%d/metrics", host, httpd.server_port)
    try:
        await asyncio.Event().wait()   # until the daemon's shutdown cancels this task
    finally:
        await asyncio.to_thread(httpd.shutdown)
        httpd.server_close()
