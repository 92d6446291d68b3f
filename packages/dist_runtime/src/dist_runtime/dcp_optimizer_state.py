"""A sharded optimizer's state in the format of ``torch.distributed.checkpoint.state_dict``.

``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (DSD) turn an optimizer's
``state_dict()`` (state keyed by param index, torch's layout) into a state dict keyed by
parameter names that ``dcp.save`` / ``dcp.load`` reshard. A sharded optimizer gives each rank's
share without gathering anything:

- a parameter held whole by this rank: its state as torch keeps it (tensors shaped like the
  parameter), saved by this rank only;
- a parameter cut across ranks (the flat partition): each elementwise value is a
  ``ShardedTensor`` shaped like the parameter whose local shards are this rank's elements (a
  row-major element range split into at most ``2 * ndim - 1`` rectangular blocks, each a view
  of the live state); scalars (``step``) are plain values every holder saves (DCP keeps one).

So the logical tensors are the same whatever the partition and world size, and ``dcp.load``
into another layout reads the chunks each rank needs. :func:`piece_values` takes such a value
(sharded or whole) back to the elements of one piece.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard

from dist_runtime.piece_state import Piece, is_elementwise
from dist_runtime.process_group import all_gather_objects, global_rank, resolve_group

__all__ = [
    "Block",
    "called_by_dcp_get",
    "index_state_dict",
    "piece_values",
    "row_major_blocks",
]


class Block(NamedTuple):
    """A rectangular block of a tensor that is one contiguous run of its row-major elements.

    Attributes:
        offsets: the block's first index in every dimension.
        sizes: its size in every dimension.
        start: its first element in the flattened tensor.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        """Number of elements in the block."""
        return _numel(self.sizes)


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def row_major_blocks(shape: Sequence[int], start: int, stop: int) -> list[Block]:
    """Split elements ``[start, stop)`` of a row-major tensor into contiguous rectangles.

    Args:
        shape: the tensor's shape (at least one dimension).
        start: first element.
        stop: one past the last element.

    Returns:
        The blocks in element order (a partial leading row, whole rows, a partial trailing
        row, recursively): at most ``2 * len(shape) - 1``, none empty.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 1:
        return [Block((start,), (stop - start,), start)]
    inner = _numel(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    blocks: list[Block] = []
    if start % inner:
        row = start // inner
        end = min(stop, (row + 1) * inner)
        base = row * inner
        for b in row_major_blocks(shape[1:], start - base, end - base):
            blocks.append(Block((row, *b.offsets), (1, *b.sizes), base + b.start))
        start = end
    rows = (stop - start) // inner
    if rows and start < stop:
        blocks.append(Block((start // inner, *zeros), (rows, *shape[1:]), start))
        start += rows * inner
    if start < stop:
        row = start // inner
        base = row * inner
        for b in row_major_blocks(shape[1:], 0, stop - base):
            blocks.append(Block((row, *b.offsets), (1, *b.sizes), base + b.start))
    return blocks


def _sharded(
    local: torch.Tensor,
    piece: Piece,
    holders: Sequence[tuple[int, Piece]],
    group: Any,
) -> ShardedTensor:
    """``local`` (the piece's elements, 1-D) as its blocks of a parameter-shaped tensor."""
    covered = sorted((p.start, p.stop) for _, p in holders)
    position = 0
    for begin, end in covered:
        if begin != position:
            break
        position = end
    if position != _numel(piece.shape):
        raise ValueError(
            f"parameter {piece.param_index}: the ranks that hold its pieces do not all have "
            "the same optimizer state (some stepped it, some did not), so its state cannot be "
            "saved as one tensor; step every rank with the same gradients first"
        )
    device = local.device
    all_md: list[ShardMetadata] = []
    mine: list[Shard] = []
    for rank, held in holders:
        placement = f"rank:{global_rank(group, rank)}/{device}"
        for block in row_major_blocks(piece.shape, held.start, held.stop):
            md = ShardMetadata(list(block.offsets), list(block.sizes), placement)
            all_md.append(md)
            if held == piece:
                offset = block.start - piece.start
                view = local[offset : offset + block.numel].view(block.sizes)
                mine.append(Shard(view, md))
    properties = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(all_md, torch.Size(piece.shape), properties)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            mine, metadata, process_group=group
        )


def index_state_dict(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    process_group: Any = None,
) -> dict[int, dict[str, Any]]:
    """This rank's share of the optimizer state, keyed by global param index (see module doc).

    Collective when torch.distributed is initialised (one small ``all_gather_object`` to learn
    which ranks hold the pieces of cut parameters): call on every rank of the group.

    Args:
        optimizer: this rank's local optimizer.
        pieces: where each of its tensors lies in the global parameters.
        process_group: the group (None for WORLD).

    Returns:
        ``{index: {name: value}}`` for every piece with state; tensors are (views of) the live
        state, so ``dcp.load`` into them writes it in place.

    Raises:
        ValueError: if the holders of one cut parameter disagree on having state.
    """
    local: list[tuple[torch.Tensor, Piece, Mapping[str, Any]]] = []
    for tensor, piece in pieces.items():
        saved = optimizer.state.get(tensor)
        if saved:
            local.append((tensor, piece, saved))
    cut = [(piece, sorted(state)) for _, piece, state in local if not piece.whole]
    distributed = dist.is_available() and dist.is_initialized()
    everyone = all_gather_objects(cut, process_group) if distributed else [cut]
    holders: dict[tuple[int, str], list[tuple[int, Piece]]] = {}
    for rank, entries in enumerate(everyone):
        for held, names in entries:
            for name in names:
                holders.setdefault((held.param_index, name), []).append((rank, held))
    group = resolve_group(process_group) if distributed else None
    out: dict[int, dict[str, Any]] = {}
    for tensor, piece, state in local:
        entry: dict[str, Any] = {}
        for name, value in state.items():
            if not is_elementwise(name, value, tuple(tensor.shape)):
                entry[name] = value
            elif piece.whole:  # a flat piece is 1-D: give the value the parameter's shape
                entry[name] = value.view(piece.shape)
            else:
                entry[name] = _sharded(
                    value.detach().reshape(-1),
                    piece,
                    holders[(piece.param_index, name)],
                    group,
                )
        out[piece.param_index] = entry
    return out


def _block_indices(offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int]) -> Any:
    """The row-major element range of a block, or (not one run) all its element indices."""
    strides = [_numel(shape[d + 1 :]) for d in range(len(shape))]
    first = next((d for d, size in enumerate(sizes) if size > 1), len(sizes))
    start = sum(o * st for o, st in zip(offsets, strides))
    if all(sizes[d] == shape[d] for d in range(first + 1, len(shape))):
        return slice(start, start + _numel(sizes))
    index = torch.zeros(sizes, dtype=torch.long)
    for d, (o, size) in enumerate(zip(offsets, sizes)):
        view = [1] * len(sizes)
        view[d] = size
        index += ((torch.arange(size) + o) * strides[d]).view(view)
    return index.reshape(-1)


def _from_sharded(name: str, value: ShardedTensor, piece: Piece) -> torch.Tensor:
    """The piece's elements gathered from the local shards of ``value`` (no communication)."""
    if tuple(value.size()) != tuple(piece.shape):
        raise ValueError(
            f"state {name!r} of parameter {piece.param_index} has shape "
            f"{tuple(value.size())}, the parameter {piece.shape}"
        )
    shards = value.local_shards()
    if not shards:
        raise ValueError(f"state {name!r} of parameter {piece.param_index} has no local shard")
    out = torch.empty(piece.numel, dtype=shards[0].tensor.dtype, device=shards[0].tensor.device)
    filled = torch.zeros(piece.numel, dtype=torch.bool)
    for shard in shards:
        md = shard.metadata
        where = _block_indices(md.shard_offsets, md.shard_sizes, piece.shape)
        values = shard.tensor.reshape(-1)
        if isinstance(where, slice):  # one run of elements: copy the overlap
            begin, end = max(where.start, piece.start), min(where.stop, piece.stop)
            if begin < end:
                out[begin - piece.start : end - piece.start] = values[
                    begin - where.start : end - where.start
                ]
                filled[begin - piece.start : end - piece.start] = True
        else:
            keep = (where >= piece.start) & (where < piece.stop)
            out[where[keep] - piece.start] = values[keep.to(values.device)]
            filled[where[keep] - piece.start] = True
    if not bool(filled.all()):
        raise ValueError(
            f"state {name!r} of parameter {piece.param_index}: the local shards do not cover "
            f"elements [{piece.start}, {piece.stop})"
        )
    return out


def piece_values(
    state: Mapping[str, Any], piece: Piece, shape: Sequence[int] | None = None
) -> dict[str, Any]:
    """A parameter's loaded state cut down to one piece.

    Args:
        state: ``{name: value}`` as :func:`index_state_dict` gives (after ``dcp.load``), or
            a whole parameter's state in torch's layout.
        piece: the elements wanted.
        shape: the shape to give elementwise values (default: the parameter's for a whole
            piece, else 1-D).

    Returns:
        Elementwise values as the piece's elements, other values as they are (not copied).

    Raises:
        ValueError: for a sharded value of another shape or without the piece's elements.
        TypeError: for a ``DTensor`` value (this layout never produces one).
    """
    if shape is None:
        shape = piece.shape if piece.whole else (piece.numel,)
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, ShardedTensor):
            out[name] = _from_sharded(name, value, piece).reshape(shape)
        elif type(value).__name__ == "DTensor":
            raise TypeError(
                f"state {name!r} of parameter {piece.param_index} is a DTensor; load it "
                "through a state dict this optimizer produced"
            )
        elif is_elementwise(name, value, piece.shape):
            out[name] = value.reshape(-1)[piece.start : piece.stop].reshape(shape)
        else:
            out[name] = value
    return out


def _dcp_get_code() -> Any:
    from torch.distributed.checkpoint import state_dict as dsd

    return inspect.unwrap(dsd._get_optim_state_dict).__code__


def called_by_dcp_get(depth: int = 2) -> bool:
    """Whether the frame ``depth`` levels up is DSD's ``_get_optim_state_dict``.

    Why a look at the call stack: ``get_optimizer_state_dict`` calls ``optim.state_dict()``
    exactly as a user does (no argument, no hook, nothing set around the call that a user's
    code could not also have set: ``no_grad`` and a disabled garbage collector are common in
    training loops). A ``ZeroRedundancyOptimizer`` must keep torch's error for a direct
    ``state_dict()`` before ``consolidate_state_dict()``, yet give DSD its own shard: the caller
    is the only difference. DSD's other way in (``_patched_state_dict``, which makes it call
    the *class's* method) would turn the class method into the DSD one for every caller,
    ``super().state_dict()`` included, and needs a global registry of instances.

    Args:
        depth: 1 is the caller of this function, 2 its caller (the default: the caller of
            the ``state_dict`` method that asks).
    """
    frame = sys._getframe(depth)
    return frame.f_code is _dcp_get_code()
