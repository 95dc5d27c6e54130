"""The three systems of ``tierd.bench.bigmodel``, each set up as its users would.

Each ``setup_*(spec, shape, device, mark)`` builds the model its own way,
calling ``mark(name)`` as it enters each part (so a row can say where an
attempt ended and how long each part took), and returns a :class:`Trainer`
whose ``step(ids)`` runs one training step (forward with labels = inputs,
backward, optimizer step, gradients cleared) and returns the loss. Each runs
in a fresh worker process (``tierd.bench.bigmodel_worker``), world size 1.

``allgpu`` is no peer but the reference for a row's floor ([Note: a row's
floor] in ``tierd.bench.bigmodel_floor``): the same model and step with
everything on the GPU (fp32 weights, bf16 autocast, torch's fused AdamW),
run on a model small enough for that at the width of the rows it serves.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierd.bench.bigmodel_models import Shape, build, build_meta, init_materialised
from tierd.bench.compact import SETTINGS as OPTIMIZER_STATES, kept_bytes_per_param

BF16 = torch.bfloat16
#: the systems compared (the default of ``--systems``)
PEERS = ("tierd", "deepspeed", "fsdp2")
SYSTEMS = (*PEERS, "allgpu")
#: called by a setup as it enters each named part
Mark = Callable[[str], None]


@dataclass(kw_only=True)
class Trainer:
    """One system ready to train: ``step(ids) -> loss`` and what was noticed."""

    step: Callable[[torch.Tensor], torch.Tensor]
    notes: list[str] = field(default_factory=list)
    #: tierd: its cumulative byte counters (``bigmodel_floor.traffic``), read
    #: around each step
    traffic: Callable[[], dict] | None = None
    #: tierd: what its plan moves per step (``bigmodel_floor.plan_bytes``),
    #: read after the steps
    plan: Callable[[], dict] | None = None
    #: tierd: the bytes its optimizer setting keeps at rest per trained parameter
    bytes_per_param: float | None = None


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One attempt, as the parent hands it to the worker."""

    system: str
    model: str
    batch: int
    seq: int
    warmup: int
    steps: int
    device: str                      # "cuda" or "cpu"
    lr: float = 1e-5
    tierd_pool_bytes: int | None = None    # None: the embedded daemon's own sizing
    tierd_nvme_bytes: int | None = None
    #: tierd's AdamW state, a name of ``tierd.bench.compact.SETTINGS`` (the
    #: others keep their own fp32 AdamW)
    optimizer_state: str = "fp32"
    #: activation checkpointing of every layer (off: activations kept for
    #: backward, no recompute)
    checkpointing: bool = True

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system={self.system!r}; use one of {SYSTEMS}")
        if self.optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state={self.optimizer_state!r}; use one of "
                             f"{', '.join(OPTIMIZER_STATES)}")
        if self.optimizer_state != "fp32" and self.system != "tierd":
            raise ValueError(f"optimizer_state={self.optimizer_state!r} is tierd's; "
                             f"{self.system} runs its own fp32 AdamW")
        for f in ("batch", "seq", "steps"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} must be >= 0")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; use 'cuda' or 'cpu'")


def _autocast_step(model, opt, device: torch.device) -> Callable:
    def step(ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=BF16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


# ------------------------------------------------------------------ tierd
def setup_tierd(spec: RunSpec, shape: Shape, device: torch.device, mark: Mark) -> Trainer:
    """Built in bf16 on the compute device (random init there is fast and needs
    no host memory), then ``attach`` with default arguments: it copies each
    module's values into the store and frees the device copies
    (``ParamRegistry._take``), then places what fits back on the GPU. A
    compact ``spec.optimizer_state`` is given to ``attach`` (its capacity
    check and the embedded daemon's sizes count it) and to
    ``tierd.optim.AdamW(state=, master=)``."""
    import tierd
    import tierd.optim
    state, master = OPTIMIZER_STATES[spec.optimizer_state]
    setting = tierd.optim.CompactState(state=state, master=master)
    notes: list[str] = []
    mark("build")
    model = build(shape, spec.seq, device, BF16, spec.checkpointing)
    options = {}
    if spec.tierd_pool_bytes is not None:
        mark("daemon")
        options["client"] = _private_daemon(spec, notes)
    if device.type == "cpu":   # the CPU smoke run, even where CUDA is present
        options["device"] = device
    if not setting.exact:
        options["optimizer_state"] = setting
        notes.append(f"tierd.optim.AdamW({setting.text})")
    mark("attach")
    model = tierd.attach(model, compute_dtype="bf16", **options)
    mark("optimizer")
    opt = tierd.optim.AdamW(model.parameters(), lr=spec.lr, state=state, master=master)
    from tierd.bench import bigmodel_floor
    from tierd.client.attach import session_of
    session = session_of(model)
    return Trainer(step=_autocast_step(model, opt, device), notes=notes,
                   traffic=lambda: bigmodel_floor.traffic(session),
                   plan=lambda: bigmodel_floor.plan_bytes(session),
                   bytes_per_param=kept_bytes_per_param(opt))


def _private_daemon(spec: RunSpec, notes: list[str]):
    """A client of a daemon of the sizes the flags gave (stopped at exit)."""
    import atexit

    import tierd
    from tierd.client.embedded import start_daemon
    daemon = start_daemon(pool=spec.tierd_pool_bytes, nvme_size=spec.tierd_nvme_bytes)
    atexit.register(daemon.stop)
    nvme = "its default" if spec.tierd_nvme_bytes is None else \
        f"{spec.tierd_nvme_bytes / 2**30:.2f} GiB"
    notes.append(f"daemon pool {spec.tierd_pool_bytes / 2**30:.2f} GiB, NVMe {nvme} "
                 "(set by flags)")
    return tierd.connect(daemon.socket)


# ------------------------------------------------------------------ one-process "world"
def single_process_env() -> None:
    """The environment a launcher gives rank 0 of a world of 1 (a free port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


# ------------------------------------------------------------------ DeepSpeed
def deepspeed_config(batch: int, hidden: int, lr: float) -> dict:
    """ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory, bf16,
    AdamW through the config (with CPU offload DeepSpeed picks DeepSpeedCPUAdam).
    The bucket sizes are the ones Hugging Face's Trainer fills in for "auto"
    from the hidden size (what most users of ZeRO-3 offload run)."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999],
                                                  "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(spec: RunSpec, shape: Shape, device: torch.device, mark: Mark) -> Trainer:
    """Built inside ``zero.Init`` (each module partitioned to pinned CPU memory as
    it is made, in bf16), then ``deepspeed.initialize``; the engine runs bf16
    itself (no autocast)."""
    mark("import deepspeed")
    if device.type == "cpu":   # the CPU smoke run, even where CUDA is present
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from transformers import LlamaForCausalLM

    from tierd.bench.bigmodel_models import checkpointed, llama_config
    mark("init_distributed")
    single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    cfg = deepspeed_config(spec.batch, shape.hidden, spec.lr)
    torch.manual_seed(0)
    mark("build in zero.Init")
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(llama_config(shape, spec.seq))
    model = checkpointed(model, spec.checkpointing)
    mark("deepspeed.initialize")
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=cfg)

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()   # also clears the gradients
        return loss.detach()
    return Trainer(step=step, notes=[f"optimizer {type(optimizer.optimizer).__name__}"
                                     if hasattr(optimizer, "optimizer") else
                                     f"optimizer {type(optimizer).__name__}"])


# ------------------------------------------------------------------ FSDP2
def setup_fsdp2(spec: RunSpec, shape: Shape, device: torch.device, mark: Mark) -> Trainer:
    """``fully_shard`` on each decoder layer and the root with CPU offload
    (pinned on CUDA) and bf16 parameters / fp32 reduction; the model is built on
    meta, materialised on the CPU and initialised there (its rotary buffers on
    the compute device: FSDP2 does not move buffers)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mark("init_process_group")
    single_process_env()
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    mark("fully_shard on meta")
    model = build_meta(shape, spec.seq, spec.checkpointing)
    policy = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=BF16,
                                                            reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=cuda))
    for layer in model.model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)
    mark("materialise on the CPU")
    model.to_empty(device="cpu")
    init_materialised(model, device)
    mark("optimizer")
    notes = [] if cuda else ["CPU run: offloaded parameters not pinned (no CUDA)"]
    opt = CpuAdamW(model.parameters(), spec.lr, notes)
    return Trainer(step=_autocast_step(model, opt, device), notes=notes)


class CpuAdamW:
    """torch AdamW on the offloaded parameters: the fused CPU kernel where torch
    accepts it, else foreach. Fused is given up at construction or, since a
    kernel missing for these tensors shows only when it runs, at the first
    step (before it updates anything); ``notes`` says which one runs."""

    def __init__(self, params, lr: float, notes: list[str]) -> None:
        self.params, self.lr, self.notes = list(params), lr, notes
        self.checked = False
        try:
            self.opt = self._make(fused=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            self._fall_back(f"refused ({exc})")

    def _make(self, fused: bool) -> torch.optim.AdamW:
        kind = {"fused": True} if fused else {"foreach": True}
        opt = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.01, **kind)
        self.notes.append(f"optimizer torch AdamW ({next(iter(kind))})")
        return opt

    def _fall_back(self, why: str) -> None:
        self.notes.append(f"fused AdamW {why[:300]}; foreach instead")
        self.opt = self._make(fused=False)

    def step(self) -> None:
        if self.checked:
            self.opt.step()
            return
        try:
            self.opt.step()
        except (RuntimeError, NotImplementedError) as exc:
            if isinstance(exc, torch.OutOfMemoryError) or not self.opt.defaults.get("fused"):
                raise
            self._fall_back(f"failed at its first step ({exc})")
            self.opt.step()
        self.checked = True

    def zero_grad(self) -> None:
        self.opt.zero_grad()


# ------------------------------------------------------------------ all on the GPU
def setup_allgpu(spec: RunSpec, shape: Shape, device: torch.device, mark: Mark) -> Trainer:
    """The floor's compute reference: fp32 on the compute device, bf16
    autocast, torch AdamW (fused on CUDA), checkpointing as every system."""
    mark("build")
    model = build(shape, spec.seq, device, torch.float32, spec.checkpointing)
    mark("optimizer")
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, **fused)
    return Trainer(step=_autocast_step(model, opt, device),
                   notes=[f"torch AdamW ({'fused' if fused else 'default'})"])


SETUPS = {"tierd": setup_tierd, "deepspeed": setup_deepspeed, "fsdp2": setup_fsdp2,
          "allgpu": setup_allgpu}
