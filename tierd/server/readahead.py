"""A job's access plan: the keys each position of its step uses, and where it is.

Plain code over key names and integers; the catalog looks the keys up.

[Note: the job's access plan]
A model larger than the pool streams its units through it every step, and
the step visits them in a fixed order: with activation checkpointing, the
forward in order and the backward (each unit re-run, then its gradients) in
reverse. Least recently used eviction already reads the fewest bytes from
NVMe for that zigzag (the 70B LoRA at 24 GB: 40.1 GB a step against the
36.6 GB the pool cannot keep), but it reads them late: the units the pool
cannot keep are the last of each pass, and each is read only when the
client leases it, a prefetch window ahead, so the disk idles while the
pool's units stream and the GPU waits on the disk after (28.5 s a step
against 17.0 s of disk time).

So the client tells the daemon its plan once (``UsePlan``: the keys of
each position of the step, as its prefetch planner learned the order) and
where it is as it goes (``UseAt``). From these the daemon knows each key's
next use, and

- evicts the key used farthest ahead first (Belady's choice) among those
  the plan names, after the tensors no plan names ([Note: eviction by next
  use] in tierd.server.eviction);
- reads ahead (:meth:`AccessPlan.ahead`): it starts swap-ins of the
  planned keys on NVMe in the order they will be used, up to the horizon:
  the positions from now whose distinct keys fit in the pool together
  (:meth:`AccessPlan.horizon`). Each evicts only tensors the horizon does
  not use (or cold or demoted ones), which Belady's choice would evict
  before any tensor the horizon uses, so the read-ahead costs the job no
  read it would not make anyway. Evicting everything used after the key
  read is not enough: early in a forward that reads the next backward's
  last units by evicting this forward's first ones, needed only a little
  later than them, where waiting would have evicted units the backward
  has used, needed a whole pass later (a first version read 2.4 times the
  bytes least recently used does, in tests/server/test_readahead.py). The
  first key that finds no room stops it until the job moves on, and the
  next ``UseAt`` resumes there. A pass therefore reads its misses from
  where the pool's reach first covers them, about its start, while the
  pool's own units stream, and the disk stays busy.

[Note: what reading ahead writes]
A tensor read back from NVMe keeps its record there (it is clean) until the
file needs the room for another tensor's write, which gives up such copies
(``Tiers._reclaim_nvme``). Evicting a clean tensor costs nothing now; a
dirty one costs a write, on the disk the reads wait for. At 24 GB the 70B
LoRA's read-ahead wrote 12.3 GB a step beside 40.6 GB read (1.6 GB written
before read-ahead), 39.5 s a step against its 22.7 s disk floor: the
embedded daemon's file held the spill and its slack, so each read ahead
that evicted a dirty block wrote it by giving up the copies of blocks read
back earlier, which made those dirty for the next read ahead, and so on.
So a read ahead writes a dirty tensor only into free room of the file and
never gives up a copy for it: else it stops until the next use, and the
lease, when it comes, evicts as before. And the embedded daemon's file has
room for the copies of what cycles ([Note: embedded daemon sizes] in
tierd.client.capacity), so the read-ahead finds clean tensors to evict.
``python -m tierd.bench.eviction_sim`` (the catalog in-process on the 70B's
blocks, 1/1024 scale) wrote 28-37 GB a step with a spill-sized file before;
now none (52.6 GB read, 38.0 ahead) and, with the file twice the spill,
1.2 GB (the state; 51.4 read, all ahead). Tried and dropped: evicting clean
tensors first among those used after the horizon (more reads than Belady's
order, no fewer writes), and giving up the copies of the tensors kept
longest first (no change in either).

That rule left the blocks that cycle through NVMe where the first steps
put them. The client tells its plan at its third step (its planner learns
the order first), and until then eviction is least recently used, after
attach spilled the first blocks it made: on the H200 (61c94a9, the
daemon's timeline) only the 70B's blocks 0-27 ever crossed NVMe, the
forward's misses (13-27) came at its start and the backward's (12-0) at
its end, and between them the disk idled ~4.5 s a step, because the
backward's best victims (its first blocks, next used at the end of the
next forward) had no NVMe copy and the read ahead would not write them.
So a read ahead whose victim is dirty and finds no clean one may write it
after all, giving up the copies of tensors it keeps (used before its
horizon) whose uses lie closer together than the victim's
(:meth:`AccessPlan.longest_gap`), those closest together first: eviction
by next use sends a tensor to NVMe in its longest gap, so those are the
tensors it sends least. The blocks that cycle then move to both ends of
the zigzag, where eviction by next use puts them, and the writes stop
once they have (tests/bench/test_bench_eviction_sim.py: 12.3 s a step
with 10.8 s of disk before, 11.1 s with 10.9 after). With a file the size
of the spill the blocks that cycle have the longest gaps already, so no
copy qualifies and nothing is written (tests/server/test_readahead.py);
without the gap rule that case wrote 2.6 of 10 MB a step.

Each attached model sends its own plan, by name (:class:`JobPlans`: a job,
one process, may train several); positions count per plan, so next uses
are compared across plans in steps ahead (the part of its step before a
key's next use). Plans are hints: a wrong or stale plan costs reads, never
a value (a lease still waits for its bytes). A step that leaves the planned
order makes the client send nothing until it has learned the new order and
sends it; detach forgets the model's plan.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence


class AccessPlan:
    """The keys used at each position of a repeating step, and the position now.

    Example:
        >>> plan = AccessPlan([("a",), ("b",), ("b", "c")])
        >>> plan.advance(1); plan.next_use("a"), plan.next_use("b"), plan.next_use("c")
        (3, 2, 2)
        >>> end = plan.horizon(lambda key: 1, budget=2); end
        2
        >>> [at for at, _ in plan.ahead(end)]
        [2]
    """

    def __init__(self, positions: Sequence[Sequence[str]]) -> None:
        if not positions:
            raise ValueError("an access plan needs at least one position")
        self.positions = [tuple(keys) for keys in positions]
        self.length = len(self.positions)
        self._offsets: dict[str, list[int]] = {}   # key -> its positions in a step
        for i, keys in enumerate(self.positions):
            for key in keys:
                offsets = self._offsets.setdefault(key, [])
                if not offsets or offsets[-1] != i:
                    offsets.append(i)
        self.now = -1      # the position in use (-1: none told yet)
        self.cursor = 0    # the read-ahead has dealt with every position before it

    def __contains__(self, key: str) -> bool:
        return key in self._offsets

    def advance(self, at: int) -> None:
        """The job uses position ``at`` now; a position before the last one
        told restarts the count (a new run of the same plan)."""
        if at < self.now:
            self.cursor = 0
        self.now = at
        self.cursor = max(self.cursor, at + 1)

    def next_use(self, key: str) -> int | None:
        """The position at which ``key`` is used next after now (None: the
        plan does not use it)."""
        offsets = self._offsets.get(key)
        if offsets is None:
            return None
        base, offset = divmod(self.now, self.length) if self.now >= 0 else (0, -1)
        i = bisect_right(offsets, offset)
        if i < len(offsets):
            return base * self.length + offsets[i]
        return (base + 1) * self.length + offsets[0]

    def longest_gap(self, key: str) -> int | None:
        """The most positions between two uses of ``key`` in the repeating
        step (None: the plan does not use it): a tensor whose uses all come
        close together is one the pool keeps, one with a long gap is one
        eviction by next use sends to NVMe in that gap.

        >>> plan = AccessPlan([("a",), ("b",), ("c",), ("b",)])
        >>> plan.longest_gap("a"), plan.longest_gap("b"), plan.longest_gap("x")
        (4, 2, None)
        """
        offsets = self._offsets.get(key)
        if offsets is None:
            return None
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        return max(gaps + [self.length - offsets[-1] + offsets[0]])

    def horizon(self, size: Callable[[str], int], budget: int) -> int:
        """The last position after now (within a step) up to which the
        distinct keys used from now on (now's included: they hold room too),
        ``size(key)`` bytes each, fit in ``budget`` together; now itself
        when the next position's do not."""
        seen = set(self.positions[self.now % self.length]) if self.now >= 0 else set()
        total, end = sum(size(key) for key in seen), self.now
        for at in range(self.now + 1, self.now + self.length):
            for key in self.positions[at % self.length]:
                if key not in seen:
                    seen.add(key)
                    total += size(key)
            if total > budget:
                break
            end = at
        return end

    def steps_ahead(self, key: str) -> float | None:
        """How far ahead ``key``'s next use is, in steps (None: not planned)."""
        due = self.next_use(key)
        return None if due is None else self.steps_to(due)

    def steps_to(self, at: int) -> float:
        """How far ahead position ``at`` is, in steps."""
        return (at - self.now) / self.length

    def ahead(self, end: int) -> Iterator[tuple[int, tuple[str, ...]]]:
        """The positions from the read-ahead's cursor to ``end``, with their
        keys; the caller moves ``cursor`` past those it dealt with."""
        for at in range(self.cursor, end + 1):
            yield at, self.positions[at % self.length]


class JobPlans:
    """A job's access plans by name (one per attached model); what
    eviction asks of them: a key's next use, in steps ahead.

    Example:
        >>> plans = JobPlans()
        >>> plans.set("m1", [("a",), ("b",)]); plans.set("m2", [("c",)] * 4)
        >>> plans.by_name["m1"].advance(0); plans.by_name["m2"].advance(0)
        >>> plans.steps_ahead("b"), plans.steps_ahead("c"), plans.steps_ahead("x")
        (0.5, 0.25, None)
        >>> plans.set("m1", []); "a" in plans, bool(plans)
        (False, True)
    """

    def __init__(self) -> None:
        self.by_name: dict[str, AccessPlan] = {}
        self._of_key: dict[str, AccessPlan] = {}

    def set(self, name: str, positions: Sequence[Sequence[str]]) -> None:
        """``name``'s plan becomes ``positions`` (empty: forgotten)."""
        if positions:
            self.by_name[name] = AccessPlan(positions)
        else:
            self.by_name.pop(name, None)
        self._of_key = {key: plan for plan in self.by_name.values()
                        for keys in plan.positions for key in keys}

    def __contains__(self, key: str) -> bool:
        return key in self._of_key

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def steps_ahead(self, key: str) -> float | None:
        plan = self._of_key.get(key)
        return None if plan is None else plan.steps_ahead(key)

    def longest_gap(self, key: str) -> float | None:
        """:meth:`AccessPlan.longest_gap` in steps."""
        plan = self._of_key.get(key)
        return None if plan is None else plan.longest_gap(key) / plan.length
