"""The ``tierd`` command line: one :class:`Command` per subcommand in :data:`COMMANDS`.

Daemon settings come from, highest first: flags, ``TIERD_<NAME>``
environment variables, the ``[serve]`` table of ``--config`` (default
``$TIERD_CONFIG``, else ``/etc/tierd/tierd.toml`` when it exists), the
dataclass defaults (:mod:`tierd.config`).

The commands that talk to a running daemon (``status``, ``top``, ``health``,
``drop-job``) never import torch: a probe runs every few seconds and torch
takes a second to import. Only ``demo``, ``bench`` and ``import`` need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierd import __version__
from tierd import config as C
from tierd.errors import TierdError

DEFAULT_CONFIG = Path("/etc/tierd/tierd.toml")
DESCRIPTION = ("tierd keeps PyTorch tensors (parameters, gradients, optimizer states) of the "
               "jobs on a node in a shared host-memory pool and on NVMe.")
EPILOG = ("Run `tierd COMMAND --help` for a command's options. Daemon settings come from "
          "flags, TIERD_* variables and /etc/tierd/tierd.toml (docs/configuration.md).")
CLI_ONLY = {"config", "print_config"}   # serve options that are not ServeConfig fields


@dataclass(frozen=True)
class Command:
    """A subcommand: ``tierd --help`` lists ``name`` with ``summary``."""

    name: str
    summary: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ------------------------------------------------------------------ serve
def _serve_arguments(p: argparse.ArgumentParser) -> None:
    docs = C.setting_docs(C.ServeConfig)
    defaults = {f.name: f for f in dataclasses.fields(C.ServeConfig)}
    for name in C.ServeConfig.field_names():
        kind, _ = C.setting_kind(C.ServeConfig, name)
        default = _default_text(defaults[name], kind)
        help_ = docs.get(name, "").split(". ")[0].rstrip(".") + \
            (f" (default {default})" if default else "") + f"; ${C.env_name(name)}"
        extra = dict(nargs="?", const="true") if kind == "bool" else {}
        p.add_argument(C.flag_name(name), dest=name, metavar=_METAVARS.get(kind, "TEXT"),
                       help=help_.replace("``", "").replace("%", "%%"), **extra)
    p.add_argument("--config", type=Path,
                   help=f"TOML file (default $TIERD_CONFIG, else {DEFAULT_CONFIG} if present)")
    p.add_argument("--print-config", action="store_true",
                   help="print the merged settings as JSON and exit (needs no --nvme)")


_METAVARS = {"Size": "SIZE", "int": "N", "float": "X", "bool": "BOOL", "Path": "PATH",
             "JobQuotas": "JOB.QUOTA=SIZE,..."}


def _default_text(field, kind: str) -> str:
    if field.default is dataclasses.MISSING or field.default in (None, ""):
        return ""
    if kind == "Size":
        return "none" if field.default == 0 else C.format_size(field.default).replace(" ", "")
    return str(field.default).lower() if kind == "bool" else str(field.default)


def config_path(args: argparse.Namespace) -> Path | None:
    if getattr(args, "config", None) is not None:
        return args.config
    if os.environ.get("TIERD_CONFIG"):
        return Path(os.environ["TIERD_CONFIG"])
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def serve_config(args: argparse.Namespace) -> C.ServeConfig:
    """The merged settings of ``tierd serve``; TierdError names a bad source."""
    flags = {k: v for k, v in vars(args).items() if k not in CLI_ONLY}
    known = {C.env_name(n) for n in C.ServeConfig.field_names()} | {"TIERD_CONFIG"}
    for name in sorted(k for k in os.environ if k.startswith("TIERD_") and k not in known):
        print(f"tierd: warning: {name} is not a daemon setting (ignored); the settings are "
              f"listed by `tierd serve --help`", file=sys.stderr)
    try:
        return C.resolve(flags, os.environ, config_path(args))
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
    if args.print_config:
        print(json.dumps(cfg.as_json(), indent=2))
        return 0
    if cfg.nvme is None:
        raise TierdError("no NVMe directory: pass --nvme DIR, set TIERD_NVME or `nvme` in "
                         "the config file")
    configure_logging(cfg.log_level, cfg.log_format)
    from tierd.server.daemon import serve
    serve(cfg)
    return 0


# ------------------------------------------------------ status, top, health
def _socket_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="daemon socket (default $TIERD_SOCKET, else "
                                     "$XDG_RUNTIME_DIR/tierd/tierd.sock)")


def _status_arguments(p: argparse.ArgumentParser) -> None:
    _socket_argument(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--all", action="store_true",
                   help="also list jobs with no client connected (kept named jobs)")


def live_view(stats: dict, own_job: str, everything: bool = False) -> dict:
    """``stats`` with only the jobs a client is in (all but our own with
    ``everything``); ``idle_jobs`` counts the others and what they hold."""
    jobs = {n: j for n, j in stats["jobs"].items()
            if n != own_job and (everything or j["sessions"] > 0)}
    idle = [j for n, j in stats["jobs"].items() if n != own_job and n not in jobs]
    return dict(stats, jobs=jobs, idle_jobs={
        "jobs": len(idle), "tensors": sum(j["tensors"] for j in idle),
        "pool_used_bytes": sum(j["pool_used_bytes"] for j in idle),
        "nvme_used_bytes": sum(j["nvme_used_bytes"] for j in idle)})


def _stats(socket) -> tuple[dict, str]:
    from tierd.client.connection import connect
    with connect(socket) as c:
        return c.stats(), c.job


def cmd_status(args: argparse.Namespace) -> int:
    stats, own = _stats(args.socket)
    view = live_view(stats, own, args.all)
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True))
    else:
        print_status(view)
    return 0


def format_uptime(seconds: float) -> str:
    """``2d 3h``, ``3h 12m``, ``4m 5s``: the two largest units."""
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {s % 60}s" if m else f"{s}s"


def print_status(view: dict) -> None:
    size = C.format_size
    version = view.get("version", "unknown")
    print(f"tierd {version} up {format_uptime(view.get('uptime_s', 0))}"
          + (f" (this client is {__version__}: upgrade both together)"
             if version != __version__ else ""))
    print(f"pool  {size(view['pool_used_bytes']):>10} used of "
          f"{size(view['pool_bytes'])} ({size(view['pool_mapped_bytes'])} mapped)")
    print(f"nvme  {size(view['nvme_used_bytes']):>10} used of "
          f"{size(view['nvme_bytes'])} ({'O_DIRECT' if view['nvme_direct_io'] else 'buffered'}; "
          f"largest free extent {size(view.get('nvme_largest_free_bytes', 0))})")
    print(f"moved {size(view['bytes_to_nvme'])} to NVMe, "
          f"{size(view['bytes_to_pool'])} to pool, {view['evictions']} evictions, "
          f"{view['io_errors']} I/O errors")
    print(f"{'job':<24} {'owner':>6} {'clients':>7} {'tensors':>8} {'pool':>10} {'nvme':>10} "
          f"{'on GPUs':>10}")
    for name, j in sorted(view["jobs"].items()):
        print(f"{name:<24} {j['owner_uid']:>6} {j['sessions']:>7} {j['tensors']:>8} "
              f"{size(j['pool_used_bytes']):>10} {size(j['nvme_used_bytes']):>10} "
              f"{size(j.get('gpu_resident_bytes', 0)):>10}")
    if view.get("quarantined"):
        print(f"{len(view['quarantined'])} damaged commit manifests moved aside (their jobs "
              f"started empty): tierd status --json lists them, docs/troubleshooting.md "
              f"(IntegrityError) says what to do")
    idle = view["idle_jobs"]
    if idle["jobs"]:
        jobs = f"{idle['jobs']} job{'s' if idle['jobs'] != 1 else ''}"
        print(f"and {jobs} with no client, holding {idle['tensors']} tensors: "
              f"pool {size(idle['pool_used_bytes'])}, NVMe {size(idle['nvme_used_bytes'])} "
              f"(--all lists them)")


def _top_arguments(p: argparse.ArgumentParser) -> None:
    _socket_argument(p)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")


def cmd_top(args: argparse.Namespace) -> int:
    """``tierd status`` every ``--interval`` seconds, with transfer rates."""
    from tierd.client.connection import connect
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    with connect(args.socket) as c:
        before, then = None, time.monotonic()
        for i in itertools.count(1):
            stats, now = c.stats(), time.monotonic()
            print(f"{clear}tierd top  {time.strftime('%H:%M:%S')}  every {args.interval:g} s")
            if before is not None:
                dt = max(now - then, 1e-9)
                rate = {k: (stats[k] - before[k]) / dt
                        for k in ("bytes_to_nvme", "bytes_to_pool", "evictions")}
                print(f"rate  {C.format_size(int(rate['bytes_to_nvme']))}/s to NVMe, "
                      f"{C.format_size(int(rate['bytes_to_pool']))}/s to pool, "
                      f"{rate['evictions']:.1f} evictions/s")
            print_status(live_view(stats, c.job))
            sys.stdout.flush()
            if args.count and i >= args.count:
                return 0
            before, then = stats, now
            time.sleep(args.interval)
    return 0


def _health_arguments(p: argparse.ArgumentParser) -> None:
    _socket_argument(p)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for a reply")


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the daemon answers a stats request within ``--timeout`` and
    runs this client's version, else 1 with the reason on stderr."""
    import asyncio

    from tierd.client.connection import aconnect
    from tierd.client.embedded import resolve_socket

    choice = resolve_socket(args.socket)

    async def probe() -> dict:
        async with await aconnect(choice.path) as c:
            return await c.stats()
    try:
        stats = asyncio.run(asyncio.wait_for(probe(), args.timeout))
    except (TimeoutError, asyncio.TimeoutError):
        return _unhealthy(f"no reply from the daemon at {choice.path} within {args.timeout:g} s "
                          f"(it is stopped, hung or overloaded; raise --timeout if it is busy)")
    except (TierdError, OSError) as exc:
        return _unhealthy(_why_not(choice.path) or f"{type(exc).__name__}: {exc}")
    version = stats.get("version", "unknown (older than 0.1.0)")
    if version != __version__:
        return _unhealthy(f"wrong version: the daemon at {choice.path} runs tierd {version}, "
                          f"this client {__version__}; upgrade both together")
    print(f"ok: tierd {version} up {format_uptime(stats['uptime_s'])}, "
          f"{stats['sessions'] - 1} other sessions, pool "
          f"{C.format_size(stats['pool_used_bytes'])} of {C.format_size(stats['pool_bytes'])}, "
          f"{stats['io_errors']} I/O errors")
    return 0


def _why_not(path: Path) -> str | None:
    """Why no daemon answered at ``path``, from its control socket file alone;
    None when something listens there (the probe's own error says the rest)."""
    import socket
    ctl = path.with_name(path.name + ".ctl")
    denied = (f"permission denied on {ctl}: run as the daemon's user or, when it serves a "
              f"group (--group), as a member of it")
    try:
        if not ctl.exists():
            return (f"no daemon: {ctl} does not exist (none was started with --socket {path}, "
                    "or it stopped)")
    except PermissionError:   # a directory this user may not search
        return denied
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(ctl))
    except ConnectionRefusedError:
        return (f"refused: nothing listens on {ctl} (the daemon died without removing it; "
                "start it again)")
    except PermissionError:
        return denied
    except OSError as exc:
        return f"{ctl}: {exc.strerror or exc}"
    finally:
        probe.close()
    return None


def _unhealthy(why: str) -> int:
    print(f"tierd health: unhealthy: {why}", file=sys.stderr)
    return 1


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    _socket_argument(p)
    p.add_argument("--nvme", type=Path, help="the NVMe directory to test O_DIRECT on (default "
                                             "$TIERD_NVME, else `nvme` of the config file)")
    p.add_argument("--daemon-only", action="store_true",
                   help="skip the torch/CUDA checks (never imports torch)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print one verdict per check; exit 1 when any check FAILs."""
    from tierd import doctor
    nvme = args.nvme
    if nvme is None:
        try:
            nvme = C.resolve({}, os.environ, config_path(args)).nvme
        except (TypeError, ValueError):
            nvme = None   # a broken config is serve's to report; test nothing here
    checks = doctor.report(args.socket, nvme, daemon_only=args.daemon_only)
    if args.json:
        print(json.dumps(doctor.as_json(checks), indent=2))
    else:
        for c in checks:
            print(doctor.format_check(c))
    return 1 if any(c.verdict == doctor.FAIL for c in checks) else 0


# ------------------------------------------------------ jobs and archives
def _drop_job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the job's name")
    _socket_argument(p)


def cmd_drop_job(args: argparse.Namespace) -> int:
    from tierd.client.connection import connect
    with connect(args.socket, job=args.name) as c:
        n = len(c.keys())
        c.drop_job()
    print(f"dropped job {args.name!r} ({n} tensors)")
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="the named job whose last commit to write")
    p.add_argument("--out", required=True, type=Path, help="the .safetensors file to write")
    p.add_argument("--tag", help="fail unless the last commit has this tag")
    p.add_argument("--prefix", default="", help="only keys under it, with it stripped")
    p.add_argument("--nvme", type=Path, help="the daemon's NVMe directory (default $TIERD_NVME, "
                                             "else `nvme` of the config file)")
    p.add_argument("--config", type=Path, help=f"TOML file to read `nvme` from (default "
                                               f"$TIERD_CONFIG, else {DEFAULT_CONFIG})")


def cmd_export(args: argparse.Namespace) -> int:
    from tierd.archive import export_job
    nvme = args.nvme or serve_config(argparse.Namespace(config=args.config)).nvme
    if nvme is None:
        raise TierdError("no NVMe directory: pass --nvme DIR (the daemon's), set TIERD_NVME "
                         "or `nvme` in the config file")
    n, nbytes = export_job(Path(nvme), args.job, args.out, args.tag, args.prefix)
    print(f"exported {n} tensors ({C.format_size(nbytes)}) of job {args.job!r} to {args.out}")
    return 0


def _import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", type=Path, help="the .safetensors file to read")
    p.add_argument("--job", required=True, help="the named job to put the tensors in")
    p.add_argument("--tag", default="import", help="tag of the commit (default import)")
    p.add_argument("--prefix", default="", help="prepended to every tensor name")
    _socket_argument(p)


def cmd_import(args: argparse.Namespace) -> int:
    from tierd.archive import import_file
    info = import_file(args.socket, args.job, args.file, args.tag, args.prefix)
    print(f"imported {info['tensors']} tensors into job {args.job!r}, committed as {args.tag!r}")
    return 0


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from tierd.demo import add_arguments
    add_arguments(p)


def cmd_demo(args: argparse.Namespace) -> int:
    from tierd.demo.run import cmd_demo as run_demo
    return run_demo(args)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from tierd.bench import add_arguments
    add_arguments(p)


def cmd_bench(args: argparse.Namespace) -> int:
    from tierd.bench.run import cmd_bench as run_bench
    return run_bench(args)


COMMANDS: tuple[Command, ...] = (
    Command("serve", "run the node daemon (pool + NVMe tier) until SIGTERM",
            _serve_arguments, cmd_serve),
    Command("status", "print pool/NVMe use, traffic and the jobs with clients",
            _status_arguments, cmd_status),
    Command("top", "tierd status, refreshed every --interval seconds, with rates",
            _top_arguments, cmd_top),
    Command("health", "exit 0 if the daemon answers, 1 if not (for probes)",
            _health_arguments, cmd_health),
    Command("doctor", "check this node for tierd: versions, socket, limits, CUDA",
            _doctor_arguments, cmd_doctor),
    Command("drop-job", "delete every tensor and the commit of a named job",
            _drop_job_arguments, cmd_drop_job),
    Command("export", "write a job's last commit as a .safetensors file",
            _export_arguments, cmd_export),
    Command("import", "put a .safetensors file's tensors in a job and commit them",
            _import_arguments, cmd_import),
    Command("demo", "fine-tune a small GPT-2 with every tensor in tierd",
            _demo_arguments, cmd_demo),
    Command("bench", "measure tierd against this machine's limits and the peers",
            _bench_arguments, cmd_bench),
)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) that points at ``--help``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = Parser(prog="tierd", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"tierd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands", parser_class=Parser)
    for cmd in commands:
        cmd.arguments(sub.add_parser(cmd.name, help=cmd.summary, description=cmd.summary))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:   # the command's own help lists what it takes
        parser.exit(2, f"tierd {args.command}: error: unrecognized arguments: "
                       f"{' '.join(extra)}; see `tierd {args.command} --help`\n")
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = {c.name: c.run for c in COMMANDS}[args.command]
    try:
        return run(args)
    except TierdError as exc:
        print(f"tierd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
