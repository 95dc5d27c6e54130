"""The CUDA caching allocator under tierd: expandable segments.

[Note: expandable segments]
tierd's copies in allocate on the copy-in stream and the model's work on the
compute stream, and the caching allocator keeps each stream's freed blocks
for that stream. Where the plan streams, a step runs within a few GB of the
cap; with segments of fixed sizes, a request that no cached segment of its
stream can serve makes the allocator free every cached segment and try
again, which synchronizes every stream (placement logs these as retries).
With expandable segments a stream's segment grows and shrinks by pages, so
memory one stream let go serves another without that. Measured on an H100
(`python -m tierd.bench.placement --case "Llama 8B" --steps 12 --ref-steps 4
--sync-steps 2`: Llama 8B, B=4, T=1024, checkpointing, capped at the card's
84 GB, 52 GB each way a step; each pair in one call): with fixed segments
2-3 retries a step, one of them in the backward with compute idle, 1.184 s
a step (1.16x its PCIe floor); under ``PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True`` about one retry in two steps, 1.129 s (1.11x)
(0000553). With this default, 1.114 s (1.09x) against 1.175 s with
``expandable_segments=False`` (055560a). On the H200 a 13B Llama at free
memory stepped in 1.453 s under the environment variable against 1.546 s.

So attach on CUDA turns expandable segments on for the process, unless its
allocator settings already name them either way (``PYTORCH_CUDA_ALLOC_CONF``
or ``PYTORCH_ALLOC_CONF``, or set while running: that choice stands) or the
attach says ``expandable_segments=False``. Segments made before stay as they
are; every segment made after follows the setting, the user's tensors'
included (torch's own setting, process-wide).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

from tierd.client import torch_internals

log = logging.getLogger("tierd.attach")

_SETTING = "expandable_segments"
_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def wants_expandable(device: torch.device, setting: bool | None,
                     env: Mapping[str, str] = os.environ, current: str | None = None) -> bool:
    """Whether attach on ``device`` turns expandable segments on: ``setting``
    (the attach config's; None: unless the process's allocator settings,
    ``env``'s and ``current``, already name them).

    Example:
        >>> cuda = torch.device("cuda", 0)
        >>> wants_expandable(cuda, None, env={}), wants_expandable(torch.device("cpu"), None, env={})
        (True, False)
        >>> wants_expandable(cuda, None, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
        False
    """
    if device.type != "cuda" or setting is False:
        return False
    if setting:
        return True
    chosen = [env.get(k, "") for k in _ENV] + [current or ""]
    return not any(_SETTING in text for text in chosen)


def use_expandable_segments(device: torch.device, setting: bool | None) -> bool:
    """Turn expandable segments on where :func:`wants_expandable` says so
    ([Note: expandable segments]); returns whether this call changed the setting."""
    if device.type != "cuda":
        return False
    current = torch_internals.allocator_settings()
    if not wants_expandable(device, setting, current=current):
        return False
    if current is not None and f"{_SETTING}:True" in current:
        return False
    torch_internals.set_allocator_settings(f"{_SETTING}:True")
    log.info("tierd: CUDA caching allocator segments made from now on are expandable "
             "(attach(expandable_segments=False), or %s naming expandable_segments, "
             "leaves the allocator as it is)", _ENV[0])
    return True
