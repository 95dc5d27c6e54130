"""The backward tracker: which backward passes are running, and when they end.

Backward hooks fire per node; tierd needs two moments per backward pass: its
first hook (the fused optimizer starts fetching) and its end (gradients are
flushed, parameters freed, updates finished). torch marks each backward pass
with a graph task id, and lets us queue a callback that runs once the task
has finished every node. A forward re-run by activation checkpointing may run
a nested backward (reentrant checkpointing) inside the outer one: only the
outermost task's end ends the pass.
"""

from __future__ import annotations

from collections.abc import Callable

from tierd.client.torch_internals import current_graph_task, queue_engine_callback


class BackwardTracker:
    """Calls ``on_begin()`` when the outermost backward pass starts and
    ``on_end(task, outermost)`` when each task ends.

    Example:
        >>> tracker = BackwardTracker(on_begin=print, on_end=lambda t, o: None)  # doctest: +SKIP
        >>> task = tracker.enter()   # from any backward hook                      # doctest: +SKIP
    """

    def __init__(self, *, on_begin: Callable[[], None],
                 on_end: Callable[[int, bool], None]) -> None:
        self._on_begin = on_begin
        self._on_end = on_end
        self._running: set[int] = set()   # tasks whose end callback is queued

    @property
    def active(self) -> bool:
        return bool(self._running)

    def enter(self) -> int:
        """Called from every backward hook: the running task (its end watched)."""
        task = current_graph_task()
        if task not in self._running:
            outermost = not self._running
            self._running.add(task)
            queue_engine_callback(lambda: self._end(task))
            if outermost:
                self._on_begin()
        return task

    def _end(self, task: int) -> None:
        self._running.discard(task)
        self._on_end(task, not self._running)
