"""Prometheus text metrics for ``tierd serve --metrics-port``.

:class:`Metrics` is plain code: the daemon observes request latencies and
errors into it, and :meth:`Metrics.render` turns those plus the catalog's
stats into the text exposition format (version 0.0.4). :func:`serve_metrics`
is the thin asyncio adapter: a minimal HTTP/1.0 server answering
``GET /metrics``, bound to 127.0.0.1 unless configured otherwise.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable

from tierd.errors import TierdError

log = logging.getLogger("tierd.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Request latency buckets in seconds: a pool hit is ~100 µs, an NVMe swap-in ms to s.
BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
           0.5, 1.0, 2.5, 5.0, 10.0)
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT = 5.0


class Histogram:
    """Cumulative-on-render latency histogram with the fixed :data:`BUCKETS`."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)   # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds


class Metrics:
    """Counters the daemon feeds; ``render(stats)`` writes the exposition text.

    Example:
        >>> m = Metrics(); m.observe("lease", 0.0002); m.error("capacity")
        >>> "tierd_errors_total{code=\\"capacity\\"} 1" in m.render(stats)   # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}
        self.errors: dict[str, int] = {}

    def observe(self, op: str, seconds: float) -> None:
        self.latency.setdefault(op, Histogram()).observe(seconds)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def render(self, stats: dict) -> str:
        """The exposition text for the catalog's ``stats()`` and these counters."""
        out: list[str] = []
        gauge = _family(out, "gauge")
        counter = _family(out, "counter")
        gauge("tierd_pool_bytes", "Host pool budget in bytes.", [({}, stats["pool_bytes"])])
        gauge("tierd_pool_used_bytes", "Pool bytes held by tensors.",
              [({}, stats["pool_used_bytes"])])
        gauge("tierd_pool_mapped_bytes", "Pool bytes of created shared-memory segments.",
              [({}, stats["pool_mapped_bytes"])])
        gauge("tierd_nvme_bytes", "Bytes preallocated on the NVMe tier.",
              [({}, stats["nvme_bytes"])])
        gauge("tierd_nvme_used_bytes", "NVMe bytes held by tensors.",
              [({}, stats["nvme_used_bytes"])])
        gauge("tierd_tensors", "Tensors stored.", [({}, stats["tensors"])])
        gauge("tierd_sessions", "Connected client sessions.", [({}, stats["sessions"])])
        jobs = sorted(stats["jobs"].items())
        for name, key, help_ in (("tierd_job_pool_used_bytes", "pool_used_bytes",
                                  "Pool bytes held by a job's tensors."),
                                 ("tierd_job_nvme_used_bytes", "nvme_used_bytes",
                                  "NVMe bytes held by a job's tensors."),
                                 ("tierd_job_tensors", "tensors", "Tensors of a job."),
                                 ("tierd_job_sessions", "sessions", "Sessions in a job.")):
            gauge(name, help_, [({"job": j}, row[key]) for j, row in jobs])
        counter("tierd_moved_bytes_total", "Bytes moved between pool and NVMe, by direction.",
                [({"direction": "to_nvme"}, stats["bytes_to_nvme"]),
                 ({"direction": "to_pool"}, stats["bytes_to_pool"])])
        counter("tierd_evictions_total", "Tensors evicted from the pool to NVMe.",
                [({}, stats["evictions"])])
        counter("tierd_io_errors_total", "Failed NVMe reads and writes.",
                [({}, stats["io_errors"])])
        counter("tierd_errors_total", "Error replies sent, by error code.",
                [({"code": c}, n) for c, n in sorted(self.errors.items())])
        self._render_latency(out)
        return "\n".join(out) + "\n"

    def _render_latency(self, out: list[str]) -> None:
        name = "tierd_request_duration_seconds"
        out.append(f"# HELP {name} Time from a request's arrival to its reply, by op.")
        out.append(f"# TYPE {name} histogram")
        for op, h in sorted(self.latency.items()):
            running = 0
            for bound, n in zip((*map(repr, BUCKETS), "+Inf"), h.counts):
                running += n
                out.append(f"{name}_bucket{_labels({'op': op, 'le': bound})} {running}")
            out.append(f"{name}_sum{_labels({'op': op})} {h.sum!r}")
            out.append(f"{name}_count{_labels({'op': op})} {running}")


def _family(out: list[str], kind: str):
    def add(name: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{_labels(labels)} {value}" for labels, value in samples)
    return add


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


async def serve_metrics(host: str, port: int, render: Callable[[], str]) -> None:
    """Answer ``GET /metrics`` with ``render()`` until cancelled."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET":
                status, body = "405 Method Not Allowed", "only GET\n"
            elif path.split("?", 1)[0] != "/metrics":
                status, body = "404 Not Found", "metrics are at /metrics\n"
            else:
                status, body = "200 OK", render()
            data = body.encode()
            writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
                         .encode() + data)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            pass   # a bad or slow scraper only loses its own connection
        finally:
            writer.close()

    try:
        server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)
    except OSError as exc:
        raise TierdError(f"metrics server cannot listen on {host}:{port}: {exc.strerror}; "
                         f"pick another --metrics-port") from None
    bound = server.sockets[0].getsockname()
    log.info("metrics at http://%s:%d/metrics", bound[0], bound[1])
    async with server:
        await asyncio.Event().wait()   # until the daemon's shutdown cancels this task
