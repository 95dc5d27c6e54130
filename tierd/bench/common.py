"""What every benchmark section shares: sizes, a daemon, timing, section results.

A section is a function ``(ctx) -> list[dict]`` of rows; each row names what it
measures (``what``), its configuration (``config``) and its figures. Sections
that cannot run here raise :class:`Skip` with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierd.config import ServeConfig, format_size

#: the directory that holds the ``tierd`` package being measured: a source tree,
#: or site-packages once installed. Child processes import tierd from it too.
ROOT = Path(__file__).resolve().parents[2]
GB = 1e9

#: the daemon's NVMe thread count and chunk size, read from the daemon's own code
IO_THREADS = next(f.default for f in dataclasses.fields(ServeConfig) if f.name == "io_threads")


def _daemon_chunk() -> int:
    """The piece size the daemon splits NVMe transfers into (wherever it lives)."""
    import importlib
    for module in ("tierd.backends.recordio", "tierd.backends.nvme"):
        try:
            return int(importlib.import_module(module).CHUNK)
        except (ImportError, AttributeError):
            continue
    return 8 << 20


IO_CHUNK = _daemon_chunk()


def chunks(offset: int, nbytes: int, chunk: int = IO_CHUNK):
    """(file offset, start in buffer, length) pieces of a transfer, like the daemon's."""
    for start in range(0, nbytes, chunk):
        yield offset + start, start, min(chunk, nbytes - start)


class Skip(Exception):
    """This section cannot run here; the message says why."""


class SectionTimeout(Exception):
    pass


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Everything ``--quick`` shrinks."""

    quick: bool
    disk_bytes: int           # raw O_DIRECT and daemon pool <-> NVMe
    tensor_bytes: int         # one key in the data-plane tests
    copy_bytes: int           # pinned copies and swap-in
    latency_ops: int          # round trips per latency row
    pool: int                 # daemon pool
    nvme_size: int            # daemon NVMe file
    train_steps: int          # timed steps (median) after warm-up
    warmup_steps: int
    model: str                # "gpt2-1.3b", or "tiny" (GPT-2 on CUDA, plain torch on CPU)
    batches: tuple[int, ...]
    seq: int
    case_timeout_s: float     # one worker process at most


QUICK = Sizes(quick=True, disk_bytes=64 << 20, tensor_bytes=4 << 20, copy_bytes=64 << 20,
              latency_ops=100, pool=384 << 20, nvme_size=512 << 20, train_steps=3,
              warmup_steps=1, model="tiny", batches=(2, 4), seq=64, case_timeout_s=60)
FULL = Sizes(quick=False, disk_bytes=4 << 30, tensor_bytes=64 << 20, copy_bytes=4 << 30,
             latency_ops=2000, pool=48 << 30, nvme_size=10 << 30, train_steps=3,
             warmup_steps=2, model="gpt2-1.3b", batches=(8, 16), seq=1024,
             case_timeout_s=200)


@dataclass
class Context:
    sizes: Sizes
    out: Path
    nvme_dir: Path
    deadline: float                        # monotonic; the whole run ends by then
    cuda: bool
    device_name: str
    selected: tuple[str, ...] = ()         # the sections this run measures
    daemon: object | None = None           # tierd.client.embedded.EmbeddedDaemon
    results: dict = field(default_factory=dict)   # section name -> section dict

    @property
    def model(self) -> str:
        """The model to train: on CPU the tiny one is plain torch (starts faster)."""
        return "torch-tiny" if self.sizes.model == "tiny" and not self.cuda else self.sizes.model

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def case_timeout(self, wanted: float | None = None) -> float:
        t = min(wanted or self.sizes.case_timeout_s, self.remaining() - 5)
        if t < 5:
            raise SectionTimeout("the run's time budget is spent")
        return t

    def start_daemon(self):
        """The run's one daemon (started on first need), shared by every section."""
        if self.daemon is None:
            from tierd.client.embedded import start_daemon
            from tierd.backends.memory import available_memory
            pool = min(self.sizes.pool, available_memory() // 2)
            self.daemon = start_daemon(pool=pool, nvme_size=self.sizes.nvme_size,
                                       nvme_dir=self.nvme_dir)
        return self.daemon

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


def row(what: str, config: str, **figures) -> dict:
    return {"what": what, "config": config, **figures}


def median(xs) -> float:
    return statistics.median(xs)


def percentile(xs, q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise SectionTimeout in this (main) thread after ``seconds``."""
    if seconds <= 0:
        raise SectionTimeout("the run's time budget is spent")

    def fire(signum, frame):
        raise SectionTimeout(f"section ran past its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def subprocess_env() -> dict:
    """A child's environment: it imports the same ``tierd`` as this process."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def run_worker(ctx: Context, spec: dict, timeout: float | None = None) -> dict:
    """Run ``python -m tierd.bench.worker`` on ``spec`` in a child process (its
    own CUDA context and peak-memory counters; killable at the timeout); its
    last stdout line is the JSON result."""
    timeout = ctx.case_timeout(timeout)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run([sys.executable, "-m", "tierd.bench.worker", f.name],
                              capture_output=True, text=True, timeout=timeout,
                              env=subprocess_env())
    except subprocess.TimeoutExpired as exc:
        partial = _last_json(exc.stdout)
        if partial is not None:   # the measurements it finished still count
            return {**partial, "partial": f"killed after {timeout:.0f} s"}
        return {"error": f"timed out after {timeout:.0f} s", "log": _tail(exc.stderr)}
    finally:
        os.unlink(f.name)
    result = _last_json(proc.stdout)
    if result is None:
        return {"error": f"worker exited {proc.returncode}", "log": _tail(proc.stderr)}
    if proc.returncode != 0:
        result["partial"] = f"worker exited {proc.returncode}: {_tail(proc.stderr, 500)}"
    return result


def _last_json(text) -> dict | None:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = [ln for ln in (text or "").splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return json.loads(lines[-2]) if len(lines) > 1 else None


def _tail(text, n: int = 1500) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def fmt_bytes(n: float) -> str:
    return format_size(int(n))
