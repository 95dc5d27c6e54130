"""Where the host's time goes, for a bench row's diagnostics. On a GPU the
host bounds a streamed step when it cannot queue copies and kernels ahead of
the device; these say which Python (tierd's, torch's, the model's) and which
blocking calls (event and stream synchronizes, allocations that free the
allocator's cache) take that time.

- :func:`host_profile`: a cProfile of steps back to back, ranked. cProfile
  roughly doubles the cost of Python-heavy code: read the ranking, not the
  seconds.
- :class:`Sampler`: the lines one thread is on, sampled from a helper thread
  every few milliseconds: cheap enough to leave a timed step's time as it is
  (a measuring first step, say), and it sees a blocking call as the line
  that made it."""

from __future__ import annotations

import cProfile
import pstats
import sys
import threading
import time
from collections import Counter


def _short(path: str) -> str:
    """A source path from its package's directory on, else its file name.

    >>> _short("/venv/site-packages/torch/utils/checkpoint.py"), _short("/x/y.py")
    ('torch/utils/checkpoint.py', 'y.py')
    """
    for root in ("/tierd/", "/torch/", "/transformers/"):
        if root in path:
            return path[path.rfind(root) + 1:]
    return path.rsplit("/", 1)[-1]


def _name(func: tuple[str, int, str]) -> str:
    """'tierd/client/hooks.py:120 pre_forward', or '{built-in ...}'."""
    path, line, name = func
    return name if path == "~" else f"{_short(path)}:{line} {name}"


def ranked(stats: pstats.Stats, steps: int, top: int = 25) -> dict:
    """The ``top`` functions by own time and tierd's by cumulative time, each
    [name, calls, seconds] per step (own seconds first, then cumulative)."""
    rows = [(_name(f), nc, tt / steps, ct / steps)
            for f, (_, nc, tt, ct, _) in stats.stats.items()]
    own = sorted(rows, key=lambda r: -r[2])[:top]
    mine = sorted((r for r in rows if r[0].startswith("tierd/")), key=lambda r: -r[3])[:top]
    return {"own": [[n, c // steps, round(t, 4), round(cum, 4)] for n, c, t, cum in own],
            "tierd_cumulative": [[n, c // steps, round(t, 4), round(cum, 4)]
                                 for n, c, t, cum in mine]}


def host_profile(fn, steps: int = 2, sync=None, top: int = 25) -> dict:
    """Profile ``steps`` calls of ``fn`` back to back (then ``sync()``, if
    given, inside the profile): the wall seconds a step under the profiler
    and :func:`ranked`.

    >>> out = host_profile(lambda: sum(range(1000)), steps=2, top=3)
    >>> out["steps"], len(out["own"]) <= 3, out["wall_s"] >= 0
    (2, True, True)
    """
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    try:   # a diagnostic: the row stands without it
        prof.enable()
    except ValueError as exc:   # another profiler is active
        return {"error": f"profiling the host: {exc}"[:300]}
    try:
        for _ in range(steps):
            fn()
        if sync is not None:
            sync()
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    return {"steps": steps, "wall_s": round(wall / steps, 4),
            **ranked(pstats.Stats(prof), steps, top)}


class Sampler:
    """Samples the Python stack of the thread that makes it, every
    ``interval`` seconds, while entered; :meth:`top` ranks the lines it was on
    (the innermost frame: a blocking call shows as the line that made it),
    the innermost tierd frames, and the chains of tierd frames that called
    them (``depth`` deep: who made the blocking call), in seconds (samples x
    interval).

    >>> def wait():
    ...     time.sleep(0.05)   # a blocking call: sampled as this line
    >>> with Sampler(0.001) as s:
    ...     wait()
    >>> top = s.top(3); top["samples"] > 10, top["lines"][0][0].endswith(":2 wait")
    (True, True)
    """

    def __init__(self, interval: float = 0.005, depth: int = 4):
        self.interval, self.depth = interval, depth
        self.target = threading.get_ident()
        self.lines: Counter = Counter()
        self.tierd: Counter = Counter()
        self.stacks: Counter = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tierd-bench-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.target)
            if frame is None:
                continue
            self.samples += 1
            code = frame.f_code
            self.lines[f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}"] += 1
            chain = []
            while frame is not None and len(chain) < self.depth:
                path = frame.f_code.co_filename
                if "/tierd/bench/" in path:
                    break
                if "/tierd/" in path:
                    chain.append(f"{_short(path)}:{frame.f_lineno} {frame.f_code.co_name}")
                frame = frame.f_back
            if chain:
                self.tierd[chain[0]] += 1
                self.stacks[" < ".join(chain)] += 1

    def top(self, n: int = 20) -> dict:
        """The ``n`` lines, innermost tierd frames and tierd chains sampled
        most, each [site, seconds]."""
        def ranked(counts: Counter) -> list:
            return [[site, round(k * self.interval, 3)] for site, k in counts.most_common(n)]
        return {"samples": self.samples, "interval_s": self.interval,
                "lines": ranked(self.lines), "tierd": ranked(self.tierd),
                "tierd_stacks": ranked(self.stacks)}
