"""Data-parallel training with torch.distributed: a node's ranks share one copy.

``tierd.attach(model, job="run1")`` in a process of an initialized
``torch.distributed`` job (torchrun) joins the job's other ranks. Only
PyTorch's own collectives are used: the caller's process group (NCCL on GPUs,
gloo on CPUs) for gradients, and gloo groups tierd makes for small host-side
agreements (attach checks, barriers, the clip norm).

[Note: one copy per node]
A *node* is one daemon: the ranks that reach the same daemon socket on the
same host. Every rank of a node attaches in the same named job under the same
key prefix, so they read the same pool slots: the node holds one copy of the
parameters (``p/``, ``master/``) and one of the optimizer states, not one per
rank. The node's first rank (its *leader*) uploads the values at attach (those
of global rank 0, broadcast to the other nodes' leaders as DDP does); the
others wait for it and use what is stored. Each node's daemon holds its own
copy, and all copies stay equal because every node applies the same update.

Each trainable parameter has one *owner* rank per node (:func:`assign_owners`
splits the units by their optimizer bytes). Only the owner keeps its
gradient, moments and master weight current, so the optimizer's compute and
its PCIe traffic are split across the node's GPUs.

[Note: shared and private keys]
``p/`` and ``master/`` keys are *shared*: every rank may read them, so they
are leased read-only and never changed in place. The owner writes a new
version of them by reserving a fresh slot, copying into it and publishing it
(``Client.reserve_async`` / ``publish_async``): a rank still reading the old
version keeps it (the daemon frees it once nobody leases it). Moments and
gradients are *private* to their owner and updated in place under its write
lease. See [Note: when an update is visible] for how readers move on.

[Note: gradient reduction]
Gradients are summed across every rank (all nodes) while backward runs, one
reduction per unit (its trainable parameters flattened into one buffer of the
compute dtype, as DDP reduces in the parameters' dtype: bf16 halves the bytes,
plus one "had a gradient" count per parameter, so a parameter no rank used is
skipped as torch skips it). Collectives must be issued in the same order on
every rank, so buckets are launched in one agreed order (rank 0's completion
order from the first backward, broadcast): a bucket whose gradients are final
(as many deliveries as in the first backward) is launched once every earlier
bucket is. A launched reduction is consumed when it has completed, or when
``LAG`` later ones were launched (on CUDA that wait is a stream wait, so the
host runs on), or at the end of backward. With one node a bucket is reduced to
its owner only (``reduce``); with several, every node's owner needs it
(``all_reduce``). The first backward reduces everything at its end. The sum is
divided by the world size: DDP's average, the single-process gradient of the
global batch.

[Note: when an update is visible]
``opt.step()`` ends, on every rank, with: wait until this rank's copies and
publishes are acknowledged by the daemon, a barrier of the node's ranks, then
drop the leases held on shared keys and lease them again, which yields the
new versions. After ``step()`` returns on any rank, every owner of its node
has published, so the next forward reads the updated weights.

[Note: resident units are replicas]
Placement ([Note: the GPU is the first tier] in ``tierd.client.placement``)
keeps some units on every rank's device. Two ways keep the ranks' copies of
such a unit equal. Per step and unit, with P parameters, G ranks, b bytes per
compute-dtype element and s bytes of fp32 optimizer state per parameter
(AdamW: 12 with a separate master, 8 without):

- *replicas* (what DDP does): the unit's gradient is all-reduced, and every
  rank runs the same update on the same averaged gradient with its own
  master and moments. Interconnect: one all-reduce of P*b, a ring sending
  2(G-1)/G * P*b per rank, launched while backward runs. PCIe: none.
  Device memory: P*(b+s) on every rank.
- *owner updates and broadcasts*: the gradient is reduced to the owner only
  ((G-1)/G * P*b per rank), the owner updates and broadcasts the new compute
  copy ((G-1)/G * P*b): the same 2(G-1)/G * P*b per rank in all. Device
  memory: P*b on every rank and P*s on the owner only, which saves
  (G-1)*P*s across the node for placement to spend on other units. But the
  broadcast can start only once the owner's update is done, and the next
  forward needs it: it adds a collective on the critical path at the end of
  every step, where the all-reduce hides under backward. (Through the
  daemon, as streamed units are published, it would cost PCIe instead:
  P*b out of the owner and P*b into every other rank.)

The interconnect bytes are equal; the owner's way trades a serialised
broadcast per step for device memory. By default tierd keeps replicas:
nothing of a resident unit crosses PCIe and nothing waits after the update.
``gpu_tier="sharded"`` takes the owner's way ([Note: resident state sharded
by unit] in ``tierd.client.sharded``). Which is faster is reasoned, not
measured (the GPU machine had one GPU). Replicas need the same
plan on every rank, so it is agreed ([Note: one plan for every rank] in
``tierd.client.placer``). The node's copy in the daemon is written back by
the unit's owner alone when the host reads the pool (commit,
``state_dict()``, detach, a new plan; ``tierd.updates.resident.write_back``),
as new versions of the shared keys; another rank reads its own copy
(``AttachSession.read_values``) and gets its start from the owner once, when
the plan is applied (``tierd.updates.replica``).
"""

from __future__ import annotations

import datetime
import os
import socket as socketlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tierd.errors import RankFailed, StateError

#: Reductions left in flight before the oldest is waited for (see the Note).
LAG = 2
#: Timeout of tierd's own gloo groups (attach checks, barriers).
CONTROL_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("TIERD_DIST_TIMEOUT_S", 300)))


def active_group(process_group) -> "dist.ProcessGroup | None":
    """The group attach should join: the given one, else the default one if
    torch.distributed is initialized with more than one rank, else None."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@dataclass(frozen=True)
class Ranks:
    """Where this process is in a data-parallel job (global = in ``group``)."""

    group: "dist.ProcessGroup"    # the caller's: gradient reductions
    control: "dist.ProcessGroup"  # gloo, every rank: agreements
    node: "dist.ProcessGroup"     # gloo, this node's ranks: barriers, clip norm
    leaders: "dist.ProcessGroup | None"   # gloo, every node's leader (on leaders, >1 node)
    all_ranks: tuple[int, ...]    # global ranks of ``group``
    rank: int                     # global rank (default group numbering)
    world: int                    # ranks in ``group``
    node_ranks: tuple[int, ...]   # global ranks of this node, leader first
    nodes: int
    #: the caller's backend, this node's ranks: the new weights of units the
    #: GPU tier shards (``gpu_tier="sharded"``; None otherwise)
    node_compute: "dist.ProcessGroup | None" = None

    @property
    def local_rank(self) -> int:
        return self.node_ranks.index(self.rank)

    @property
    def leader(self) -> bool:
        return self.rank == self.node_ranks[0]

    def barrier(self, what: str) -> None:
        """Wait for every rank of this node (a gloo barrier)."""
        collective(lambda: dist.barrier(group=self.node), what)

    def node_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of a CPU tensor over this node's ranks."""
        out = value.detach().to("cpu", torch.float64).clone()
        collective(lambda: dist.all_reduce(out, group=self.node), "sum of the clip norm")
        return out

    def agree_max(self, values: list[int], what: str) -> list[int]:
        """The elementwise largest of ``values`` over every rank of the job
        (negate an entry for the smallest)."""
        out = torch.tensor(values, dtype=torch.int64)
        collective(lambda: dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.control), what)
        return out.tolist()

    def from_leader(self, obj, what: str):
        """The leader's ``obj`` on every rank of the node."""
        box = [obj]
        collective(lambda: dist.broadcast_object_list(box, src=self.node_ranks[0],
                                                      group=self.node), what)
        return box[0]


def collective(run: Callable[[], object], what: str):
    """Run a collective; a failure (a rank died, a timeout) becomes RankFailed."""
    try:
        return run()
    except RankFailed:
        raise
    except (RuntimeError, ValueError) as exc:   # DistBackendError is a RuntimeError
        raise RankFailed(
            f"rank {dist.get_rank()}: {what} among the job's ranks failed ({exc}); another "
            "rank has probably stopped or crashed: see its log. This rank cannot continue "
            "the job (its daemon leases are released when it exits)") from exc


def signature(model: nn.Module, config) -> list[tuple]:
    """What every rank must agree on: parameters (name, shape, dtype,
    requires_grad) and the attach settings that decide keys and owners."""
    rows = [("config", str(config.compute_dtype), config.resident_below_bytes,
             config.optimizer_placement, config.name, config.gpu_tier)]
    rows += [(n, tuple(p.shape), str(p.dtype), p.requires_grad)
             for n, p in model.named_parameters()]
    return rows


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x} vs {y}"
    return f"{len(a)} vs {len(b)} entries"


def join(process_group, *, socket_path: Path | None, job: str | None, model: nn.Module,
         config, device: torch.device, start_daemon: Callable[[], Path]) -> tuple[Ranks, Path]:
    """Agree with every rank of ``process_group`` on the job, the model and the
    nodes; returns this rank's :class:`Ranks` and its node's daemon socket.

    Each rank brings the daemon socket it would use (``socket_path``, or None
    when no daemon answers: then the node's leader starts an embedded one and
    tells the others). Every rank gets the same answer, so a mismatch raises
    the same clear error on all of them instead of hanging later.
    """
    if job is None:
        raise ValueError("under torch.distributed the ranks share one copy in a named job: "
                         "pass job= (the same name on every rank), e.g. "
                         "tierd.attach(model, job='run1')")
    ranks = dist.get_process_group_ranks(process_group)
    control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT,
                             use_local_synchronization=True)
    mine = dict(rank=dist.get_rank(), host=socketlib.gethostname(),
                socket=str(socket_path) if socket_path else None, job=job,
                model=signature(model, config), device=str(device),
                gpus=torch.cuda.device_count() if device.type == "cuda" else 0,
                backend=str(dist.get_backend(process_group)))
    everyone: list[dict] = [None] * len(ranks)   # type: ignore[list-item]
    collective(lambda: dist.all_gather_object(everyone, mine, group=control), "attach")
    check_agreement(everyone)
    nodes: dict[tuple[str, str | None], list[int]] = {}
    for info in everyone:
        nodes.setdefault((info["host"], info["socket"]), []).append(info["rank"])
    order = sorted(nodes.values(), key=min)
    node_groups = [dist.new_group(sorted(r), backend="gloo", timeout=CONTROL_TIMEOUT,
                                  use_local_synchronization=True)
                   if dist.get_rank() in r else None for r in order]
    index = next(i for i, r in enumerate(order) if dist.get_rank() in r)
    node_compute = None
    if config.gpu_tier == "sharded":   # [Note: resident state sharded by unit]
        # before the leaders' group: a locally synchronized group's name counts
        # the groups its process made, which must be alike on the node's ranks
        node_compute = process_group if len(order) == 1 else dist.new_group(
            sorted(order[index]), backend=dist.get_backend(process_group),
            use_local_synchronization=True)
    heads = [min(r) for r in order]
    leaders = None
    if len(order) > 1 and dist.get_rank() in heads:
        leaders = dist.new_group(heads, backend="gloo", timeout=CONTROL_TIMEOUT,
                                 use_local_synchronization=True)
    me = Ranks(group=process_group, control=control, node=node_groups[index], leaders=leaders,
               all_ranks=tuple(ranks), rank=dist.get_rank(),
               world=len(ranks), node_ranks=tuple(sorted(order[index])),
               nodes=len(order), node_compute=node_compute)
    path = socket_path
    if path is None:   # nobody on this node found a daemon: the leader starts one
        path = Path(me.from_leader(str(start_daemon()) if me.leader else None,
                                   "sharing the embedded daemon's socket"))
    return me, path


def check_agreement(everyone: list[dict]) -> None:
    """Raise StateError unless every rank (one dict each: rank, host, job,
    model signature, device, GPUs of its host, backend of the caller's group)
    can share the job. NCCL needs a GPU of its own per rank; gloo does not."""
    jobs = {i["job"] for i in everyone}
    if len(jobs) > 1:
        raise StateError(f"the ranks attach in different jobs {sorted(jobs)}; pass the same "
                         "job= on every rank")
    first = everyone[0]
    odd = [i for i in everyone if i["model"] != first["model"]]
    if odd:
        raise StateError(
            f"the ranks disagree on the model or the attach options: ranks "
            f"{[i['rank'] for i in odd]} differ from rank {first['rank']} (first difference: "
            f"{_first_difference(odd[0]['model'], first['model'])}); build the same model "
            "with the same attach options on every rank")
    if all(i.get("backend") == "gloo" for i in everyone):
        return   # gloo stages CUDA tensors through the host: ranks may share a GPU
    by_host: dict[str, list[dict]] = {}
    for i in everyone:
        by_host.setdefault(i["host"], []).append(i)
    for host, infos in by_host.items():
        cuda = [i for i in infos if i["device"].startswith("cuda")]
        gpus = max((i["gpus"] for i in cuda), default=0)
        if cuda and len(cuda) > gpus:
            raise StateError(
                f"{len(cuda)} ranks use CUDA on host {host!r}, which has {gpus} GPU(s): "
                "launch at most one rank per GPU (torchrun --nproc-per-node <= GPUs)")
        devices: dict[str, int] = {}
        for i in cuda:
            if i["device"] in devices:
                raise StateError(
                    f"ranks {devices[i['device']]} and {i['rank']} on host {host!r} both "
                    f"compute on {i['device']}; call torch.cuda.set_device(local_rank) "
                    "before tierd.attach")
            devices[i["device"]] = i["rank"]


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Owner (0..ranks-1) of each bucket: in order, to the least-loaded rank
    (ties to the lowest), which balances bytes and interleaves owners along
    backward so every rank updates while the others compute.

    >>> assign_owners([4, 4, 1, 1, 2], 2)
    [0, 1, 0, 1, 0]
    """
    load = [0] * ranks
    out = []
    for size in sizes:
        owner = min(range(ranks), key=lambda r: (load[r], r))
        load[owner] += size
        out.append(owner)
    return out


def broadcast_values(model: nn.Module, ranks: Ranks) -> None:
    """Give every node's leader the first rank's parameter values (as DDP does)."""
    if ranks.leaders is None:
        return
    with torch.no_grad():
        for _, p in model.named_parameters():
            buf = p.detach().to("cpu").clone()
            collective(lambda: dist.broadcast(buf, src=ranks.all_ranks[0], group=ranks.leaders),
                       "broadcasting rank 0's parameters")
            p.data.copy_(buf.to(p.device))


class GradReducer:
    """Sums each unit's gradients across the ranks while backward runs
    ([Note: gradient reduction]) and hands the owner the averaged result.

    ``buckets`` are tuples of TieredParams (one per unit), ``owners`` the
    local rank owning each, ``deliver(tp, grad)`` is called on the owner
    for every parameter some rank had a gradient for, and on every rank for
    the parameters of replicated buckets (:meth:`replicate`).
    """

    def __init__(self, ranks: Ranks, buckets: list[tuple], owners: list[int],
                 device: torch.device, deliver: Callable,
                 dtype: torch.dtype = torch.float32, stats=None) -> None:
        self.ranks = ranks
        self.stats = stats   # SessionStats: time waited on reductions
        self.dtype = dtype   # of the reduction buffers
        self.buckets = buckets
        self.owners = owners
        self.device = device
        self.deliver = deliver
        self.bucket_of = {tp: i for i, b in enumerate(buckets) for tp in b}
        self.expected: dict = {}              # tp -> deliveries in the first backward
        self.order: list[int] | None = None   # agreed launch order
        self.reduced_bytes = 0                # bytes this rank sent into reductions
        self.everywhere: frozenset[int] = frozenset()   # buckets every rank updates
        self._got: dict = {}
        self._grads: dict = {}            # tp -> fp32 sum of this backward's deliveries
        self._completed: list[int] = []   # buckets in the order their last gradient came
        self._ready: set[int] = set()
        self._done: set[int] = set()      # launched in this backward
        self._cursor = 0
        self._launched: deque = deque()   # (bucket, work, flat)

    def add(self, tp, grad: torch.Tensor) -> None:
        """A gradient of ``tp`` arrived (in backward)."""
        b = self.bucket_of[tp]
        if b in self._done or b in self._ready:
            raise StateError(f"parameter {tp.name!r} got more gradients in this backward than "
                             "in the first one, after its reduction was launched; tierd "
                             "learns the number of deliveries from the first backward")
        self._got[tp] = self._got.get(tp, 0) + 1
        g = grad.detach().to(torch.float32)
        prev = self._grads.get(tp)
        self._grads[tp] = g if prev is None else prev.add_(g)
        if b in self._completed:
            self._completed.remove(b)
        self._completed.append(b)
        if self.order is None:
            return
        tps = self.buckets[b]
        if all(self._got.get(p, 0) >= self.expected.get(p, 0) for p in tps):
            self._ready.add(b)
            self._launch_ready()
        self._progress()

    def flush(self) -> None:
        """End of backward: reduce every bucket left, consume every reduction."""
        if self.order is None:
            canonical = list(range(len(self.buckets)))[::-1]
            for b in canonical:
                self._launch(b)
            agreed = [self._completed]
            collective(lambda: dist.broadcast_object_list(
                agreed, src=self.ranks.all_ranks[0], group=self.ranks.control),
                "agreeing on the gradient reduction order")
            self.order = agreed[0] + [b for b in canonical if b not in agreed[0]]
            self.expected = dict(self._got)
        else:
            for b in self.order[self._cursor:]:
                self._launch(b)
        self._progress(force=True)
        self._got.clear()
        self._grads.clear()
        self._completed.clear()
        self._ready.clear()
        self._done.clear()
        self._cursor = 0

    def replicate(self, buckets: frozenset[int]) -> None:
        """From the next backward on, reduce ``buckets`` to every rank and hand
        them out everywhere ([Note: resident units are replicas])."""
        self.everywhere = frozenset(buckets)

    # ------------------------------------------------------------ internals
    def _launch_ready(self) -> None:
        while self._cursor < len(self.order) and self.order[self._cursor] in self._ready:
            self._launch(self.order[self._cursor])
            self._cursor += 1

    def _launch(self, b: int) -> None:
        self._ready.discard(b)
        self._done.add(b)
        tps = self.buckets[b]
        parts = [self._grads.pop(tp).reshape(-1) if tp in self._grads
                 else torch.zeros(tp.param.numel(), device=self.device) for tp in tps]
        # the "had a gradient" flags are made on the device: a host tensor
        # copied in would be a pageable copy, which waits for the stream to
        # drain and so would stall the host once per unit
        had = [torch.ones(1, device=self.device) if tp in self._got
               else torch.zeros(1, device=self.device) for tp in tps]
        flat = torch.cat(parts + had).to(self.dtype)
        self.reduced_bytes += flat.numel() * flat.element_size()
        r = self.ranks
        if r.nodes == 1 and b not in self.everywhere:   # only the node's owner needs the sum
            dst = r.node_ranks[self.owners[b]]
            work = collective(lambda: dist.reduce(flat, dst=dst, group=r.group, async_op=True),
                              "the gradient reduction")
        else:
            work = collective(lambda: dist.all_reduce(flat, group=r.group, async_op=True),
                              "the gradient reduction")
        self._launched.append((b, work, flat))

    def _progress(self, force: bool = False) -> None:
        while self._launched:
            b, work, flat = self._launched[0]
            if not force and len(self._launched) <= LAG and not work.is_completed():
                return
            self._launched.popleft()
            t0 = time.perf_counter()
            collective(work.wait, "the gradient reduction")
            if self.stats is not None:
                self.stats.wait_seconds += time.perf_counter() - t0
            if self.owners[b] == self.ranks.local_rank or b in self.everywhere:
                self._hand_out(b, flat)

    def _hand_out(self, b: int, flat: torch.Tensor) -> None:
        tps = self.buckets[b]
        flat = flat.to(torch.float32).div_(self.ranks.world)
        if all(tp in self._got for tp in tps):
            had = [True] * len(tps)   # known without reading the device
        else:   # some rank may have had a gradient this one lacks: read the counts
            had = [c > 0 for c in flat[-len(tps):].tolist()]
        offset = 0
        for tp, present in zip(tps, had):
            n = tp.param.numel()
            if present:
                self.deliver(tp, flat[offset:offset + n].view(tp.param.shape))
            offset += n
