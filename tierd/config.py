"""Configuration: one dataclass per component, filled by CLI flags, ``TIERD_*``
variables and TOML.

Sizes are written like ``64MiB``, ``8GiB``, ``1.5G`` or plain bytes; booleans
as ``1/0``, ``true/false``, ``yes/no`` or ``on/off`` (anything else is an
error, never a silent false).

[Note: one description of every setting]
A daemon setting is a field of :class:`ServeConfig` and nothing else: its
annotation says how text is read (``Size``, ``int``, ``bool``, ``Path``,
``str``, ``float``, ``JobQuotas``; ``X | None`` may be unset), the string
under it is its documentation. ``tierd serve`` makes one flag per field
(``--io-threads``) with that string as help, reads ``TIERD_IO_THREADS`` and
the ``[serve]`` table's ``io_threads``, so a field added here is settable
all three ways with no other change, and ``tests/test_docs.py`` makes
docs/configuration.md list it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

Size = int
"""A byte count; read from text such as ``64MiB`` by :func:`parse_size`."""
JobQuotas = dict
"""``{job: {"pool_quota": bytes, "nvme_quota": bytes}}``; as text
``NAME.pool_quota=48GiB,NAME.nvme_quota=800GiB`` (see :func:`parse_job_quotas`)."""

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
QUOTA_SETTINGS = ("pool_quota", "nvme_quota")


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``64MiB`` (binary) or ``2GB`` (decimal).

    >>> parse_size("64MiB")
    67108864
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {text!r}; write it like 64MiB, 8GiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bool(text: str | bool | int) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case); else ValueError.

    >>> parse_bool("on"), parse_bool("No")
    (True, False)
    """
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"cannot read boolean {text!r}; write 1/0, true/false, yes/no or on/off")


def parse_job_quotas(text: str | Mapping) -> dict[str, dict[str, int]]:
    """Per-job quotas from a TOML ``[jobs]`` mapping or from text
    ``NAME.pool_quota=SIZE,NAME.nvme_quota=SIZE`` (job names may contain dots).

    >>> parse_job_quotas("llama.pool_quota=1GiB")
    {'llama': {'pool_quota': 1073741824}}
    """
    if isinstance(text, Mapping):
        bad = [job for job, table in text.items() if not isinstance(table, Mapping)]
        if bad:
            raise ValueError(f"jobs {bad} are not tables; write [jobs.NAME] with "
                             f"pool_quota and/or nvme_quota under it")
        items = [(job, k.replace("-", "_"), v) for job, table in text.items()
                 for k, v in table.items()]
    else:
        items = []
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            name, eq, value = part.partition("=")
            job, dot, setting = name.strip().rpartition(".")
            if not (eq and dot and job):
                raise ValueError(f"cannot read job quota {part!r}; write it like "
                                 f"NAME.pool_quota=48GiB,NAME.nvme_quota=800GiB")
            items.append((job, setting, value))
    quotas: dict[str, dict[str, int]] = {}
    for job, setting, value in items:
        if setting not in QUOTA_SETTINGS:
            raise ValueError(f"job {job!r}: unknown quota {setting!r}; known: "
                             f"{', '.join(QUOTA_SETTINGS)}")
        quotas.setdefault(job, {})[setting] = parse_size(value)
    return quotas


def _parse_int(text: str | int) -> int:
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"{text!r} is not a whole number")
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def _parse_float(text: str | int | float) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None


def _parse_str(text) -> str:
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not text; quote it")
    return text


#: How a value of each annotation is read from text (or checked when typed).
PARSERS = {"Size": parse_size, "int": _parse_int, "float": _parse_float, "bool": parse_bool,
           "str": _parse_str, "Path": lambda v: Path(_parse_str(v) if not isinstance(v, Path)
                                                     else v),
           "JobQuotas": parse_job_quotas}


def setting_kind(cls, name: str) -> tuple[str, bool]:
    """(annotation, may be None) of a config field, e.g. ``("int", True)``."""
    kind = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    optional = kind.endswith(" | None")
    return kind.removesuffix(" | None"), optional


def parse_setting(cls, name: str, value):
    """``value`` (text or a typed value) read as field ``name`` of ``cls``."""
    kind, optional = setting_kind(cls, name)
    if value is None or (optional and isinstance(value, str) and value.strip() == ""):
        if optional:
            return None
        raise ValueError(f"{name} must be set")
    if kind not in PARSERS:   # a typed value passes; text needs a reader in PARSERS
        if isinstance(value, str):
            raise ValueError(f"{name} ({kind}) cannot be read from text")
        return value
    return PARSERS[kind](value)


def setting_docs(cls) -> dict[str, str]:
    """Each field's documentation: the string right under it in the class body."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except (OSError, TypeError):   # no source (frozen/zipped install): flags without help text
        return {}
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


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


#: seconds a client waits for a reply before it checks what of the daemon is
#: still there (see :func:`default_request_timeout`)
REQUEST_TIMEOUT = 60.0


def default_request_timeout() -> float:
    """Seconds a client request waits for its reply before the client checks
    the daemon: ``$TIERD_REQUEST_TIMEOUT``, else 60. A request is never failed
    for being slow: when the bound passes, the client asks the daemon over its
    control socket and checks the data socket, raises DaemonUnavailable naming
    what was lost, and waits another bound while both are there (a commit or
    an eviction may take longer). ``connect(request_timeout=...)`` overrides it.

    >>> default_request_timeout()   # TIERD_REQUEST_TIMEOUT=120   # doctest: +SKIP
    120.0
    """
    text = os.environ.get("TIERD_REQUEST_TIMEOUT")
    if not text:
        return REQUEST_TIMEOUT
    return check_request_timeout(_parse_float_or_none(text), "TIERD_REQUEST_TIMEOUT", text)


def check_request_timeout(value: float | None, where: str, given: object) -> float:
    """``value`` if it is a positive number of seconds, else a ValueError naming ``where``."""
    if value is None or not value > 0 or value == float("inf"):
        raise ValueError(f"{where}={given!r}: the request timeout is a positive number of "
                         f"seconds (default {REQUEST_TIMEOUT:g})")
    return float(value)


def _parse_float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Settings of ``tierd serve``; flags, ``TIERD_*`` variables and TOML fill this.

    >>> ServeConfig(nvme="/mnt/nvme/tierd", pool="64GiB").pool
    68719476736
    """

    nvme: Path | None = None
    """Directory for the NVMe tier's preallocated data file (must be writable); required to serve."""
    pool: Size = 1 << 30
    """Host pool budget in bytes: shared memory the daemon may hand out."""
    nvme_size: Size = 16 << 30
    """Bytes preallocated for the NVMe data file."""
    socket: Path = dataclasses.field(default_factory=default_socket_path)
    """Request socket path (ZeroMQ ipc); the control socket is ``<socket>.ctl``."""
    group: str | None = None
    """Unix group (name or gid) whose members may use the daemon besides its own
    user and root: the socket directory is then 0750 and the sockets 0660 of
    that group, and each client's groups are checked when it connects; unset:
    only the daemon's user and root (directory 0700). See [Note: group access]
    in tierd.server.sockets."""
    log_level: str = "INFO"
    """Least severe log level written: DEBUG, INFO, WARNING or ERROR."""
    log_format: str = "text"
    """``text`` (one human-readable line per event) or ``json`` (one JSON object per
    line with ``ts``, ``level``, ``logger``, ``message``; for log collectors)."""
    trace: Path | None = None
    """File to append the daemon's timeline to: a JSON line per request served
    and per NVMe record moved (``python -m tierd.bench.trace_report`` reads it);
    unset: none."""
    metrics_port: int | None = None
    """TCP port for Prometheus metrics at ``/metrics``; unset: no metrics server."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds; the default keeps it local to the node."""
    segment_size: Size = 256 << 20
    """Pool memory is created per job in segments of this size (at most 1/16 of
    the pool; a larger tensor gets a segment of its own size)."""
    pool_threads: int | None = None
    """Threads making pool segments ahead while a job grows (0: each is made in
    the reserve that needs it); unset: half the cores, at most 8. With 4 or
    more they also zero the pages, so clients' first touches are done."""
    io_threads: int = 8
    """Threads doing NVMe reads and writes."""
    max_requests_per_client: int = 256
    """Requests in flight per client before it gets a Busy reply."""
    max_requests: int = 4096
    """Requests in flight in total before clients get Busy replies."""
    max_sessions_per_uid: int = 1024
    """Client sessions (connections) one uid may hold open at once; more are
    refused with Busy, so one user cannot take every descriptor of the daemon."""
    allow_root_join: bool = True
    """Whether root may join jobs created by other users."""
    default_pool_quota: Size = 0
    """Pool bytes one job may use (0: no quota); over it a job spills its own tensors."""
    default_nvme_quota: Size = 0
    """NVMe bytes one job may use (0: no quota); over it the job gets CapacityError."""
    job_quotas: JobQuotas = dataclasses.field(default_factory=dict)
    """Per-job overrides of the two quotas: the TOML file's ``[jobs.NAME]`` tables,
    or ``NAME.pool_quota=SIZE,NAME.nvme_quota=SIZE``."""

    def __post_init__(self) -> None:
        # Fields given as text (or typed) are read here, so every way of
        # building a config (CLI, TOML, code) gets the same checks.
        for f in dataclasses.fields(self):
            try:
                value = parse_setting(type(self), f.name, getattr(self, f.name))
            except ValueError as exc:
                raise ValueError(f"{f.name}: {exc}") from None
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format = {self.log_format!r}; use 'text' or 'json'")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level = {self.log_level!r}; use one of {', '.join(LOG_LEVELS)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port = {self.metrics_port} is not a TCP port (0-65535)")
        for name in ("pool", "nvme_size", "segment_size"):
            if getattr(self, name) < 4096:
                raise ValueError(f"{name} = {getattr(self, name)} B is below one page (4096 B)")
        if self.group is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?",
                                                       self.group):
            raise ValueError(f"group = {self.group!r} is not a group name or gid; write it "
                             f"like tierd or 2000")
        if self.pool_threads is not None and self.pool_threads < 0:
            raise ValueError(f"pool_threads = {self.pool_threads}; use 0 (none) or more")
        for name in ("io_threads", "max_requests_per_client", "max_requests",
                     "max_sessions_per_uid"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}; it must be at least 1")

    def quotas(self, job: str) -> tuple[int, int]:
        """(pool quota, NVMe quota) of a job, 0 meaning none."""
        table = self.job_quotas.get(job, {})
        return (table.get("pool_quota", self.default_pool_quota),
                table.get("nvme_quota", self.default_nvme_quota))

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def as_json(self) -> dict:
        """The settings as JSON-ready values (paths as text)."""
        return {k: str(v) if isinstance(v, Path) else v
                for k, v in dataclasses.asdict(self).items()}


def load_toml(path: Path) -> dict:
    """The settings of a TOML config file: its ``[serve]`` table (keys with
    ``-`` or ``_``) and its ``[jobs.NAME]`` tables as ``job_quotas``."""
    if sys.version_info >= (3, 11):   # imported here: the probes never read TOML
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    with open(path, "rb") as f:
        data = tomllib.load(f)
    unknown_tables = set(data) - {"serve", "jobs"}
    if unknown_tables:
        raise ValueError(f"unknown tables {sorted(unknown_tables)}; known: [serve], [jobs.NAME]")
    values = {k.replace("-", "_"): v for k, v in data.get("serve", {}).items()}
    unknown = set(values) - set(ServeConfig.field_names())
    if unknown:
        raise ValueError(f"unknown [serve] settings {sorted(unknown)}; "
                         f"known: {ServeConfig.field_names()}")
    if "jobs" in data:
        values["job_quotas"] = data["jobs"]
    return values


def env_name(field: str) -> str:
    """The environment variable of a setting: ``io_threads`` -> ``TIERD_IO_THREADS``."""
    return f"TIERD_{field.upper()}"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def resolve(flags: Mapping[str, object], env: Mapping[str, str],
            path: Path | None) -> ServeConfig:
    """Merge the sources, highest first: ``flags`` (field -> value, None: not
    given), ``TIERD_*`` in ``env``, the TOML file at ``path``, the defaults.
    Raises ValueError naming the source and the setting."""
    chosen: dict[str, tuple[str, object]] = {}
    if path is not None:
        try:
            table = load_toml(path)
        except (OSError, ValueError) as exc:   # TOMLDecodeError is a ValueError
            raise ValueError(f"config file {path}: {getattr(exc, 'strerror', None) or exc}"
                             ) from None
        chosen.update({k: (str(path), v) for k, v in table.items()})
    for name in ServeConfig.field_names():
        if env.get(env_name(name)) is not None:
            chosen[name] = (env_name(name), env[env_name(name)])
        if flags.get(name) is not None:
            chosen[name] = (flag_name(name), flags[name])
    values = {}
    for name, (source, raw) in chosen.items():
        try:
            values[name] = parse_setting(ServeConfig, name, raw)
        except ValueError as exc:
            raise ValueError(f"{name} (from {source}): {exc}") from None
    return ServeConfig(**values)
