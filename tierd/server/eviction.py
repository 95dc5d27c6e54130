"""Eviction policy: which tensors leave the pool when room is needed.

Plain functions over plain values, so the policy can be read and tested
without the catalog's bookkeeping around it.

[Note: fair eviction]
The pool is shared by jobs. A job's *fair share* is the
pool divided by the jobs holding pool memory. A job asking for room evicts its
own least recently used tensors first when it is at or above its share (or
above its quota); when it is below its share it takes room from the job
furthest above its share instead, a whole segment at a time, since pool
memory moves between jobs only as whole segments (see [Note:
segment lifetime] in :mod:`tierd.backends.hostpool`). Leased tensors are never candidates.

[Note: eviction by next use]
Least recently used is the worst order for what training does once the pool
is smaller than a job's working set: every step touches the same tensors in
the same order, so the tensor used longest ago is the one needed soonest,
and every access misses (a 15B model whose 137 GiB of streamed optimizer
state cycled through a 105 GiB pool read and wrote all of it from NVMe each
step). The client knows better: a streamed bucket's master and moments,
just updated, are next needed at the same point of the next step, after
everything else it uses before then. It *demotes* them (``Demote``): their
``last_use`` becomes minus the current tick, so they go before any ordinary
tensor, the most recently demoted first. That is Belady's choice for a
cycle: the state updated first in this backward is needed first in the
next one, so the pool keeps the state of the first buckets of the backward
order, and only the rest cycles through NVMe: (working set - pool) each way
per step instead of the whole working set. A lease makes a tensor ordinary
again (``last_use`` is the lease's tick). Not demoted: an fp32 parameter's
own key (its master is the weight the next forward reads first, in the
order least recently used already gets right), held keys (never evicted)
and keys shared by ranks (their next version is a new entry).

A job that told the daemon its access plan ([Note: the job's access plan] in
tierd.server.readahead) has the next use of each key it plans known: those
go last, the one used farthest ahead first, after the tensors no plan
names (least recently used first, as before plans: a job's state, whose
own order the demotes give, keeps the order measured with it).

[Note: cold tensors go first]
Demoted tensors go before ordinary ones, but a tensor nobody has used for
longer than the job's cycle is needed later still, if ever: the bf16
copies of units whose weights the GPU keeps ([Note: kept weights are
written when the store is read] in tierd.updates.resident) are leased in
the first step only. Ordinary, they outlived every demoted tensor and held
pool room the streamed state needed, so that much more state crossed NVMe
each way every step (tests/server/test_nvme_traffic.py). So the daemon
measures the cycle: a key demoted again gives the ticks between its two
demotes (its ``cycle``), and the job's cycle is the longest of those of keys
still cycling (demoted again within two of their cycles): the longest, so a
bucket updated in two parts within one step (two demotes a few ticks apart)
does not make the whole step's state look cold; of keys still cycling, so a
pause (an evaluation) long past stops counting once the keys cycle again. A
tensor neither leased nor demoted within one and a half of the job's cycle
is *cold*, and goes before the demoted ones, least recently used first. A
tensor every step uses is at most a cycle behind; the half is for the ticks
of a step, which vary with what else the job and other jobs ask. Not more: a
cold tensor keeps its room until then, and the cycle is known only from the
second updating step on. A job that never demoted has no cycle and nothing
is cold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tierd.server.readahead import JobPlans

#: a tensor unused for more than this many cycles is cold ([Note: cold tensors go first])
COLD_CYCLES = 1.5


class Evictable(Protocol):
    key: str
    last_use: int


class Cycling(Protocol):
    demoted_at: int   # tick of its last demote (0: never)
    cycle: int        # ticks between its two latest demotes (0: unknown)


def job_cycle(entries: Iterable[Cycling], now: int) -> int:
    """The job's cycle in ticks: the longest of its keys' that still cycle
    (demoted again within two of their cycles); 0 when none does. See
    [Note: cold tensors go first].

    >>> class E:
    ...     def __init__(self, demoted_at, cycle): self.demoted_at, self.cycle = demoted_at, cycle
    >>> job_cycle([E(95, 10), E(97, 3), E(20, 30), E(0, 0)], now=100)
    10
    """
    return max((e.cycle for e in entries if e.cycle and now - e.demoted_at <= 2 * e.cycle),
               default=0)


def rank(e: Evictable, now: int, cycle: int, plans: JobPlans | None = None
         ) -> tuple[int, float]:
    """Where ``e`` goes in eviction order, lowest first: cold tensors (least
    recently used first), then demoted ones (the last demoted first), then
    those no access plan names (least recently used first), then those the
    job's ``plans`` use (the farthest next use first). See [Note: eviction
    by next use] and [Note: cold tensors go first]. ``cycle``: the job's
    cycle in ticks (0: unknown, nothing is cold).

    >>> class E:
    ...     def __init__(self, last_use, key="k"): self.last_use, self.key = last_use, key
    >>> [rank(E(u), now=100, cycle=10) for u in (5, -95, -97, 99)]
    [(0, 5), (1, -95), (1, -97), (2, 99)]
    >>> from tierd.server.readahead import JobPlans
    >>> plans = JobPlans(); plans.set("m", [("a",), ("b",)]); plans.by_name["m"].advance(0)
    >>> [rank(E(99, k), now=100, cycle=10, plans=plans) for k in "abk"]
    [(3, -1.0), (3, -0.5), (2, 99)]
    """
    if cycle and now - abs(e.last_use) > COLD_CYCLES * cycle:
        return (0, abs(e.last_use))
    if e.last_use < 0:
        return (1, e.last_use)
    ahead = None if plans is None else plans.steps_ahead(e.key)
    return (2, e.last_use) if ahead is None else (3, -ahead)


def used_after(e: Evictable, steps: float, now: int, cycle: int, plans: JobPlans) -> bool:
    """Whether a read ahead whose horizon ends ``steps`` ahead may evict
    ``e``: it is cold or demoted, or its plan uses it only after that
    ([Note: the job's access plan] in tierd.server.readahead); a tensor no
    plan names is kept (its next use is unknown)."""
    kind, value = rank(e, now, cycle, plans)
    return kind < 2 or (kind == 3 and -value > steps)


def by_next_use(candidates: Iterable[Evictable], now: int, cycle: int,
                plans: JobPlans | None = None) -> list:
    """Candidates in eviction order (see :func:`rank`)."""
    return sorted(candidates, key=lambda e: rank(e, now, cycle, plans))


def fair_share(budget: int, usage: Mapping[str, int], requester: str) -> int:
    """The pool bytes each job may hold when all jobs with pool memory (and
    the requester) split it evenly."""
    holders = {j for j, used in usage.items() if used > 0} | {requester}
    return budget // len(holders)


def job_to_take_from(budget: int, usage: Mapping[str, int], requester: str) -> str | None:
    """The job whose segment should make room for ``requester``, or None when
    the requester should evict its own tensors."""
    share = fair_share(budget, usage, requester)
    if usage.get(requester, 0) >= share:
        return None
    over = {j: used - share for j, used in usage.items() if j != requester and used > share}
    return max(over, key=over.get) if over else None


def segments_by_next_use(segments: Mapping[int, list[Evictable]], now: int,
                         cycle: int, plans: JobPlans | None = None) -> list[int]:
    """Segment ids (id -> their tensors) in eviction order: a segment ranks as
    its tensor needed soonest (the highest :func:`rank`)."""
    return sorted(segments, key=lambda sid: max(
        (rank(e, now, cycle, plans) for e in segments[sid]), default=(0, 0)))
