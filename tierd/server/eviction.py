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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol


class Evictable(Protocol):
    last_use: int


def least_recently_used(candidates: Iterable[Evictable]) -> list:
    """Candidates in eviction order: least recently used first."""
    return sorted(candidates, key=lambda e: e.last_use)


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


def coldest_segment(segments: Mapping[int, list[Evictable]]) -> int | None:
    """Of fully evictable segments (id -> their tensors), the least recently used."""
    if not segments:
        return None
    return min(segments, key=lambda sid: max((e.last_use for e in segments[sid]), default=0))


def segments_coldest_first(segments: Mapping[int, list[Evictable]]) -> list[int]:
    """Segment ids (id -> their tensors) from the least recently used."""
    return sorted(segments, key=lambda sid: max((e.last_use for e in segments[sid]), default=0))
