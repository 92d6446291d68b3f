"""Consolidate sharded optimizer state on one rank, streaming one shard at a time to the CPU.

torch's ``ZeroRedundancyOptimizer.consolidate_state_dict`` broadcasts every rank's state and
keeps it on the receiving rank's device until the end (pytorch issue 68181: the target rank needs
room for the whole optimizer state on its GPU). Here each rank moves its own piece states to the
CPU before sending, and the receiving rank takes one rank's shard at a time, files it into CPU
accumulators and drops it before the next: the extra device memory on the receiver is at most
one shard's serialized bytes (only with NCCL, which stages them there), and the result is the
torch-format ``state`` of a plain optimizer over all the parameters, whatever the partition.

The inverse, :func:`load_global_state`, hands each local tensor its slice of a torch-format
state and places ``step`` where fused/capturable optimizers expect it (pytorch issue 124133).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dist_runtime.piece_state import Piece, join_piece_states, place_state, split_param_state
from dist_runtime.process_group import (
    group_rank,
    group_size,
    recv_object,
    resolve_group,
    send_object,
)

__all__ = [
    "PieceStates",
    "consolidate_piece_states",
    "load_global_state",
    "local_piece_states",
]

#: ``(piece, state)`` pairs, states with 1-D elementwise values on the CPU.
PieceStates = list[tuple[Piece, dict[str, Any]]]


def local_piece_states(
    optimizer: torch.optim.Optimizer, pieces: Mapping[torch.Tensor, Piece], copy: bool = True
) -> PieceStates:
    """This rank's piece states on the CPU, elementwise values flattened to 1-D.

    Args:
        optimizer: the local optimizer.
        pieces: where each of its tensors lies in the global parameters.
        copy: copy CPU tensors (False: share them with the live state, as torch's
            consolidation does for the receiving rank's own state).

    Returns:
        One entry per tensor that has state, in ``pieces`` order.
    """
    out: PieceStates = []
    for tensor, piece in pieces.items():
        state = optimizer.state.get(tensor)
        if not state:
            continue
        flat = split_param_state(state, tuple(tensor.shape), 0, tensor.numel(), copy=copy)
        cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
        out.append((piece, cpu))
    return out


def consolidate_piece_states(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    to: int = 0,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> dict[int, dict[str, Any]] | None:
    """Gather every rank's piece states on group rank ``to`` as a torch-format ``state``.

    Call on all ranks of the group. Senders send once (point to point); the receiver takes the
    ranks in order, one shard in memory at a time.

    Args:
        optimizer: this rank's local optimizer.
        pieces: where each of its tensors lies in the global parameters.
        to: the receiving group rank.
        process_group: the group (None for WORLD).
        device: staging device for the pickled bytes (CUDA for NCCL groups).

    Returns:
        On ``to``: ``{global index: state}`` sorted by index, elementwise values shaped like
        the parameters, on the CPU. Elsewhere None.

    Raises:
        ValueError: if ``to`` is not a rank of the group.
    """
    group = resolve_group(process_group)
    world_size = group_size(group)
    rank = group_rank(group)
    if not 0 <= to < world_size:
        raise ValueError(f"`to` must be a rank in [0, {world_size}), got {to}")
    if rank != to:
        send_object(local_piece_states(optimizer, pieces), to, group, device)
        return None
    parts: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for src in range(world_size):
        received: PieceStates = (
            local_piece_states(optimizer, pieces)
            if src == rank
            else recv_object(src, group, device)
        )
        for piece, state in received:
            parts.setdefault(piece.param_index, []).append((piece.start, piece.stop, state))
            shapes[piece.param_index] = piece.shape
        del received  # at most one shard in flight
    return {index: join_piece_states(parts.pop(index), shapes[index]) for index in sorted(parts)}


def load_global_state(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    state: Mapping[int, Any],
) -> None:
    """Give each local tensor its slice of a torch-format ``state`` (the inverse of consolidation).

    Args:
        optimizer: the local optimizer to fill (its ``state`` is replaced for the tensors that
            have saved state).
        pieces: where each of its tensors lies in the global parameters.
        state: ``state_dict["state"]`` of a plain optimizer over all the parameters (None
            entries and missing indices leave a tensor without state).
    """
    group_of = {t: g for g in optimizer.param_groups for t in g["params"]}
    for tensor, piece in pieces.items():
        saved = state.get(piece.param_index)
        if not saved:
            continue
        cut = split_param_state(saved, piece.shape, piece.start, piece.stop)
        optimizer.state[tensor] = place_state(cut, tensor, group_of[tensor])
