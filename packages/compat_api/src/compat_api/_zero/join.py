"""The Join hook of ZeroRedundancyOptimizer: joined ranks keep stepping to shadow collectives."""

from __future__ import annotations

from typing import Protocol

from torch.distributed.algorithms.join import JoinHook

__all__ = ["ZeroJoinHook"]


class _Steppable(Protocol):
    def step(self) -> object: ...


class ZeroJoinHook(JoinHook):
    """Run an optimizer step on a rank that has run out of inputs.

    While some rank still trains, every joined rank must issue the same parameter broadcasts;
    its main hook therefore calls ``zero.step()``, which updates this rank's shard from the
    gradients already set (by DDP's join hook, for example) and syncs all shards.

    Args:
        zero: the ZeroRedundancyOptimizer.
    """

    def __init__(self, zero: _Steppable) -> None:
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        """Step the optimizer (local shard update + parameter sync)."""
        self.zero.step()
