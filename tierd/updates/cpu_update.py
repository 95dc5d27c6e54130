"""Optimizer updates on the host, overlapped with backward (active gradient offloading).

[Note: CPU updates overlapped with backward]
A bucket placed on the CPU (``Bucket.cpu``: ``optimizer_placement="cpu"``, or
the planner's ``Place.CPU``, [Note: choosing CPU updates] in
``tierd.client.placement``) keeps its fp32 master and moments in the pool for
good. In the backward that ends a window, as soon as the bucket's gradients
are final on the device (the same moment the fused path would update it,
[Note: fused update] in ``tierd.updates.fused``):

1. the main thread leases the bucket's keys (master, moments, fp32 gradient,
   compute copy) and queues the gradients' copy out to their ``grad`` keys on
   the copy-out stream (a gradient that earlier backwards of the window
   summed in the pool goes to a pinned buffer instead, and is added there);
2. it hands a :class:`HostJob` to one of a few host threads and goes on with
   backward. The thread waits for the copy's event, runs the optimizer's own
   ``update_params`` on the pool views in place (the deferred CPU path's
   math: fp32 is bitwise ``torch.optim.AdamW(foreach=False)``), then casts
   the new master into the compute copy's key. torch's CPU kernels release
   the GIL, so the update runs while the main thread queues backward;
3. the bucket is UPDATING, with its Future, until the main thread sees the
   thread done (it alone talks to the daemon): then the leases go, as written.

Nothing reads a bucket's keys while its update runs: the next swap-in of one
of its parameters waits for it (:meth:`HostUpdates.wait_for`, called by the
mover), a gradient arriving for it waits too, and ``settle`` (state_dict,
commit, detach, a deferred ``step()``, placement) and the torch optimizer's
``state_dict``/``load_state_dict`` wait for all. The step counts live in
``opt.state`` and are bumped by the thread; the param group is copied when
the job is made, so a scheduler changing ``lr`` after ``step()`` changes the
next window, as in torch. A failed update is raised (with a note naming the
bucket) at the first of: the next forward that needs the bucket, the next
``step()`` or backward, ``settle``; its leases are released first.

One thread: a job's kernels already spread over the cores (torch's
intra-op threads) and AdamW is bound by memory bandwidth, so a second job
at once would only contend, and take cores from the main thread, which must
keep queueing backward's kernels. A job seldom waits for its copy out: the
copy was queued when its bucket's gradients were final, the job starts
after the previous one. ``_THREADS`` is the knob to measure on a large host.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierd.client.copy_stream import InflightCopy
from tierd.client.placement import Costs
from tierd.client.tiered_param import TieredParam
from tierd.client.torch_internals import foreach_adamw
from tierd.updates.buckets import Bucket, BucketState

_THREADS = 1
#: 192 MiB of AdamW state, past any cache: with 12 MiB (which a server's L3
#: holds) the H200 host's probe promised several times the rate its updates
#: on pool memory reached, and "auto" placed 46 units of 1.3B capped at 48 GB
#: on the CPU, making the step 3x slower than with none
_PROBE_NUMEL = 16 << 20
_PROBE_COPY_BYTES = 64 << 20


@dataclass(frozen=True)
class HostJob:
    """One bucket's CPU update, handed to a host thread. Holding it keeps the
    gradients' device sources (``copy``) and the pool views alive."""

    bucket: int
    name: str
    group: dict                                    # the param group, copied at hand-off
    batches: tuple                                 # (tps, params, grads, moments) per step count
    grads_in: tuple[tuple[torch.Tensor, torch.Tensor, bool], ...]   # (grad view, staged, add)
    casts: tuple[tuple[torch.Tensor, torch.Tensor], ...]            # (compute view, master)
    copy: InflightCopy | None                      # the gradients' copy out (CUDA)
    nbytes: int                                    # state bytes updated
    # earlier copies out into the pooled gradients read here (CUDA events)
    after: tuple = ()


def run_job(opt, job: HostJob) -> float:
    """The thread's work (see the Note); returns the seconds it computed."""
    for event in job.after:      # gradients summed in the pool by earlier backwards
        event.synchronize()
    if job.copy is not None:
        job.copy.synchronize()   # releases the GIL while the copy lands
    t0 = time.perf_counter()
    with torch.no_grad():
        for view, staged, add in job.grads_in:
            if add:
                view.add_(staged)
            elif view.data_ptr() != staged.data_ptr():
                view.copy_(staged)
        for tps, params, grads, moments in job.batches:
            opt.update_params(job.group, tps, params, grads, moments)
        for compute, master in job.casts:
            compute.copy_(master)
    return time.perf_counter() - t0


def probe_host_rate() -> float:
    """AdamW state bytes per second one update gets through on this host."""
    t = [torch.rand(_PROBE_NUMEL) for _ in range(4)]
    for _ in range(2):   # the first run pays for the first touch of the pages
        t0 = time.perf_counter()
        foreach_adamw([t[0]], [t[1]], [t[2]], [t[3]], step=1.0, lr=1e-3, beta1=0.9,
                      beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False)
        seconds = time.perf_counter() - t0
    return 3 * 4 * _PROBE_NUMEL / max(seconds, 1e-9)


def probe_copy_rate(device: torch.device) -> float | None:
    """PCIe bytes per second both ways together (None off CUDA: no copies)."""
    if device.type != "cuda":
        return None
    n = _PROBE_COPY_BYTES
    host_in, host_out = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(n, dtype=torch.uint8, device=device) for _ in range(2))
    streams = [torch.cuda.Stream(device=device) for _ in range(2)]
    for _ in range(2):   # the first round warms up
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    return 2 * n / max(seconds, 1e-9)


def host_choice(optimizers) -> tuple[str, Costs | None]:
    """What the planner may do with CPU updates over a session's fused
    ``optimizers``: the first that allows any ([Note: choosing CPU updates]),
    at the host rate all of them measured together (their updates share the
    host), else that one's probe."""
    mode, costs = next((c for c in (f.host.choice() for f in optimizers) if c[0] != "none"),
                       ("none", None))
    seconds = sum(f.host.seconds for f in optimizers)
    if costs is not None and seconds > 0:
        costs = Costs(costs.copy_bytes_per_s, sum(f.host.nbytes for f in optimizers) / seconds)
    return mode, costs


def overlapped(session) -> bool:
    """Whether CPU updates overlap backward for ``session``'s optimizers: not
    under torch.distributed (shared keys change by publishing)."""
    return session.share is None


class HostUpdates:
    """The CPU updates of one :class:`~tierd.updates.fused.FusedUpdates`
    (see the Note above): which buckets are on the CPU, their jobs, and what
    was measured.

    Example:
        >>> fused.host.place(None)          # the optimizer's placement decides  # doctest: +SKIP
        >>> fused.host.wait_all()           # before the host reads the pool     # doctest: +SKIP
    """

    def __init__(self, fused) -> None:
        self._fused = fused
        session = fused.session
        self.mode = fused.opt.placement or session.config.optimizer_placement
        if not overlapped(session):
            self.mode = "gpu-stream"   # no CPU place (see overlapped())
        self._executor: ThreadPoolExecutor | None = None
        self._running: dict[Bucket, HostJob] = {}   # UPDATING buckets, in hand-off order
        self.seconds = 0.0       # thread time spent updating
        self.nbytes = 0          # state bytes updated
        self._probed: float | None = None       # host AdamW bytes/s, probed
        self._copy_rate: float | None = None    # PCIe bytes/s (0.0: no PCIe)
        self._hooks: list = []   # on the torch optimizer's state_dict, once updates run
        if self.mode == "cpu":
            self.place(None)

    # ------------------------------------------------------------ placement
    def place(self, tps: list[TieredParam] | None) -> int:
        """Update on the CPU the buckets made only of ``tps`` (None: every
        bucket under ``optimizer_placement="cpu"``, none otherwise); never a
        bucket whose state is pinned or with a parameter resident on the
        device (its device copy is refreshed by the device's update).
        Returns the state bytes placed."""
        self.wait_all()
        chosen = None if tps is None else set(tps)
        placed = []
        for b in self._fused.buckets:
            b.cpu = not b.pinned and not any(tp.resident for tp in b.tps) and (
                self.mode == "cpu" if chosen is None else all(tp in chosen for tp in b.tps))
            if b.cpu:
                placed += b.tps
        self._create_grad_keys(placed)
        return sum(b.nbytes for b in self._fused.buckets if b.cpu)

    def _create_grad_keys(self, tps: list[TieredParam]) -> None:
        """A CPU bucket writes its gradients to their keys every step: made now
        (and held when they fit) instead of on first use."""
        missing = [tp for tp in tps if not tp.grad_created]
        if not missing:
            return
        session = self._fused.session
        session.client.put_many({tp.grad_key: torch.zeros(tp.param.shape, dtype=tp.grad_dtype)
                                 for tp in missing})
        for tp in missing:
            tp.grad_created = True
        session.try_hold([tp.grad_key for tp in missing],
                         sum(tp.grad_nbytes for tp in missing))

    def choice(self) -> tuple[str, Costs | None]:
        """What the planner may do with CPU updates ([Note: choosing CPU
        updates]): ("all", None), ("none", None) or ("auto", measured costs;
        "none" where there is no PCIe to save, off CUDA)."""
        if self.mode == "cpu":
            return "all", None
        if self.mode != "auto":
            return "none", None
        if self._copy_rate is None:   # measured once: the bus does not change
            self._copy_rate = probe_copy_rate(self._fused.session.device) or 0.0
        if not self._copy_rate:
            return "none", None
        return "auto", Costs(self._copy_rate, self.host_rate())

    def host_rate(self) -> float:
        """State bytes per second: measured by the updates so far, else probed once."""
        if self.seconds > 0:
            return self.nbytes / self.seconds
        if self._probed is None:
            self._probed = probe_host_rate()
        return self._probed

    # ------------------------------------------------------------ updates
    def start(self, b: Bucket, grads: dict[TieredParam, torch.Tensor],
              updated: set[TieredParam]) -> None:
        """Hand ``b``'s update to a thread: its parameters not in ``updated``
        with a gradient (``grads``: this backward's, on the device; or summed
        in the pool). They are added to ``updated``."""
        if b.state is BucketState.UPDATING:   # a first part still runs
            self.wait_for_bucket(b)
        items = [(tp, grads.pop(tp, None)) for tp in b.tps if tp not in updated]
        items = [(tp, g) for tp, g in items if g is not None or tp.grad_in_pool]
        if not items:
            return
        session, opt = self._fused.session, self._fused.opt
        opt.unmade.ensure_stored([tp for tp, _ in items])
        keys = list(dict.fromkeys(k for tp, _ in items for k in (
            *opt.state_keys(tp), tp.grad_key, *([tp.key] if opt.separate_master(tp) else []))))
        session.leases.acquire(keys)
        try:
            views = session.leases.views(keys)
        except Exception:
            session.leases.release(keys)
            raise
        # the pooled gradients' last copies out (an earlier backward's) land
        # before the thread reads them, also where no copy is queued now
        after = session.copy.pending_writes([tp.grad_key for tp, _ in items if tp.grad_in_pool])
        grads_in, copy = self._grads_out(items, views)
        by_step: dict[float, list[TieredParam]] = {}
        for tp, _ in items:
            by_step.setdefault(opt.state[tp.outside].get("step", 0.0), []).append(tp)
        batches = tuple(
            (tps, [views[opt.master_key(tp)] for tp in tps], [views[tp.grad_key] for tp in tps],
             {n: [views[opt.state_key(tp, n)] for tp in tps] for n in opt.state_names})
            for tps in by_step.values())
        casts = tuple((views[tp.key], views[tp.master_key]) for tp, _ in items
                      if opt.separate_master(tp))
        for tp, _ in items:
            tp.to_no_gradient()
            updated.add(tp)
        job = HostJob(b.index, b.tps[0].name, {k: v for k, v in b.group.items() if k != "params"},
                      batches, grads_in, casts, copy,
                      sum(opt.state_nbytes(tp) for tp, _ in items),
                      after)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(_THREADS, thread_name_prefix="tierd-cpu-update")
        if not self._hooks:   # the step counts are bumped by the threads
            self._hooks = [opt.register_state_dict_pre_hook(lambda _: self.wait_all()),
                           opt.register_load_state_dict_pre_hook(lambda *_: self.wait_all())]
        b.to_updating(keys, self._executor.submit(run_job, opt, job))
        self._running[b] = job

    def _grads_out(self, items, views):
        """Queue this backward's gradients towards the pool (see the Note, 1.)."""
        copy_stream = self._fused.session.copy
        grads_in, pairs = [], []
        for tp, g in items:
            if g is None:
                continue
            view = views[tp.grad_key]
            if not copy_stream.on_device:   # the device is the host: no copy
                grads_in.append((view, g, tp.grad_in_pool))
            elif tp.grad_in_pool:   # added on the host, rounded there to the key's dtype
                staged = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                pairs.append((staged, g))
                grads_in.append((view, staged, True))
            else:   # cast on the device: the copy out moves the key's bytes
                pairs.append((view, g.to(view.dtype)))
        copy = None
        if pairs:
            copy = copy_stream.copy_out_many(pairs, tuple(tp.grad_key for tp, g in items
                                                          if g is not None))
            # the job keeps the event and the pool side, not the device
            # gradients: the stream they were recorded on keeps their memory
            # until the copy lands, and a job is held until step() reaps it
            copy = InflightCopy(copy.dst, (), copy.keys, copy.event)
        return tuple(grads_in), copy

    def running(self, b: Bucket) -> bool:
        """``b``'s CPU update still runs (a finished one is wound up here)."""
        if b.state is not BucketState.UPDATING:
            return False
        if not b.update.done():
            return True
        self._finish([b])
        return False

    def wait_for(self, tp: TieredParam) -> None:
        """Block until the CPU update that writes ``tp``'s keys has ended."""
        b = self._fused.bucket_of.get(tp)
        if b is not None and b.state is BucketState.UPDATING:
            self.wait_for_bucket(b)

    def wait_for_bucket(self, b: Bucket) -> None:
        t0 = time.perf_counter()
        b.update.exception()   # waits; the error is raised by _finish
        self._fused.session.counters.wait_seconds += time.perf_counter() - t0
        self._finish([b])

    def reap(self) -> None:
        """Wind up the updates that ended (raises the first one that failed)."""
        self._finish([b for b in self._running if b.update.done()])

    def wait_all(self) -> None:
        """Every CPU update ended (raises the first one that failed); the threads stop."""
        running = list(self._running)
        for b in running:
            b.update.exception()
        self._finish(running)
        if self._executor is not None and not self._running:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _finish(self, done: list[Bucket]) -> None:
        """Release the leases of ended updates. If one failed, every update
        still running is waited for and wound up too, and the first failure
        is raised once (with a note counting the others): after it nothing
        runs, nothing is leased, and a later settle or detach goes through."""
        errors = self._wind_up(done)
        if not errors:
            return
        running = list(self._running)
        for b in running:
            b.update.exception()   # waits for it
        errors += self._wind_up(running)
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more CPU updates of this step failed as well")
        raise first

    def _wind_up(self, done: list[Bucket]) -> list[BaseException]:
        errors = []
        for b in done:
            exc, job = b.update.exception(), self._running.pop(b)
            if exc is None:
                self.seconds += b.update.result()
                self.nbytes += job.nbytes
            self._fused.session.leases.release(b.keys, written=True)
            b.to_updated_on_host()
            if exc is not None:
                exc.add_note(f"in the CPU update of optimizer bucket {job.bucket} "
                             f"({job.name!r}...); its values in tierd may be partly updated")
                errors.append(exc)
        return errors

    def close(self) -> None:
        """The optimizer stops fusing: nothing left running, hooks off."""
        self.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
