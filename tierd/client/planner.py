"""The learned prefetch planner: plain code, no torch, no I/O.

A *step* is everything between two root forwards (forward, backward, and any
forward re-run inside backward by activation checkpointing). The planner
records the sequence of unit ids used in a step. Once it has a trace it
follows it: each use advances a cursor, and it announces the units whose
bytes fit in the ``depth_bytes`` window ahead of the cursor, each position
once. If a use does not match the trace, the step has diverged: the planner
announces nothing more this step (the caller fetches on demand) and the
recorded sequence replaces the trace at the next step, i.e. it re-learns.
Announcements are hints only, so a wrong trace can cost bytes but can never
hang or reorder anything.

[Note: units new to the trace]
A unit the trace does not hold at all is not a divergence: it is fetched on
demand where it is used, the step goes on following the trace, and the
step's recording, which has it where it was used, becomes the trace at the
next step. Placement makes such units: a plan that stops keeping units on
the device streams them again, and the trace learned while they were kept
never saw them (a kept unit's hooks do not call in). Re-learning instead
cost a whole step without prefetch, and without the daemon's read-ahead,
which is told the trace ([Note: the job's access plan] in
``tierd.server.readahead``): on the 70B LoRA at 24 GB the measured plan
streamed again the 9 units the first step's estimate kept, and the plan
reached the daemon at the third step instead of the second.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence


class PlanState(enum.Enum):
    """What the planner does with the current step.

    LEARNING: no trace yet; record only.
    FOLLOWING: the step matches the trace so far (units new to it aside:
        [Note: units new to the trace]); prefetch ahead of the cursor.
    DIVERGED: the step left the trace; record only, re-learn at the next step.
    """

    LEARNING = "learning"
    FOLLOWING = "following"
    DIVERGED = "diverged"


class PrefetchPlanner:
    """Record the order of use in one step, then predict the next units.

    Example:
        >>> p = PrefetchPlanner({0: 10, 1: 10, 2: 10}, depth_bytes=20)
        >>> p.begin_step(); [p.on_use(u) for u in (0, 1, 2)]
        []
        [[], [], []]
        >>> p.begin_step()          # trace learned: the first 20 bytes
        [0, 1]
        >>> p.on_use(0)             # cursor at 1, window covers units 1, 2
        [2]
    """

    def __init__(self, unit_bytes: Mapping[int, int], depth_bytes: int,
                 trace: Sequence[int] = ()) -> None:
        if depth_bytes < 0:
            raise ValueError(f"depth_bytes must be >= 0, got {depth_bytes}")
        self._unit_bytes = dict(unit_bytes)
        self._depth = depth_bytes
        self._trace: list[int] = list(trace)   # a trace learned before the units' bytes changed
        self._recording: list[int] = []
        self._known: set[int] = set(self._trace)   # the units the trace holds
        self._new_units = False   # this step used units the trace does not hold
        self._cursor = 0        # index in the trace of the next expected use
        self._announced = 0     # trace positions [0, _announced) were announced
        self.state = PlanState.LEARNING
        self.steps_followed = 0  # steps that matched the trace to the end
        self.divergences = 0

    @property
    def trace(self) -> tuple[int, ...]:
        return tuple(self._trace)

    @property
    def position(self) -> int:
        """The index in the trace of the use matched last (-1: none this step)."""
        return self._cursor - 1

    def _followed(self) -> bool:
        """The step so far matched the trace to its end."""
        return self.state is PlanState.FOLLOWING and self._cursor == len(self._trace)

    @property
    def learned(self) -> tuple[int, ...]:
        """The trace the next step follows, as of now: the step's recording
        where it replaces the trace (learning, diverged, or with units new to
        it), else the trace. A planner made anew mid-step (placement applied
        at the first update) starts from this, not from the trace the step
        began with, which the first step does not have yet."""
        if self._recording and not (self._followed() and not self._new_units):
            return tuple(self._recording)
        return self.trace

    def begin_step(self) -> list[int]:
        """Close the previous step and start a new one; returns units to fetch first."""
        if self._recording:
            if self._followed():
                self.steps_followed += 1
            elif self.state is PlanState.FOLLOWING:  # stopped early: diverged
                self.divergences += 1
            self._trace = list(self.learned)
        self._recording = []
        self._known, self._new_units = set(self._trace), False
        self._cursor = 0
        self._announced = 0
        self.state = PlanState.FOLLOWING if self._trace else PlanState.LEARNING
        return self._window()

    def head(self) -> list[int]:
        """The units a step following the trace fetches first (the first window)."""
        out, budget = [], self._depth
        for unit in self._trace:
            cost = self._unit_bytes.get(unit, 0)
            if cost > budget:
                break
            budget -= cost
            out.append(unit)
        return out

    def on_use(self, unit: int) -> list[int]:
        """Record that ``unit`` is being used now; returns units newly worth fetching."""
        self._recording.append(unit)
        if self.state is not PlanState.FOLLOWING:
            return []
        if unit not in self._known:   # [Note: units new to the trace]
            self._new_units = True
            return []
        if self._cursor >= len(self._trace) or self._trace[self._cursor] != unit:
            self.state = PlanState.DIVERGED
            self.divergences += 1
            return []
        self._cursor += 1
        return self._window()

    def _window(self) -> list[int]:
        if self.state is not PlanState.FOLLOWING:
            return []
        start = max(self._announced, self._cursor)
        budget = self._depth
        # bytes already announced ahead of the cursor count against the window
        for unit in self._trace[self._cursor:start]:
            budget -= self._unit_bytes.get(unit, 0)
        out: list[int] = []
        end = start
        while end < len(self._trace):
            cost = self._unit_bytes.get(self._trace[end], 0)
            if cost > budget:
                break
            budget -= cost
            out.append(self._trace[end])
            end += 1
        self._announced = max(self._announced, end)
        return out
