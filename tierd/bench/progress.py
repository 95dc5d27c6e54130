"""The suite's progress on stderr: a bar over the selected sections and one
line per finished section.

The bar is tqdm's, drawn only on a terminal; the per-section lines are
printed either way, so a log (CI, ``nohup``) keeps a readable record instead
of carriage-return redraws.
"""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm


class Progress:
    """``start(name)`` before a section, ``done(name, status)`` after it,
    ``close()`` at the end (also on errors).

    >>> p = Progress(["limits"], bar=False)
    >>> p.start("limits"); p.done("limits", "ok"); p.close()  # doctest: +SKIP
    """

    def __init__(self, names: list[str], bar: bool | None = None) -> None:
        self._started = time.monotonic()
        self._bar = _make_bar(len(names)) if bar is not False else None
        self._stop = threading.Event()
        self._ticker = None
        if self._bar is not None:
            # tqdm redraws only on update; a section can run for minutes, so a
            # ticker keeps the elapsed time moving while one runs
            self._ticker = threading.Thread(target=self._tick, name="bench-progress",
                                            daemon=True)
            self._ticker.start()

    def start(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(name)

    def done(self, name: str, status: str) -> None:
        line = f"[{time.monotonic() - self._started:6.1f} s] {name}: {status}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
            self._bar.update(1)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._bar.refresh()


def _make_bar(total: int) -> tqdm | None:
    """A tqdm bar on a terminal; None elsewhere."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="section", file=sys.stderr, dynamic_ncols=True,
                bar_format="{desc:<10} {bar} {n_fmt}/{total_fmt} sections [{elapsed}]")
