"""Where the host's time goes in steps back to back: a cProfile of them,
ranked, for a bench row's diagnostics. On a GPU the host bounds a streamed
step when it cannot queue copies and kernels ahead of the device; this says
which Python (tierd's, torch's, the model's) and which blocking calls
(event and stream synchronizes, allocations that free the allocator's cache)
take that time. cProfile roughly doubles the cost of Python-heavy code, so
read the ranking, not the absolute seconds."""

from __future__ import annotations

import cProfile
import pstats
import time


def _name(func: tuple[str, int, str]) -> str:
    """'tierd/client/hooks.py:120 pre_forward', or '{built-in ...}'."""
    path, line, name = func
    if path == "~":   # a builtin
        return name
    for root in ("/tierd/", "/torch/", "/transformers/"):
        if root in path:
            path = path[path.rfind(root) + 1:]
            break
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{line} {name}"


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
    prof.enable()
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
