"""One attempt of ``tierd.bench.bigmodel`` in a child process, watched.

The parent samples the machine's used memory (``MemTotal - MemAvailable``,
what ``psutil.virtual_memory()`` reports as ``total - available``) every
0.2 s: its peak over the attempt minus the value before it is the row's
``peak_host_gb``, which counts the worker, tierd's daemon and its pool, and
every pinned buffer. The attempt is killed (its whole process group: the
worker, an embedded daemon, compilers) when the machine's available memory
falls under the floor, so a system that needs more host memory than the
machine has ends in a row saying so instead of taking the machine down, or
when it runs past its time.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tierd.bench.bigmodel_systems import RunSpec
from tierd.bench.common import subprocess_env

GB = 1e9
GiB = 1 << 30
SAMPLE_S = 0.2
PR_SET_PDEATHSIG = 1
SCRATCH_PREFIX = "bigmodel-"
OWNER = "owner.pid"
#: after the worker reports done, how long its exit (and its daemon's) may take
EXIT_GRACE_S = 60.0


def meminfo() -> tuple[int, int]:
    """(used, available) bytes of this machine."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"] - values["MemAvailable"], values["MemAvailable"]


@dataclass(frozen=True, kw_only=True)
class Watch:
    """How an attempt is watched: its time, the host-memory floor, where it writes."""

    timeout_s: float
    host_floor_bytes: int
    log_dir: Path
    cache_root: Path   # tierd's NVMe files go under a per-attempt dir here

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (--timeout)")
        if self.host_floor_bytes < 0:
            raise ValueError(f"host_floor_bytes={self.host_floor_bytes} must be >= 0 "
                             "(--host-floor-gib)")


def run_attempt(spec: RunSpec, watch: Watch, timeout_s: float | None = None) -> dict:
    """Run ``spec`` in a worker process; its result (see ``bigmodel_worker``)
    plus ``peak_host_gb``, ``wall_s``, ``log`` and ``killed`` (why the parent
    ended it, or None)."""
    watch.log_dir.mkdir(parents=True, exist_ok=True)
    setting = "" if spec.optimizer_state == "fp32" else f"-{spec.optimizer_state}"
    recompute = "" if spec.checkpointing else "-no-ckpt"
    stem = f"{spec.model}-{spec.system}{setting}{recompute}-B{spec.batch}"
    log = watch.log_dir / f"{stem}.log"
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{stem}-",
                                    dir=_mkdir(watch.cache_root)))
    (scratch / OWNER).write_text(str(os.getpid()))   # see sweep_scratch
    spec_path, result_path = scratch / "spec.json", scratch / "result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    # tierd's embedded daemon puts its NVMe files under $TIERD_NVME (older
    # versions: $XDG_CACHE_HOME/tierd): here, so they go when the attempt does
    env = dict(subprocess_env(), TIERD_NVME=str(scratch / "nvme"),
               XDG_CACHE_HOME=str(scratch / "cache"))
    env.setdefault("TORCH_EXTENSIONS_DIR", _torch_extensions_dir())   # DeepSpeed's JIT, kept
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tierd.bench.bigmodel_worker", str(spec_path),
                 str(result_path)], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,   # its own process group: killed as one
                preexec_fn=_die_with_parent)
        try:
            watched = _watch(proc, result_path, watch, timeout_s or watch.timeout_s)
        except BaseException:   # this process is being stopped: the attempt goes first
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        result = _read(result_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**result, **watched, "log": str(log), "returncode": proc.returncode,
            "log_tail": _tail(log)}


def sweep_scratch(cache_root: Path) -> list[Path]:
    """Remove the scratch of attempts whose parent is gone (killed before it
    could: tierd's NVMe files there would fill the disk call after call)."""
    removed = []
    for path in sorted(cache_root.glob(f"{SCRATCH_PREFIX}*")):
        try:
            owner = int((path / OWNER).read_text())
        except (OSError, ValueError):
            continue   # not one of ours, or still being made
        try:
            os.kill(owner, 0)
            continue   # its bench still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _watch(proc: subprocess.Popen, result_path: Path, watch: Watch, timeout_s: float) -> dict:
    before, _ = meminfo()
    peak, lowest = before, None
    t0 = time.monotonic()
    done_at, killed = None, None
    while proc.poll() is None:
        time.sleep(SAMPLE_S)
        used, available = meminfo()
        peak = max(peak, used)
        lowest = available if lowest is None else min(lowest, available)
        now = time.monotonic()
        if available < watch.host_floor_bytes:
            killed = (f"killed: the machine's available memory fell to {available / GiB:.1f} "
                      f"GiB (floor {watch.host_floor_bytes / GiB:.1f} GiB, --host-floor-gib); "
                      f"this attempt had used {(peak - before) / GB:.1f} GB of host memory")
        elif now - t0 > timeout_s:
            killed = f"killed: ran past its {timeout_s:g} s limit (--timeout)"
        elif done_at is None and _read(result_path).get("done"):
            done_at = now
        elif done_at is not None and now - done_at > EXIT_GRACE_S:
            killed = "ended by the parent: it did not exit after finishing"
        if killed:
            break
    _stop_group(proc)
    return {"peak_host_gb": (peak - before) / GB, "wall_s": time.monotonic() - t0,
            "killed": killed if killed and not killed.startswith("ended") else None,
            "lowest_available_gib": None if lowest is None else lowest / GiB}


def _stop_group(proc: subprocess.Popen) -> None:
    """End what is left of the attempt's process group (the one this module
    made for it): the worker if still running, then any child it left (an
    embedded daemon exits on its own when its parent goes; give it a moment)."""
    pgid = proc.pid
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15.0
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(SAMPLE_S)
    if _group_alive(pgid):
        _signal_group(pgid, signal.SIGKILL)


def _die_with_parent() -> None:
    """In the worker before it runs: the kernel kills it when this process
    dies (a bench call cut off by its caller leaves no attempt running on the
    GPU; an embedded daemon follows its worker the same way)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass   # not Linux: the watch loop is then the only guard


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _tail(path: Path, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _torch_extensions_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "torch_extensions")
