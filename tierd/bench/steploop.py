"""Timing a training loop: its steps back to back, or synchronized one by one.

Back to back is how a training loop runs (nothing synchronizes between
steps, so one step's copies may overlap the next step's compute): the loop
records a CUDA event on the current stream before the first step and after
each step returns, and synchronizes once, at the end; a step's seconds are
the time between its two events on the device's timeline. On the CPU,
where a step is done when it returns, host timestamps (``perf_counter``)
stand in for the events. Synchronized steps are timed on the host between
two synchronizations.

After each step returns, ``observe()`` (if given) is called on the host
(e.g. to read which placement plan the step ran on) and its value kept,
with the allocator's peak at that moment: nothing of that synchronizes.

Example:
    >>> steps = back_to_back(train_step, 50, torch.device("cuda"))   # doctest: +SKIP
    >>> summary(steps.seconds, warmup=3)["median_s"]                   # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

#: the steps whose median is a loop's steady step time (the last ones)
LAST = 20


@dataclass(frozen=True)
class Steps:
    """One timed loop: seconds per step, the allocator's peak bytes after each
    step (0 on the CPU), what ``observe`` returned after each step, and the
    loop's wall seconds (host, final synchronization included)."""

    seconds: list[float]
    peaks: list[int]
    observed: list
    wall_s: float
    clock: str   # "cuda events" or "host"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def back_to_back(fn: Callable[[], object], steps: int, device: torch.device,
                 observe: Callable[[], object] | None = None) -> Steps:
    """``steps`` calls of ``fn`` with no synchronization between them, one at the end."""
    cuda = device.type == "cuda"
    marks: list = []   # CUDA events, or host timestamps on the CPU
    peaks, observed = [], []

    def mark():
        if not cuda:
            marks.append(time.perf_counter())
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        marks.append(event)

    _sync(device)
    t0 = time.perf_counter()
    mark()
    for _ in range(steps):
        fn()
        mark()
        peaks.append(_peak(device))
        observed.append(None if observe is None else observe())
    _sync(device)
    wall = time.perf_counter() - t0
    if cuda:
        seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        seconds = [b - a for a, b in zip(marks, marks[1:])]
    return Steps(seconds, peaks, observed, wall, "cuda events" if cuda else "host")


def synchronized(fn: Callable[[], object], steps: int, device: torch.device,
                 observe: Callable[[], object] | None = None) -> Steps:
    """``steps`` calls of ``fn``, the device synchronized before and after each."""
    seconds, peaks, observed = [], [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds.append(time.perf_counter() - start)
        peaks.append(_peak(device))
        observed.append(None if observe is None else observe())
    return Steps(seconds, peaks, observed, time.perf_counter() - t0, "host")


def summary(seconds: list[float], warmup: int, last: int = LAST) -> dict:
    """A loop's figures: the median and mean of its last ``last`` steps (fewer
    where the loop has fewer after ``warmup``), its worst step after the first
    ``warmup``, and its first step.

    >>> s = summary([9.0, 2.0, 1.0, 1.5, 1.0, 1.2], warmup=2, last=3)
    >>> s["median_s"], s["worst_step_s"], s["first_step_s"], s["steady_steps"]
    (1.2, 1.5, 9.0, 3)
    """
    if warmup < 0 or len(seconds) <= warmup:
        raise ValueError(f"{len(seconds)} steps with warmup={warmup}: a loop needs more "
                         "steps than its warm-up (raise --steps or lower --warmup)")
    steady = seconds[max(warmup, len(seconds) - last):]
    return {"median_s": statistics.median(steady), "mean_s": statistics.fmean(steady),
            "worst_step_s": max(seconds[warmup:]), "first_step_s": seconds[0],
            "steady_steps": len(steady)}


def train_step(model, opt, ids, device: torch.device):
    """One training step as a user writes it: bf16 autocast, loss, backward, step."""
    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step
