"""Low-bit local optimizer states under DSD (``get/set_optimizer_state_dict``) for ZeRO.

Live, each piece keeps the codes and scales of the blocks it touches
(:mod:`functional_optim.lowbit`). For DSD a piece's codes become one code per element, so
they split like any element-wise state, and its scales become every block's scale of the
parameter, the same on every rank (one MAX all-reduce), which DCP saves once. Loading turns
them back into the piece's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from dist_runtime.block_state import (
    BlockFormat,
    elementwise_codes,
    formats_of,
    region_codes,
    touched_blocks,
)
from dist_runtime.piece_state import Piece
from dist_runtime.process_group import all_gather_objects

__all__ = ["lowbit_formats", "lowbit_pieces_from_dsd", "lowbit_state_view"]

_CODES, _SCALES = "_codes", "_scales"


def lowbit_formats(zero: Any) -> dict[int, BlockFormat]:
    """The block format of each param of a low-bit local optimizer, by global index."""
    return formats_of(zero.param_groups, zero._layout.index_to_param)


def _keys(entry: Mapping[str, Any]) -> list[str]:
    return sorted(k[: -len(_CODES)] for k in entry if k.endswith(_CODES))


def lowbit_state_view(
    zero: Any, pieces: Mapping[torch.Tensor, Piece], formats: Mapping[int, BlockFormat]
) -> Any:
    """An object with ``.state`` like ``zero.optim``'s, low-bit entries in the DSD form
    (collective: every rank calls it)."""
    states = {t: zero.optim.state.get(t) for t in pieces}
    keys = sorted(
        set().union(
            *all_gather_objects(
                sorted({k for s in states.values() if s for k in _keys(s)}), zero.process_group
            )
        )
    )
    indices = sorted(formats)
    offsets, total = {}, 0
    for index in indices:
        numel = zero._layout.index_to_param[index].numel()
        for key in keys:
            offsets[(index, key)] = total
            total += -(-numel // formats[index].block_size)
    device = next(iter(pieces), torch.empty(0)).device
    full = torch.zeros(total, device=device)
    for tensor, piece in pieces.items():
        state, fmt = states[tensor], formats.get(piece.param_index)
        if not state or fmt is None:
            continue
        first, _ = touched_blocks(piece.start, piece.stop, fmt)
        for key in _keys(state):
            at = offsets[(piece.param_index, key)] + first
            scales = state[key + _SCALES]
            full[at : at + scales.numel()] = torch.maximum(full[at : at + scales.numel()], scales)
    if total and dist.is_available() and dist.is_initialized():
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=zero.process_group)
    converted: dict[torch.Tensor, Any] = {}
    for tensor, piece in pieces.items():
        state, fmt = states[tensor], formats.get(piece.param_index)
        if not state:
            continue
        if fmt is None or not _keys(state):
            converted[tensor] = state
            continue
        entry = dict(state)
        blocks = -(-math.prod(piece.shape) // fmt.block_size)
        for key in _keys(state):
            at = offsets[(piece.param_index, key)]
            entry[key + _CODES] = elementwise_codes(
                state[key + _CODES], piece.start, piece.stop, fmt
            )
            entry[key + _SCALES] = full[at : at + blocks].clone()
        converted[tensor] = entry
    return SimpleNamespace(state=converted)


def lowbit_pieces_from_dsd(
    state: dict[str, Any], piece: Piece, fmt: BlockFormat | None
) -> dict[str, Any]:
    """A piece's loaded state (codes one per element, every block's scale) in its live form."""
    if fmt is None or not _keys(state):
        return state
    first, end = touched_blocks(piece.start, piece.stop, fmt)
    out = dict(state)
    for key in _keys(state):
        codes = state[key + _CODES].reshape(-1)
        out[key + _CODES] = region_codes(codes, piece.start, piece.stop, fmt)
        out[key + _SCALES] = state[key + _SCALES][first:end].clone()
    return out
