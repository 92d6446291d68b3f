"""Sharded optimizer state <-> one global ``state_dict``.

A sharded optimizer keeps a local optimizer per rank whose ``state_dict`` indexes only the
parameters that rank owns. This module gathers the local dicts onto one rank, merges them into
the global layout (``state[i]`` for the ``i``-th parameter over all parameter groups, as a plain
``torch.optim`` optimizer numbers them), and splits a global dict back into each rank's share.
Planning (merge/split) is pure; only :func:`gather_local_state_dicts` communicates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dist_runtime.collective_failure import collective_guard
from dist_runtime.process_group import (
    global_rank,
    receiver_group,
    recv_object,
    send_object,
)

__all__ = [
    "KEPT",
    "copy_to_device",
    "gather_local_state_dicts",
    "merge_local_state_dicts",
    "split_global_state",
]

#: What a failed consolidation leaves as it was.
KEPT = "The optimizer state is unchanged (consolidation only reads it)."


def copy_to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Copy every tensor in nested lists/tuples/dicts to ``device``; other leaves pass through.

    Tensors already on ``device`` are returned as they are (``Tensor.to`` semantics), so the
    result may share storage with ``value``.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, list):
        return [copy_to_device(v, device, non_blocking) for v in value]
    if isinstance(value, tuple):
        return tuple(copy_to_device(v, device, non_blocking) for v in value)
    if isinstance(value, Mapping):
        return {k: copy_to_device(v, device, non_blocking) for k, v in value.items()}
    return value


def gather_local_state_dicts(
    local_state_dict: dict[str, Any],
    to: int,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> list[dict[str, Any]] | None:
    """Collect every rank's local ``state_dict`` on group rank ``to``, with tensors on CPU.

    Each rank sends its dict point to point to ``to`` (torch broadcasts it to every rank
    instead); must be called on all ranks of the group.

    Args:
        local_state_dict: this rank's local optimizer ``state_dict()``.
        to: the receiving group rank.
        process_group: the group (None for WORLD).
        device: staging device for the pickled bytes (the parameters' device for NCCL).

    Returns:
        On rank ``to``: the dicts in group-rank order (its own dict's CPU tensors may be shared
        with the live optimizer state, as in torch). Elsewhere: None.

    Raises:
        ValueError: if ``to`` is not a rank of the group.
        CollectiveFailedError: if a peer died or timed out (the local state is unchanged).
    """
    group, world_size, rank = receiver_group(process_group, to)
    cpu = torch.device("cpu")
    mine = copy_to_device(local_state_dict, cpu)
    with collective_guard("state-dict consolidation", group, kept=KEPT) as guard:
        if rank != to:
            # No guard.peer: a failed send does not mean the receiver failed (it may have
            # given up on another sender); the check-in finds out.
            send_object(mine, to, group, device)
            return None
        gathered: list[dict[str, Any]] = []
        for src in range(world_size):
            guard.peer = global_rank(group, src)
            gathered.append(
                mine if src == rank else copy_to_device(recv_object(src, group, device), cpu)
            )
        return gathered


def merge_local_state_dicts(
    global_state_dict: dict[str, Any],
    local_state_dicts: Sequence[Mapping[str, Any]],
    rank_param_groups: Sequence[Sequence[Sequence[torch.Tensor]]],
    param_to_index: Mapping[torch.Tensor, int],
) -> dict[str, Any]:
    """Write the local states into ``global_state_dict["state"]`` under global indices.

    Args:
        global_state_dict: the wrapper's own ``Optimizer.state_dict()`` (global param groups);
            its ``"state"`` is updated in place and re-sorted by index.
        local_state_dicts: ``local_state_dicts[r]``: rank ``r``'s local ``state_dict``.
        rank_param_groups: ``rank_param_groups[r][g]``: the parameters of group ``g`` owned by
            rank ``r``, in the local optimizer's order.
        param_to_index: global index of each parameter.

    Returns:
        ``global_state_dict``.

    Raises:
        AssertionError: if a local dict's groups or parameters do not line up with the partition
            (torch's wording).
    """
    state: dict[int, Any] = global_state_dict["state"]
    for local, groups in zip(local_state_dicts, rank_param_groups):
        local_groups = local["param_groups"]
        if len(local_groups) != len(groups):
            raise AssertionError("Mismatch between number of local and global parameter groups")
        local_state = local["state"]
        for local_group, params in zip(local_groups, groups):
            local_indices = local_group["params"]
            if len(local_indices) != len(params):
                raise AssertionError(
                    "Mismatch between number of local and global parameters in parameter group"
                )
            for local_index, param in zip(local_indices, params):
                if local_index in local_state:
                    state[param_to_index[param]] = local_state[local_index]
    global_state_dict["state"] = dict(sorted(state.items()))
    return global_state_dict


def split_global_state(
    state: Mapping[int, Any],
    index_to_param: Sequence[torch.Tensor],
    param_to_rank: Mapping[torch.Tensor, int],
    rank: int,
) -> tuple[dict[torch.Tensor, Any], dict[int, Any]]:
    """Split a global ``state`` into this rank's share.

    Args:
        state: ``state_dict["state"]`` of a global state dict (index -> per-parameter state).
        index_to_param: the parameter at each global index.
        param_to_rank: the owning rank of each parameter.
        rank: this rank.

    Returns:
        ``(local, kept)``: ``local`` maps each owned parameter to its state (tensors not yet
        moved); ``kept`` is a copy of ``state`` with None for every parameter owned elsewhere
        (what the wrapper keeps for itself, as torch does).

    Raises:
        IndexError: if an index does not name a parameter.
    """
    local: dict[torch.Tensor, Any] = {}
    kept: dict[int, Any] = {}
    for index, value in state.items():
        if not 0 <= index < len(index_to_param):
            raise IndexError(
                f"state_dict has state for parameter index {index}, but the optimizer has only "
                f"{len(index_to_param)} parameters"
            )
        param = index_to_param[index]
        if param_to_rank[param] == rank:
            local[param] = value
            kept[index] = value
        else:
            kept[index] = None
    return local, kept
