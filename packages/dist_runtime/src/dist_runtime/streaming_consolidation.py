"""Consolidate sharded optimizer state on one rank, streaming one shard at a time to the CPU.

torch's ``ZeroRedundancyOptimizer.consolidate_state_dict`` broadcasts every rank's state and
keeps it on the receiving rank's device until the end (pytorch issue 68181: the target rank needs
room for the whole optimizer state on its GPU). Here each sender sends a small pickled index of
its pieces, then their values point to point, and the receiving rank receives them straight into
the CPU buffers of the result (through a piece-sized buffer on the GPU with NCCL). The extra
memory on the receiver is the index and at most one piece, and the result is the torch-format
``state`` of a plain optimizer over all the parameters, whatever the partition.

The inverse, :func:`load_global_state`, hands each local tensor its slice of a torch-format
state and places ``step`` where fused/capturable optimizers expect it (pytorch issue 124133).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dist_runtime.block_state import BlockFormat, is_blockwise
from dist_runtime.collective_failure import collective_guard
from dist_runtime.piece_state import (
    Incoming,
    Piece,
    PieceJoiner,
    is_elementwise,
    place_state,
    split_param_state,
)
from dist_runtime.process_group import (
    global_rank,
    receiver_group,
    recv_object,
    send_object,
    wait_work,
)
from dist_runtime.state_consolidation import KEPT

__all__ = [
    "PieceStates",
    "consolidate_piece_states",
    "load_global_state",
    "local_piece_states",
]

#: ``(piece, state)`` pairs, states with 1-D elementwise values on the CPU.
PieceStates = list[tuple[Piece, dict[str, Any]]]

#: Tag of the point-to-point messages of a consolidation.
CONSOLIDATION_TAG = 0x434F4E53  # "CONS"


def _on_cpu(value: Any, copy: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        return value.cpu()
    return value.clone() if copy else value


def local_piece_states(
    optimizer: torch.optim.Optimizer, pieces: Mapping[torch.Tensor, Piece], copy: bool = True
) -> PieceStates:
    """This rank's piece states on the CPU, elementwise values flattened to 1-D.

    Args:
        optimizer: the local optimizer.
        pieces: where each of its tensors lies in the global parameters.
        copy: copy CPU tensors (False: share them with the live state). Tensors on another
            device are copied to the CPU either way, once.

    Returns:
        One entry per tensor that has state, in ``pieces`` order.
    """
    out: PieceStates = []
    for tensor, piece in pieces.items():
        state = optimizer.state.get(tensor)
        if not state:
            continue
        flat = split_param_state(state, tuple(tensor.shape), 0, tensor.numel(), copy=False)
        out.append((piece, {k: _on_cpu(v, copy) for k, v in flat.items()}))
    return out


_HINT = "are all ranks of the group consolidating with the same parameters?"


def _outgoing(
    optimizer: torch.optim.Optimizer, pieces: Mapping[torch.Tensor, Piece]
) -> tuple[PieceStates, list[torch.Tensor]]:
    """This rank's piece states with :class:`Incoming` markers, and the marked values in order."""
    entries: PieceStates = []
    values: list[torch.Tensor] = []
    for tensor, piece in pieces.items():
        state = optimizer.state.get(tensor)
        if not state:
            continue
        flat = split_param_state(state, tuple(tensor.shape), 0, tensor.numel(), copy=False)
        entry: dict[str, Any] = {}
        for name, value in flat.items():
            if is_elementwise(name, value, (piece.numel,)) and not is_blockwise(name, flat):
                entry[name] = Incoming(value.dtype)
                values.append(value)
            else:
                entry[name] = _on_cpu(value, copy=True)
        entries.append((piece, entry))
    return entries, values


def _send_shard(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    to: int,
    group: ProcessGroup,
    device: torch.device | None,
) -> None:
    entries, values = _outgoing(optimizer, pieces)
    send_object(entries, to, group, device)
    wire = device or torch.device("cpu")
    works = [
        dist.isend(value.to(wire).contiguous(), group=group, group_dst=to, tag=CONSOLIDATION_TAG)
        for value in values
    ]
    for work in works:
        wait_work(work, None, f"consolidation: send to group rank {to}", _HINT)


def _receive_shard(
    joiner: PieceJoiner, src: int, group: ProcessGroup, device: torch.device | None
) -> None:
    entries: PieceStates = recv_object(src, group, device)
    slots = [slot for piece, entry in entries for slot in joiner.slots(piece, entry)]
    if device is None or device.type == "cpu":
        # Straight into the joined buffers: nothing is staged.
        works = [
            dist.irecv(slot, group=group, group_src=src, tag=CONSOLIDATION_TAG) for slot in slots
        ]
    else:  # one piece on the device at a time
        works = []
        for slot in slots:
            staged = torch.empty(slot.shape, dtype=slot.dtype, device=device)
            work = dist.irecv(staged, group=group, group_src=src, tag=CONSOLIDATION_TAG)
            wait_work(work, None, f"consolidation: receive from group rank {src}")
            slot.copy_(staged)
    for work in works:
        wait_work(work, None, f"consolidation: receive from group rank {src}", _HINT)


def consolidate_piece_states(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    to: int = 0,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
    blocks: Mapping[int, BlockFormat] | None = None,
) -> dict[int, dict[str, Any]] | None:
    """Gather every rank's piece states on group rank ``to`` as a torch-format ``state``.

    Call on all ranks of the group. Each sender sends a small pickled index of its pieces, then
    the values point to point; the receiver takes the ranks in order and receives the values
    straight into the joined CPU buffers (through one piece-sized buffer on ``device`` when it
    is not the CPU), so nothing but the result and at most one piece is ever held.

    Args:
        optimizer: this rank's local optimizer.
        pieces: where each of its tensors lies in the global parameters.
        to: the receiving group rank.
        process_group: the group (None for WORLD).
        device: the device tensors travel on (CUDA for NCCL groups; None for the CPU).
        blocks: the layout of the low-bit states by parameter index
            (:mod:`dist_runtime.block_state`): their codes and scales join by block.

    Returns:
        On ``to``: ``{global index: state}`` sorted by index, elementwise values shaped like
        the parameters, on the CPU. Elsewhere None.

    Raises:
        ValueError: if ``to`` is not a rank of the group.
        CollectiveFailedError: if a peer died or timed out (the local state is unchanged).
    """
    group, world_size, rank = receiver_group(process_group, to)
    with collective_guard("streaming consolidation", group, kept=KEPT) as guard:
        if rank != to:
            # No guard.peer: a failed send does not mean the receiver failed (it may have
            # given up on another sender); the check-in finds out.
            _send_shard(optimizer, pieces, to, group, device)
            return None
        joiner = PieceJoiner(blocks)
        for src in range(world_size):
            if src != rank:
                guard.peer = global_rank(group, src)
                _receive_shard(joiner, src, group, device)
                continue
            # The receiver's own state is copied once (later steps must not change the result).
            for piece, state in local_piece_states(optimizer, pieces):
                joiner.add(piece, state)
        return joiner.finish()


def load_global_state(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    state: Mapping[int, Any],
    blocks: Mapping[int, BlockFormat] | None = None,
) -> None:
    """Give each local tensor its slice of a torch-format ``state`` (the inverse of consolidation).

    Args:
        optimizer: the local optimizer to fill (its ``state`` is replaced for the tensors that
            have saved state).
        pieces: where each of its tensors lies in the global parameters.
        state: ``state_dict["state"]`` of a plain optimizer over all the parameters (None
            entries and missing indices leave a tensor without state).
        blocks: the layout of the low-bit states by parameter index
            (:mod:`dist_runtime.block_state`).
    """
    group_of = {t: g for g in optimizer.param_groups for t in g["params"]}
    blocks = blocks or {}
    placed: dict[torch.Tensor, dict[str, Any]] = {}
    for tensor, piece in pieces.items():
        saved = state.get(piece.param_index)
        if not saved:
            continue
        block = blocks.get(piece.param_index)
        cut = split_param_state(saved, piece.shape, piece.start, piece.stop, block=block)
        placed[tensor] = place_state(cut, tensor, group_of[tensor])
    if not hasattr(optimizer, "transform_states"):
        for tensor, value in placed.items():
            optimizer.state[tensor] = value
        return
    # a functional_optim.Optimizer keeps its state in its transform: its own load_state_dict
    local = optimizer.state_dict()
    order = [t for g in optimizer.param_groups for t in g["params"]]
    local["state"] = {i: placed[t] for i, t in enumerate(order) if t in placed}
    optimizer.load_state_dict(local)
