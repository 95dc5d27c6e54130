"""Configuration: one dataclass per component, filled by CLI flags and TOML.

Sizes are written like ``64MiB``, ``8GiB``, ``1.5G`` or plain bytes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``64MiB`` (binary) or ``2GB`` (decimal).

    >>> parse_size("64MiB")
    67108864
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write it like 64MiB, 8GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def default_socket_path() -> Path:
    """``$TIERD_SOCKET``, else ``$XDG_RUNTIME_DIR/tierd/tierd.sock``, else
    ``/tmp/tierd-$UID/tierd.sock``."""
    if os.environ.get("TIERD_SOCKET"):
        return Path(os.environ["TIERD_SOCKET"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "tierd" / "tierd.sock"
    return Path(f"/tmp/tierd-{os.getuid()}") / "tierd.sock"


@dataclass(kw_only=True)
class ServeConfig:
    """Settings of ``tierd serve``; the CLI and ``--config`` TOML fill this."""

    nvme: Path
    """Directory for the NVMe tier's preallocated data file (must be writable)."""
    pool: int = 1 << 30
    """Host pool budget in bytes: shared memory the daemon may hand out."""
    nvme_size: int = 16 << 30
    """Bytes preallocated for the NVMe data file."""
    socket: Path = dataclasses.field(default_factory=default_socket_path)
    """Request socket path (ZeroMQ ipc); the control socket is ``<socket>.ctl``."""
    log_format: str = "text"
    """``text`` (one human-readable line per event) or ``json`` (one JSON object per
    line with ``ts``, ``level``, ``logger``, ``message``; for log collectors)."""
    metrics_port: int | None = None
    """TCP port for Prometheus text metrics at ``/metrics``; unset: no metrics server."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds; the default keeps it local to the node."""
    segment_size: int = 256 << 20
    """Pool memory is created per job in segments of this size (at most 1/16 of
    the pool; a larger tensor gets a segment of its own size)."""
    io_threads: int = 8
    """Threads doing NVMe reads and writes."""
    max_requests_per_client: int = 256
    """Requests in flight per client before it gets a Busy reply."""
    max_requests: int = 4096
    """Requests in flight in total before clients get Busy replies."""
    allow_root_join: bool = True
    """Whether root may join jobs created by other users."""
    default_pool_quota: int = 0
    """Pool bytes one job may use (0: no quota); over it a job spills its own tensors."""
    default_nvme_quota: int = 0
    """NVMe bytes one job may use (0: no quota); over it the job gets CapacityError."""
    job_quotas: dict = dataclasses.field(default_factory=dict)
    """Per-job overrides: the TOML file's ``[jobs.NAME]`` tables with
    ``pool_quota`` and/or ``nvme_quota``."""

    def __post_init__(self) -> None:
        self.nvme = Path(self.nvme)
        self.socket = Path(self.socket)
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format = {self.log_format!r}; use 'text' or 'json'")
        if self.metrics_port is not None and not 0 <= int(self.metrics_port) < 65536:
            raise ValueError(f"metrics_port = {self.metrics_port} is not a TCP port (0-65535)")
        for name in ("pool", "nvme_size", "segment_size"):
            setattr(self, name, parse_size(getattr(self, name)))
            if getattr(self, name) < 4096:
                raise ValueError(f"{name} = {getattr(self, name)} B is below one page (4096 B)")
        for name in ("io_threads", "max_requests_per_client", "max_requests"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1")
        self.default_pool_quota = parse_size(self.default_pool_quota)
        self.default_nvme_quota = parse_size(self.default_nvme_quota)
        for job, table in self.job_quotas.items():
            unknown = set(table) - {"pool_quota", "nvme_quota"}
            if unknown:
                raise ValueError(f"[jobs.{job}]: unknown settings {sorted(unknown)}; "
                                 f"known: pool_quota, nvme_quota")
            self.job_quotas[job] = {k: parse_size(v) for k, v in table.items()}

    def quotas(self, job: str) -> tuple[int, int]:
        """(pool quota, NVMe quota) of a job, 0 meaning none."""
        table = self.job_quotas.get(job, {})
        return (table.get("pool_quota", self.default_pool_quota),
                table.get("nvme_quota", self.default_nvme_quota))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def load_toml(path: Path) -> dict:
    """The ``[serve]`` table of a TOML config file, keys with ``-`` as ``_``."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    table = data.get("serve", {})
    unknown = set(k.replace("-", "_") for k in table) - set(ServeConfig.field_names())
    if unknown:
        raise ValueError(f"{path}: unknown [serve] settings {sorted(unknown)}; "
                         f"known: {ServeConfig.field_names()}")
    values = {k.replace("-", "_"): v for k, v in table.items()}
    if "jobs" in data:
        values["job_quotas"] = {job: {k.replace("-", "_"): v for k, v in t.items()}
                                for job, t in data["jobs"].items()}
    return values
