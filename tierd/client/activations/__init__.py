"""Activation tiering: what autograd saves in a model's forward goes to the pool.

``tier_activations(model, client, policy=...)`` installs, for every forward of
``model`` that records a graph, ``torch.autograd.graph.saved_tensors_hooks``
whose pack hook copies saved tensors of at least ``min_bytes`` into the job's
pool (:mod:`.store` and :mod:`.chunks`: records, chunks, NVMe spill) and whose
unpack hook brings them back in backward, in reverse order, ahead of use.
Policies:

- ``"offload"``: every block's (and the rest's) saved tensors go to the pool;
- ``"recompute"``: each block runs under non-reentrant activation
  checkpointing (only its inputs are saved; the rest stays);
- ``"auto"``: the first step offloads and measures (bytes saved and forward
  time per block, copy bandwidth), then picks keep / offload / recompute per
  block to be fastest within ``budget_bytes`` (:mod:`.plan`) and logs the
  plan (:mod:`.auto`); on CUDA the plan's first step reads the device memory
  it takes at the hooks and, if that went over the budget, the plan is made
  once more counting what the model missed, and logged again (see [Note:
  measured memory correction] in :mod:`.plan`);
- ``None``: nothing is installed.

Blocks are the items of the model's largest ``nn.ModuleList`` (GPT-2's ``h``,
Llama's ``layers``) unless given. Tensors whose storage belongs to a
parameter or buffer (``nn.Parameter``, tierd's ``TieredParameter``: attach
moves those) and leaves that require grad are never copied: autograd keeps
its reference, as without tiering.

The modules, each importing only those before it: :mod:`.config` (the
policies), :mod:`.plan` (the ``auto`` planner, plain code), :mod:`.chunks`
(pool chunks and their requests), :mod:`.store` (saved tensors as records in
chunks), :mod:`.auto` (the ``auto`` policy's stages), :mod:`.tiering` (the
hooks and the handle). Plans are logged on the ``tierd.activations`` logger.

Example:
    >>> handle = tier_activations(model, tierd.connect(), policy="offload")  # doctest: +SKIP
    >>> model(**batch).loss.backward()                                          # doctest: +SKIP
    >>> handle.close()                                                          # doctest: +SKIP
"""

from tierd.client.activations.auto import AutoStage, measure_bandwidth
from tierd.client.activations.chunks import ChunkState
from tierd.client.activations.config import POLICIES, ActivationConfig
from tierd.client.activations.plan import (BlockMode, BlockProfile, MemoryCheck, Plan,
                                           StepMemory, check_plan, choose_plan, memory_points,
                                           plan_memory, plan_seconds)
from tierd.client.activations.store import ActivationStore, SavedActivation
from tierd.client.activations.tiering import ActivationTiering, find_blocks, tier_activations

__all__ = ["POLICIES", "ActivationConfig", "ActivationStore", "ActivationTiering", "AutoStage",
           "BlockMode", "BlockProfile", "ChunkState", "MemoryCheck", "Plan", "SavedActivation",
           "StepMemory", "check_plan", "choose_plan", "find_blocks", "measure_bandwidth",
           "memory_points", "plan_memory", "plan_seconds", "tier_activations"]
