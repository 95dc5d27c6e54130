"""The ``tierd`` command: ``serve``, ``status``.

Settings come from, in order of precedence: flags, ``TIERD_<NAME>``
environment variables, the ``[serve]`` table of ``--config`` (default
``/etc/tierd/tierd.toml`` when it exists), the dataclass defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import itertools
import os
import sys
import time
from pathlib import Path

from tierd.config import ServeConfig, default_socket_path, format_size, load_toml
from tierd.errors import TierdError

DEFAULT_CONFIG = Path("/etc/tierd/tierd.toml")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the node daemon")
    p.add_argument("--nvme", help="directory for the NVMe tier (required)")
    p.add_argument("--pool", help="host pool size, e.g. 8GiB (default 1GiB)")
    p.add_argument("--nvme-size", help="bytes preallocated on NVMe (default 16GiB)")
    p.add_argument("--socket", help=f"socket path (default {default_socket_path()})")
    p.add_argument("--segment-size", help="pool segment size (default 256MiB)")
    p.add_argument("--io-threads", type=int, help="NVMe I/O threads (default 8)")
    p.add_argument("--default-pool-quota", help="pool bytes per job, e.g. 8GiB (default: none)")
    p.add_argument("--default-nvme-quota", help="NVMe bytes per job (default: none)")
    p.add_argument("--config", type=Path, help=f"TOML file (default {DEFAULT_CONFIG} if present)")
    p.add_argument("--print-config", action="store_true", help="print the merged settings and exit")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines (default text)")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default off)")
    p.add_argument("--metrics-host", help="address of the metrics server (default 127.0.0.1)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    values: dict = {}
    path = args.config or (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    if path is not None:
        try:
            values.update(load_toml(path))
        except (OSError, ValueError) as exc:   # TOMLDecodeError is a ValueError
            raise TierdError(f"config file {path}: {exc}") from None
    for name in ServeConfig.field_names():
        if name == "job_quotas":
            continue  # only the config file's [jobs.NAME] tables set these
        env = os.environ.get(f"TIERD_{name.upper()}")
        if env is not None:
            values[name] = env
        flag = getattr(args, name, None)
        if flag is not None:
            values[name] = flag
    if "nvme" not in values:
        raise TierdError("--nvme DIR is required (the directory for the NVMe tier)")
    for name in ("io_threads", "max_requests_per_client", "max_requests", "metrics_port"):
        if name in values:
            try:
                values[name] = int(values[name])
            except ValueError:
                raise TierdError(f"{name} = {values[name]!r} is not a whole number") from None
    if isinstance(values.get("allow_root_join"), str):
        values["allow_root_join"] = values["allow_root_join"].lower() in ("1", "true", "yes")
    try:
        return ServeConfig(**values)
    except (TypeError, ValueError) as exc:
        raise TierdError(str(exc)) from None


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``message`` (+ ``exc``)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": round(record.created, 6), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str, log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args)
    configure_logging(args.log_level, cfg.log_format)
    if args.print_config:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v
                          for k, v in dataclasses.asdict(cfg).items()}, indent=2))
        return 0
    from tierd.server.daemon import serve
    serve(cfg)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import tierd
    with tierd.connect(args.socket) as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    print_status(stats)
    return 0


def print_status(stats: dict) -> None:
    print(f"pool  {format_size(stats['pool_used_bytes']):>10} used of "
          f"{format_size(stats['pool_bytes'])} ({format_size(stats['pool_mapped_bytes'])} mapped)")
    print(f"nvme  {format_size(stats['nvme_used_bytes']):>10} used of "
          f"{format_size(stats['nvme_bytes'])} ({'O_DIRECT' if stats['nvme_direct_io'] else 'buffered'})")
    print(f"moved {format_size(stats['bytes_to_nvme'])} to NVMe, "
          f"{format_size(stats['bytes_to_pool'])} to pool, {stats['evictions']} evictions, "
          f"{stats['io_errors']} I/O errors")
    print(f"{'job':<24} {'owner':>6} {'clients':>7} {'tensors':>8} {'pool':>10} {'nvme':>10}")
    for name, j in sorted(stats["jobs"].items()):
        print(f"{name:<24} {j['owner_uid']:>6} {j['sessions']:>7} {j['tensors']:>8} "
              f"{format_size(j['pool_used_bytes']):>10} {format_size(j['nvme_used_bytes']):>10}")


def cmd_top(args: argparse.Namespace) -> int:
    """``tierd status`` every ``--interval`` seconds, with transfer rates."""
    import tierd
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    with tierd.connect(args.socket) as c:
        before, then = None, time.monotonic()
        for i in itertools.count(1):
            stats, now = c.stats(), time.monotonic()
            print(f"{clear}tierd top  {time.strftime('%H:%M:%S')}  every {args.interval:g} s")
            if before is not None:
                dt = max(now - then, 1e-9)
                rate = {k: (stats[k] - before[k]) / dt
                        for k in ("bytes_to_nvme", "bytes_to_pool", "evictions")}
                print(f"rate  {format_size(int(rate['bytes_to_nvme']))}/s to NVMe, "
                      f"{format_size(int(rate['bytes_to_pool']))}/s to pool, "
                      f"{rate['evictions']:.1f} evictions/s")
            print_status(stats)
            sys.stdout.flush()
            if args.count and i >= args.count:
                return 0
            before, then = stats, now
            time.sleep(args.interval)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the daemon answers a stats request within ``--timeout``, else 1."""
    import asyncio

    import tierd

    async def probe() -> dict:
        async with await tierd.aconnect(args.socket) as c:
            return await c.stats()
    try:
        stats = asyncio.run(asyncio.wait_for(probe(), args.timeout))
    except (TierdError, TimeoutError, asyncio.TimeoutError, OSError) as exc:
        print(f"tierd health: unhealthy: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    print(f"ok: {stats['sessions']} sessions, pool {format_size(stats['pool_used_bytes'])} "
          f"of {format_size(stats['pool_bytes'])}, {stats['io_errors']} I/O errors")
    return 0


def cmd_drop_job(args: argparse.Namespace) -> int:
    import tierd
    with tierd.connect(args.socket, job=args.name) as c:
        n = len(c.keys())
        c.drop_job()
    print(f"dropped job {args.name!r} ({n} tensors)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tierd.archive import export_job
    n, nbytes = export_job(Path(args.nvme), args.job, Path(args.out), args.tag, args.prefix)
    print(f"exported {n} tensors ({format_size(nbytes)}) of job {args.job!r} to {args.out}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tierd.archive import import_file
    info = import_file(args.socket, args.job, Path(args.file), args.tag, args.prefix)
    print(f"imported {info['tensors']} tensors into job {args.job!r}, committed as {args.tag!r}")
    return 0


def _archive_parsers(sub) -> None:
    ex = sub.add_parser("export", help="write a job's last commit as a .safetensors file")
    ex.add_argument("--job", required=True)
    ex.add_argument("--out", required=True, help="the .safetensors file to write")
    ex.add_argument("--tag", help="fail unless the last commit has this tag")
    ex.add_argument("--prefix", default="", help="only keys under it, with it stripped")
    ex.add_argument("--nvme", default=os.environ.get("TIERD_NVME"),
                    required=not os.environ.get("TIERD_NVME"), help="the daemon's --nvme dir")
    im = sub.add_parser("import", help="put a .safetensors file's tensors in a job and commit")
    im.add_argument("file")
    im.add_argument("--job", required=True)
    im.add_argument("--tag", default="import", help="tag of the commit (default import)")
    im.add_argument("--prefix", default="", help="prepended to every tensor name")
    im.add_argument("--socket", help="daemon socket (default $TIERD_SOCKET or the standard path)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    st = sub.add_parser("status", help="print the daemon's pool/NVMe use and jobs")
    st.add_argument("--socket", help="daemon socket (default $TIERD_SOCKET or the standard path)")
    st.add_argument("--json", action="store_true")
    top = sub.add_parser("top", help="tierd status, refreshed every --interval seconds")
    top.add_argument("--socket", help="daemon socket (default $TIERD_SOCKET or the standard path)")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    top.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    health = sub.add_parser("health", help="exit 0 if the daemon answers, 1 if not (probes)")
    health.add_argument("--socket",
                        help="daemon socket (default $TIERD_SOCKET or the standard path)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")
    dj = sub.add_parser("drop-job", help="delete every tensor of a named job")
    dj.add_argument("name")
    dj.add_argument("--socket", help="daemon socket (default $TIERD_SOCKET or the standard path)")
    _archive_parsers(sub)
    from tierd.demo import run as demo
    demo.add_parser(sub)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from tierd.demo.run import cmd_demo as run_demo
    return run_demo(args)


COMMANDS = {"serve": cmd_serve, "status": cmd_status, "demo": cmd_demo, "top": cmd_top,
            "health": cmd_health, "drop-job": cmd_drop_job, "export": cmd_export,
            "import": cmd_import}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except TierdError as exc:
        print(f"tierd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
