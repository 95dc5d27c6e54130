"""Capacity: what a model needs from tierd's store, what a machine or a
daemon has, the embedded daemon's sizes, and the error that names sizes
that work. Plain code: no sockets, no processes (``tierd.client.embedded``
asks the daemon and the machine, then calls this).

Example:
    >>> need = StoreNeed(params=2 << 30, master=4 << 30, optimizer=8 << 30,
    ...                  gradients=4 << 30, largest=1 << 30)
    >>> sizes = embedded_sizes(need, Machine(available_ram=16 << 30, free_disk=100 << 30))
    >>> sizes.pool / GiB, sizes.nvme_size / GiB   # half the RAM; the rest (no gradients) twice on NVMe
    (8.0, 14.875)

[Note: what the store holds for a model]
Each parameter (tied ones once) has its compute-dtype copy (``p/``); below
fp32 a trainable one also has its fp32 master (``master/``). A trainable
parameter gets the fp32 gradient the first step sums in the pool (``grad/``)
and its optimizer's state (``optim/``). At attach the optimizer does not
exist yet: its state is counted as AdamW's two fp32 moments (8 B per
trainable parameter, the most a ``tierd.optim`` optimizer keeps), or as the
compact setting ``AttachConfig.optimizer_state`` names; the optimizer's
constructor then checks what it really adds. Each tensor costs
its record on NVMe, whichever tier holds it (a header page and the data
rounded up to a page, see ``tierd.backends.recordio``), and the daemon
admits at most pool + NVMe less its largest tensor (kept free for swapping,
see ``tierd.server.admission``). Buffers are on the compute device, not in
the store: they are reported, not counted. Saved activations that
``activations=`` tiers are not counted either (their size is only known
once a step ran): the embedded daemon's pool keeps room beyond the model
for them.

[Note: the GPU counted]
Placement keeps units' weights and optimizer state on the GPU between steps
(``tierd.client.placement``), and their values leave the store ([Note:
resident state leaves the store] in ``tierd.updates.resident``; moments of
resident units are made on the device: [Note: state made when first
needed] in ``tierd.optim.state``). So the GPU is room too: ``device`` is
what placement may keep there, taken as three quarters of the placement
cap, since the step's activations and the streaming window, which take the
rest, are measured only by the first step (fp32 masters attach does not store are
made by it too: [Note: masters made when first needed] in
``tierd.client.registry``) (a Llama-3-8B layer stack at
T=2048, B=4 with checkpointing needs well under a quarter of an H200 for
them). The embedded daemon's NVMe file is still sized as if nothing were on
the GPU (within the disk): a plan that keeps less than assumed then spills
instead of failing. The store then needs the model's state
less that, but never less than what the first step needs before any plan
exists: compute copies, masters and the gradients it sums
(:attr:`StoreNeed.total`); gradients count only there, since from the
first update on each is freed as soon as it is used ([Note: gradients freed
as they are used] in ``tierd.optim.base``). An optimizer that keeps them in
the store every step (clipping, a window of several backwards, CPU updates)
counts them there too (``gradients_kept``). If the plan keeps less than assumed, storing the
rest fails then with a CapacityError. Under torch.distributed nothing is
counted: every rank reads the owners' keys, so they stay in the store.

[Note: RAM the model gives back]
A model built on the CPU holds its parameters in this process's memory when
the embedded daemon is sized, and attach frees each module's parameters once
their values are stored (the caller's Parameters keep no bytes). So that
memory counts as available for the pool: an 8B model built in bf16 would
otherwise shrink the pool by 16 GB for good. (Another reference to the same
storage, e.g. a state_dict kept aside, keeps it alive: the RAM headroom
absorbs a small one.)

[Note: embedded daemon sizes]
The pool is a budget, not an allocation: segments are made as tensors
arrive, so a pool larger than the model costs nothing until used, and a
larger pool lets more keys be held (``hold_fraction``) and more leases be in
flight. So the pool asks for twice the model's state (everything holdable)
and never less than the half of the available RAM up to 32 GiB that every
embedded daemon had, within what the RAM gives. The NVMe file is
preallocated at start, so it is sized from the need: what the pool cannot
hold plus slack (a record may span several free extents, so free bytes are
as good as an extent: see [Note: records in several extents] in
tierd.backends.recordio), and as much again as the pool cannot hold: a model
larger than the pool streams that much through it each pass, and the tensors
read back in keep their NVMe copies only while the file has room for them,
so evicting them again costs no write ([Note: what reading ahead writes]
in tierd.server.readahead); and for a named job (which may commit) room for
two commits (a commit writes every tensor; copy-on-write keeps the previous
one until the next is complete), within what the disk gives. The sizes an
error suggests (:func:`shortfall`) keep the same margin.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

from tierd.backends.recordio import RecordMeta

GiB = 1 << 30
MiB = 1 << 20
PAGE = 4096
#: AdamW's two fp32 moments per trainable parameter: what attach assumes.
ADAMW_STATE_BYTES = 8
GRAD_BYTES = 4   # the fp32 gradient the first step sums in the pool (but under a bf16 master)
#: kept for the training process (CUDA context, torch, copy buffers: an 8B model's
#: first step used ~20 GB besides the pool), the daemon and the page cache
RAM_HEADROOM = (16 * GiB, 0.15)
DISK_HEADROOM = (4 * GiB, 0.05)
OLD_POOL_CAP = 32 * GiB   # the embedded daemon's sizes before they came from the model
OLD_NVME_CAP = 256 * GiB
MIN_NVME = 1 * GiB
_JOB_ESTIMATE = "j" * 64   # a job name's length bounds its share of a record header
_MARGIN_MIN = 1 << 30       # CUDA: fragmentation and allocator slack
_MARGIN_FRACTION = 0.04

KINDS = ("params", "master", "optimizer", "gradients")


def record_bytes(key: str, nbytes: int, job: str | None = None) -> int:
    """Bytes one tensor of ``nbytes`` counts against pool + NVMe."""
    return RecordMeta(key, job or _JOB_ESTIMATE, "uint8", (), nbytes, 0).record_len()


def headroom(amount: int, rule: tuple[int, float]) -> int:
    """What stays free of ``amount``: max(fixed, fraction), never above half."""
    fixed, fraction = rule
    return min(max(fixed, int(amount * fraction)), amount // 2)


def size_text(n: int) -> str:
    """A size for people: ``12.3 GiB``, ``40.0 MiB``."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def flag_size(n: int) -> str:
    """A size for a flag or variable, rounded up: ``13GiB``, ``300MiB``."""
    return f"{math.ceil(n / GiB)}GiB" if n >= 4 * GiB else f"{max(1, math.ceil(n / MiB))}MiB"


@dataclass(frozen=True)
class StoreNeed:
    """Bytes the store must hold, by kind ([Note: what the store holds for a model])."""

    params: int = 0      # compute-dtype copies
    master: int = 0      # fp32 masters (compute dtype below fp32)
    optimizer: int = 0   # optimizer state
    gradients: int = 0   # gradients summed in the pool (fp32, or a bf16 master's)
    buffers: int = 0     # on the compute device: reported, not in ``total``
    largest: int = 0     # the largest single record
    assumed_optimizer: bool = False   # optimizer counted as AdamW (no optimizer yet)
    released: int = 0    # process memory attach frees: the model's CPU parameters
    device: int = 0      # GPU room placement may keep state in ([Note: the GPU counted])
    #: of ``master``: masters the first update makes, not attach (tierd.client.registry,
    #: [Note: masters made when first needed])
    master_later: int = 0
    #: gradients stay in the store every step (clipping, accumulation, CPU
    #: updates), not only in the first ([Note: the GPU counted])
    gradients_kept: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool) and value < 0:
                raise ValueError(f"StoreNeed.{f.name}={value} must be >= 0")

    @classmethod
    def of(cls, items: Iterable[tuple[str, str, int]], *, job: str | None = None,
           existing: Iterable[str] = (), buffers: int = 0,
           assumed_optimizer: bool = False, released: int = 0,
           device: int = 0, later: Iterable[str] = (),
           gradients_kept: bool = False) -> "StoreNeed":
        """Sum ``(kind, key, nbytes)`` items whose key is not in ``existing``;
        masters whose key is in ``later`` are made by the first update."""
        have, after = set(existing), set(later)
        sums = dict.fromkeys(KINDS, 0)
        largest = master_later = 0
        for kind, key, nbytes in items:
            if kind not in sums:
                raise ValueError(f"kind {kind!r} is not one of {KINDS}")
            if key in have:
                continue
            size = record_bytes(key, nbytes, job)
            sums[kind] += size
            master_later += size if kind == "master" and key in after else 0
            largest = max(largest, size)
        return cls(**sums, buffers=buffers, largest=largest,
                   assumed_optimizer=assumed_optimizer, released=released, device=device,
                   master_later=master_later, gradients_kept=gradients_kept)

    @property
    def state(self) -> int:
        """Everything training keeps, wherever it lives."""
        return self.params + self.master + self.optimizer + self.gradients

    @property
    def first_step(self) -> int:
        """What the first step stores before any plan: compute copies, the
        masters attach stores, and the gradients it sums."""
        return self.params + self.master - self.master_later + self.gradients

    @property
    def total(self) -> int:
        """What the store must hold: the state but the gradients (freed as the
        update uses them) less what the GPU may keep, at least what the first
        step stores ([Note: the GPU counted])."""
        return max(self.first_step, self.without_gpu - self.device)

    @property
    def without_gpu(self) -> int:
        """:attr:`total` with nothing kept on the GPU."""
        return max(self.first_step, self.state - (0 if self.gradients_kept else self.gradients))

    def describe(self) -> str:
        parts = [f"parameters {size_text(self.params)}"]
        if self.master:
            parts.append(f"fp32 masters {size_text(self.master)}")
        if self.optimizer:
            how = " (AdamW's two moments assumed)" if self.assumed_optimizer else ""
            parts.append(f"optimizer state {size_text(self.optimizer)}{how}")
        if self.gradients:
            parts.append(f"gradients {size_text(self.gradients)}")
        text = " + ".join(parts)
        if self.total == self.state:
            return text + f" = {size_text(self.total)}"
        if self.total == self.first_step:
            return (text + f" = {size_text(self.state)}, of which the store holds at most "
                    f"the first step's parameters, masters and gradients, "
                    f"{size_text(self.total)}")
        freed = "" if self.gradients_kept else "the gradients (freed as the update uses them) and "
        return (text + f" = {size_text(self.state)}, less {freed}{size_text(self.device)} "
                f"the GPU may keep = {size_text(self.total)}")


@dataclass(frozen=True)
class Machine:
    """What this machine has for an embedded daemon: RAM available (and
    ``released``: what the attach about to run frees, see [Note: RAM the
    model gives back]) and free disk at its NVMe directory, each less headroom."""

    available_ram: int
    free_disk: int
    nvme_dir: Path | None = None
    released: int = 0

    @property
    def ram(self) -> int:
        return self.available_ram + self.released

    @property
    def pool_limit(self) -> int:
        return self.ram - headroom(self.ram, RAM_HEADROOM)

    @property
    def nvme_limit(self) -> int:
        return self.free_disk - headroom(self.free_disk, DISK_HEADROOM)

    def describe(self) -> str:
        where = f" at {self.nvme_dir}" if self.nvme_dir else ""
        freed = (f" + {size_text(self.released)} of the model's CPU parameters attach frees"
                 if self.released else "")
        return (f"this machine gives a pool up to {size_text(self.pool_limit)} "
                f"({size_text(self.available_ram)} RAM available{freed}, less headroom) and "
                f"NVMe up "
                f"to {size_text(self.nvme_limit)} ({size_text(self.free_disk)} disk "
                f"free{where} less headroom)")


@dataclass(frozen=True)
class DaemonRoom:
    """A daemon's sizes and use, from its status answer (``stats()``)."""

    pool: int
    nvme: int
    stored: int = 0
    largest: int = 0
    held_only: int = 0
    tensors: int = 0
    sessions: int = 0

    @classmethod
    def from_stats(cls, stats: dict) -> "DaemonRoom | None":
        """None when the store does not report its admission figures (an
        in-process test store): nothing to check against."""
        try:
            return cls(pool=int(stats["pool_bytes"]), nvme=int(stats["nvme_bytes"]),
                       stored=int(stats["stored_bytes"]), largest=int(stats["largest_bytes"]),
                       held_only=int(stats["held_only_bytes"]),
                       tensors=int(stats.get("tensors", 0)),
                       sessions=int(stats.get("sessions", 0)))
        except KeyError:
            return None

    def free(self, largest: int = 0) -> int:
        """Bytes still admitted when the largest tensor becomes ``largest``."""
        return max(0, self.pool + self.nvme - max(self.largest, largest)
                   - self.held_only - self.stored)

    def holds(self, need: StoreNeed) -> bool:
        return need.total <= self.free(need.largest) and need.largest <= self.pool

    def required(self, need: StoreNeed) -> int:
        """pool + NVMe that would hold what is stored and ``need``."""
        return (self.stored + self.held_only + need.total
                + max(self.largest, need.largest))

    @property
    def idle(self) -> bool:
        """Nothing stored and no client but the one asking."""
        return self.tensors == 0 and self.sessions <= 1


@dataclass(frozen=True)
class Sizes:
    """An embedded daemon's pool and NVMe file, in bytes."""

    pool: int
    nvme_size: int

    def __post_init__(self) -> None:
        for name in ("pool", "nvme_size"):
            if getattr(self, name) < PAGE:
                raise ValueError(f"Sizes.{name}={getattr(self, name)} B is below one page "
                                 f"({PAGE} B)")


def nvme_for(spill: int, need: StoreNeed) -> int:
    """NVMe for ``spill`` bytes the pool cannot hold: that plus slack
    ([Note: embedded daemon sizes])."""
    return max(0, spill) + slack(need)


def slack(need: StoreNeed) -> int:
    """Room beyond the need: new versions of a batch being replaced, leases."""
    return max(256 * MiB, need.total // 16)


def embedded_sizes(need: StoreNeed, machine: Machine, *, commits: bool = False,
                   pool: int | None = None, nvme_size: int | None = None) -> Sizes:
    """The embedded daemon's sizes ([Note: embedded daemon sizes]); a given
    ``pool``/``nvme_size`` (argument or variable) wins."""
    total, largest = need.total, need.largest
    if pool is None:
        floor = min(machine.ram // 2, OLD_POOL_CAP)
        pool = min(machine.pool_limit, max(floor, 2 * total + largest + slack(need)))
    if nvme_size is None:
        # as if nothing were on the GPU ([Note: the GPU counted])
        beyond = need.without_gpu + largest - pool
        spill = nvme_for(beyond, need) + max(0, beyond)   # the spill, read back, keeps copies
        room = 2 * total + largest + slack(need) if commits else 0
        nvme_size = min(machine.nvme_limit, max(MIN_NVME, spill, room))
    return Sizes(max(pool, PAGE), max(nvme_size, PAGE))


def device_room(cap: int | None) -> int:
    """The GPU room counted for state under a placement cap ([Note: the GPU counted])."""
    return 0 if cap is None else cap * 3 // 4


def margin_for(cap: int | None, *, explicit: bool, cuda: bool) -> int:
    """Device bytes a plan leaves free under ``cap``: a fraction of it, and
    on free memory (no explicit cap) at least the allocator's slack; none on
    the CPU (nothing is measured)."""
    fraction = int(_MARGIN_FRACTION * (cap or 0))
    return 0 if not cuda else fraction if explicit else max(_MARGIN_MIN, fraction)


def estimate_budget(cap: int, margin: int, free: int | None = None) -> int:
    """Device bytes a plan estimated from sizes may hold ([Note: the plan
    before a step is measured] in tierd.client.placer): three quarters of
    ``cap``, within ``free`` (the device's free memory and what the plan holds
    already), less ``margin``.

    Example:
        >>> estimate_budget(40, 2), estimate_budget(40, 2, free=20)
        (28, 18)
    """
    room = device_room(cap)
    if free is not None:
        room = min(room, free)
    return max(0, room - margin)


def model_need(model, compute_dtype, keys, *, job: str | None = None,
               existing: Iterable[str] = (), device: int = 0,
               lazy_masters: bool = False, optimizer_state=None) -> StoreNeed:
    """What attaching ``model`` stores and its training adds, keys in
    ``existing`` (a resumed job's) excepted; ``keys`` is its
    :class:`~tierd.client.keys.ModelKeys` ([Note: what the store holds for a
    model]); ``device``: the GPU room counted ([Note: the GPU counted]);
    ``lazy_masters``: attach leaves out masters of parameters already in the
    compute dtype ([Note: masters made when first needed] in tierd.client.registry);
    ``optimizer_state``: the optimizer's compact setting, whose sizes replace
    AdamW's fp32 master and moments (:class:`tierd.client.optimizers.StateSizes`)."""
    import torch   # only here: the rest of this module is torch-free

    items: list[tuple[str, str, int]] = []
    later: list[str] = []
    for name, p in model.named_parameters():   # tied parameters once
        dtype = compute_dtype if p.is_floating_point() else p.dtype
        n = p.numel()
        items.append(("params", keys.param(name), n * dtype.itemsize))
        if not p.requires_grad:
            continue
        like = torch.empty(p.shape, dtype=dtype, device="meta")
        in_compute = optimizer_state is not None and optimizer_state.master_in_compute(like)
        if dtype != torch.float32 and not in_compute:
            items.append(("master", keys.master(name), n * 4))
            if lazy_masters and p.dtype == dtype:
                later.append(keys.master(name))
        # in the master's dtype ([Note: the stored gradient's dtype] in tierd.client.tiered_param)
        items.append(("gradients", keys.grad(name), n * (dtype.itemsize if in_compute
                                                         else GRAD_BYTES)))
        moment = (n * ADAMW_STATE_BYTES // 2 if optimizer_state is None
                  else optimizer_state.moment_nbytes(like))
        for state in ("exp_avg", "exp_avg_sq"):
            items.append(("optimizer", keys.state(state, name), moment))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = any(p.requires_grad for p in model.parameters())
    released = sum(p.numel() * p.element_size() for p in model.parameters()
                   if p.device.type == "cpu")   # meta ones hold nothing
    return StoreNeed.of(items, job=job, existing=existing, buffers=buffers,
                        assumed_optimizer=trainable, released=released, device=device,
                        later=later)


def unsized_defaults(machine: Machine) -> Sizes:
    """Sizes for a daemon started without a model to size it for (a
    benchmark's private daemon): half the RAM up to 32 GiB, half the free
    disk up to 256 GiB, as every embedded daemon had before sizing."""
    return Sizes(max(PAGE, min(machine.available_ram // 2, OLD_POOL_CAP)),
                 max(PAGE, min(machine.free_disk // 2, OLD_NVME_CAP)))


def disk_free_for(nvme: int) -> int:
    """Free disk at which :attr:`Machine.nvme_limit` reaches ``nvme``."""
    fixed, fraction = DISK_HEADROOM
    return max(nvme + fixed, math.ceil(nvme / (1 - fraction)))


@dataclass(frozen=True)
class Sizing:
    """How an embedded daemon got its sizes: the machine it measured and what
    set each size ("" for the machine, else the variable or "given to start_daemon")."""

    machine: Machine
    sizes: Sizes
    pool_from: str = ""
    nvme_from: str = ""


def shortfall(need: StoreNeed, room: DaemonRoom, *, what: str, daemon: str,
              sizing: Sizing | None = None, attaching: bool = True) -> str | None:
    """None when ``room`` holds ``need``; else the CapacityError text: the
    need broken down, what the daemon has, and sizes that would work.
    ``sizing`` is given for this process's embedded daemon; ``attaching``
    says an attach asks (which restarts an idle embedded daemon larger)."""
    if room.holds(need):
        return None
    required = room.required(need)
    lines = [f"{daemon[:1].upper()}{daemon[1:]} cannot hold {what}: it needs "
             f"{need.describe()}, largest tensor "
             f"{size_text(need.largest)}; the daemon has {size_text(room.free(need.largest))} "
             f"free ({_have(room, need)}).{_gpu_text(need)}"]
    if need.largest > room.pool:
        lines.append(f"Its largest tensor ({size_text(need.largest)}) is larger than the "
                     f"pool ({size_text(room.pool)}): the pool must hold it.")
    lines.append(_embedded_fix(room, required, need, sizing, attaching) if sizing is not None
                 else _serve_fix(room, required, need))
    if need.assumed_optimizer:
        lines.append("(Trainable parameters are counted with AdamW's state and a gradient; "
                     "for inference only, call model.requires_grad_(False) before attach.)")
    return "\n".join(lines)


def _gpu_text(need: StoreNeed) -> str:
    if need.device:
        return (f" {size_text(need.device)} of GPU room (three quarters of the placement "
                "cap) is counted for state kept on it; a larger gpu_memory_bytes counts more.")
    return (" No GPU room is counted (no placement cap: CPU without gpu_memory_bytes, "
            "gpu_memory_bytes=0, or torch.distributed).")


def _have(room: DaemonRoom, need: StoreNeed) -> str:
    text = f"pool {size_text(room.pool)} + NVMe {size_text(room.nvme)}"
    if room.stored:
        text += f", {size_text(room.stored)} stored in {room.tensors} tensors"
    text += f", {size_text(max(room.largest, need.largest))} kept free for swapping"
    if room.held_only:
        text += f", {size_text(room.held_only)} of older versions the last commits keep"
    return text


def _serve_fix(room: DaemonRoom, required: int, need: StoreNeed) -> str:
    pool = max(room.pool, need.largest + slack(need))
    nvme = max(MIN_NVME, nvme_for(required - pool, need))
    return (f"Sizes that would work: pool + NVMe >= {size_text(required)}, e.g. restart it "
            f"with `tierd serve --pool {flag_size(pool)} --nvme-size {flag_size(nvme)}` "
            f"(or TIERD_POOL / TIERD_NVME_SIZE), or free room in it (`tierd status` lists "
            f"the jobs holding it).")


def _embedded_fix(room: DaemonRoom, required: int, need: StoreNeed, sizing: Sizing,
                  attaching: bool) -> str:
    m = sizing.machine
    pool_from = sizing.pool_from or "sized from the RAM"
    nvme_from = sizing.nvme_from or "sized from the disk"
    text = [f"It is this process's embedded daemon: pool {size_text(room.pool)} ({pool_from}), "
            f"NVMe {size_text(room.nvme)} ({nvme_from}); {m.describe()}."]
    if room.tensors and attaching:
        text.append(f"It already holds {room.tensors} tensors of another model or client of "
                    f"this process: detach that model first and the daemon is started "
                    f"again with larger sizes.")
    pool = room.pool if sizing.pool_from else min(max(m.pool_limit, room.pool), required)
    pool = max(pool, need.largest)
    nvme = nvme_for(required - pool, need)
    text.append(f"Sizes that would work: pool + NVMe >= {size_text(required)}: "
                + "; or ".join(_embedded_fixes(sizing, pool, nvme, required + slack(need)))
                + ".")
    return " ".join(text)


def _embedded_fixes(sizing: Sizing, pool: int, nvme: int, both: int) -> list[str]:
    """What to change for an embedded daemon of ``pool`` + ``nvme`` bytes."""
    m, fixes = sizing.machine, []
    given = [v for v in (sizing.pool_from, sizing.nvme_from) if v.startswith("TIERD_")]
    if given:
        fixes.append(f"set TIERD_POOL={flag_size(pool)} and TIERD_NVME_SIZE={flag_size(nvme)} "
                     f"(or unset {' and '.join(given)}: the embedded daemon then sizes itself "
                     f"from the model and the machine)")
    if nvme > m.nvme_limit:
        fixes.append(f"set TIERD_NVME to a directory on a disk with at least "
                     f"{size_text(disk_free_for(nvme))} free (the embedded daemon's NVMe file "
                     f"goes there; now {m.nvme_dir or 'the cache dir'})")
    if not given and not sizing.pool_from:
        fixes.append(f"on a machine with more RAM, TIERD_POOL={flag_size(both)}")
    fixes.append(f"run `tierd serve --nvme DIR --pool {flag_size(pool)} --nvme-size "
                 f"{flag_size(nvme)}` and point TIERD_SOCKET at it")
    return fixes
