"""How saved activations are tiered: the policies and their configuration."""

from __future__ import annotations

from dataclasses import dataclass

#: The activation policies (see :mod:`tierd.client.activations`); None tiers nothing.
POLICIES = ("offload", "recompute", "auto", None)


@dataclass(frozen=True, kw_only=True)
class ActivationConfig:
    """How saved activations are tiered.

    Example:
        >>> ActivationConfig(policy="auto", budget_bytes=8 << 30).policy
        'auto'
    """

    #: "offload", "recompute", "auto" or None (see :mod:`tierd.client.activations`).
    policy: str | None = "offload"
    #: Device bytes ``auto`` may leave saved activations in (None: no limit);
    #: on CUDA also what else its plan makes a step hold beyond keeping all
    #: (see [Note: measured memory correction] in :mod:`.plan`).
    budget_bytes: int | None = None
    #: Saved tensors smaller than this stay where they are.
    min_bytes: int = 1 << 20
    #: Size of the pool chunks saved tensors are packed into (at most an
    #: eighth of the pool is used, so the pool can spill and swap).
    chunk_bytes: int = 64 << 20
    #: Bytes of saved tensors brought back ahead of use in backward.
    prefetch_bytes: int = 128 << 20
    #: Log the ``auto`` plan when it is made (INFO on the ``tierd.activations``
    #: logger), and a warning when no plan fits what its first step measured.
    verbose: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}; use one of {POLICIES}")
        for f in ("min_bytes", "chunk_bytes", "prefetch_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}={getattr(self, f)} must be >= 0")
        if self.chunk_bytes == 0:
            raise ValueError("chunk_bytes=0; give a chunk size such as 64 << 20")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes={self.budget_bytes} must be >= 0 or None")
