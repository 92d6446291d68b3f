"""ZeroRedundancyOptimizer extensions: the flat partition, sharded clipping and checkpoints.

``ZeroRedundancyOptimizer(..., partition="flat")`` lays the trainable parameters of each
``(dtype, device)`` end to end and gives every rank one equal, contiguous shard (parameters may
straddle ranks), so the optimizer state is balanced to within one element per buffer whatever
the parameter sizes; the shards are synced with one ``all_gather`` per buffer. The default,
``partition="sorted_greedy"``, is torch's rule. The local optimizer must be elementwise (see
:func:`dist_runtime.flat_shards.check_elementwise_optimizer`).

Gradients: by default they are taken as already averaged (DDP's all-reduce). Once the DDP hook
:func:`compat_api.algorithms.ddp_comm_hooks.zero_flat_hook.zero_flat_hook` has run (DDP then
communicates nothing), :attr:`FlatPartition.reduce_grads` is set and the step reduce-scatters the
local gradients to their owners first: reduce-scatter + all-gather = one all-reduce's bytes.

Both partitions share the extensions here: :func:`clip_grad_norm` (global norm, one all-reduce
of one scalar) and sharded checkpoints (:mod:`dist_runtime.sharded_checkpoint`: every rank
writes its own shard; any partition and world size reloads them).
"""

from __future__ import annotations

from typing import Any

import torch

from dist_runtime.flat_shards import (
    FlatShards,
    check_elementwise_optimizer,
    clip_grads_by_global_norm,
)
from dist_runtime.piece_state import Piece

__all__ = ["PARTITIONS", "FlatPartition", "owned_pieces", "pop_partition", "shard_grads"]

#: The accepted values of ``partition``.
PARTITIONS = ("sorted_greedy", "flat")


def pop_partition(defaults: dict[str, Any], optimizer_class: Any, overlap: bool) -> str:
    """Take ``partition`` out of the optimizer defaults and validate it.

    Raises:
        ValueError: for an unknown partition, a non-elementwise optimizer with ``"flat"``, or
            ``"flat"`` with ``overlap_with_ddp=True``.
    """
    partition = defaults.pop("partition", "sorted_greedy")
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if partition == "flat":
        check_elementwise_optimizer(optimizer_class)
        if overlap:
            raise ValueError(
                "partition='flat' cannot be combined with overlap_with_ddp=True (DDP's buckets "
                "decide the shards there); use the default partition"
            )
    return str(partition)


class FlatPartition:
    """The flat buffers of a ZeroRedundancyOptimizer and its consolidated state.

    Args:
        all_params: every parameter in global ``state_dict`` index order.
        process_group: the group to shard over.
    """

    def __init__(self, all_params: list[torch.Tensor], process_group: Any) -> None:
        self.shards = FlatShards(all_params, process_group)
        self.consolidated: dict[int, Any] | None = None
        #: The gradients are local (unsynced): reduce-scatter them before each step.
        self.reduce_grads = False
        self._reduced = False

    def prepare_grads(self) -> None:
        """Give the pieces their gradients: reduce-scattered (once per step) or attached."""
        if not self.reduce_grads:
            self.shards.attach_local_grads()
        elif not self._reduced:
            self.shards.reduce_scatter_grads(average=True)
            self._reduced = True

    def step_done(self) -> None:
        """The local step consumed the gradients; the next step reduces anew."""
        self._reduced = False

    def local_param_groups(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """This rank's groups, the pieces of its shards in place of the parameters."""
        return self.shards.local_param_groups(param_groups)


def owned_pieces(zero: Any) -> dict[torch.Tensor, Piece]:
    """Where each tensor of ``zero.optim`` lies in the global parameters (either partition)."""
    flat: FlatPartition | None = getattr(zero, "_flat", None)
    if flat is not None:
        return flat.shards.piece_info
    index_of = zero._param_to_index
    return {
        p: Piece(index_of[p], 0, p.numel(), tuple(p.shape))
        for group in zero.optim.param_groups
        for p in group["params"]
    }


def shard_grads(zero: Any) -> list[torch.Tensor]:
    """The gradients this rank's local optimizer will read (attaching them in flat mode)."""
    flat: FlatPartition | None = getattr(zero, "_flat", None)
    if flat is not None:
        flat.prepare_grads()
    return [
        p.grad for group in zero.optim.param_groups for p in group["params"] if p.grad is not None
    ]


def clip_grad_norm(
    zero: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """Clip the gradients of ``zero``'s shard by the global norm (one all-reduce)."""
    return clip_grads_by_global_norm(
        shard_grads(zero),
        max_norm,
        norm_type,
        error_if_nonfinite,
        zero.process_group,
        zero._default_device,
    )
