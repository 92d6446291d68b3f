"""Join and cut the *blockwise* state of low-bit optimizers (codes and block scales).

A low-bit param's state (:mod:`functional_optim.lowbit`) holds ``<key>_codes`` (``uint8``:
the codes of the blocks of ``block_size`` elements the piece touches, of the whole flattened
parameter; two 4-bit codes per byte, even element in the low nibble; code 0 is exact zero
and fills the elements of other pieces) and ``<key>_scales`` (fp32, one per block). Pieces of
one parameter therefore join by OR-ing their codes into the whole parameter's blocks (other
pieces' elements are zero bytes) and copying their scales (a block two pieces share has the
same scale on both); a whole state is cut for a piece by taking its blocks and zeroing the
elements outside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from functional_optim.lowbit import elements_to_region, region_to_elements
from functional_optim.lowbit import touched_blocks as lowbit_touched_blocks

__all__ = [
    "BlockFormat",
    "cut_blockwise",
    "elementwise_codes",
    "formats_of",
    "is_blockwise",
    "join_blockwise",
    "owned_blocks",
    "region_codes",
    "touched_blocks",
]


class BlockFormat(NamedTuple):
    """How a param's low-bit state is laid out.

    Attributes:
        block_size: elements per block.
        per_byte: codes per byte (2 for 4-bit codes, else 1).
    """

    block_size: int
    per_byte: int


def is_blockwise(name: str, state: Mapping[str, Any]) -> bool:
    """Whether entry ``name`` of ``state`` is a low-bit codes or scales entry."""
    if name.endswith("_codes"):
        return f"{name[: -len('_codes')]}_scales" in state
    if name.endswith("_scales"):
        return f"{name[: -len('_scales')]}_codes" in state
    return False


def _blocks(start: int, stop: int, fmt: BlockFormat) -> tuple[int, int]:
    return lowbit_touched_blocks(start, stop, fmt.block_size)


def join_blockwise(
    whole: dict[str, torch.Tensor],
    name: str,
    value: torch.Tensor,
    start: int,
    stop: int,
    numel: int,
    fmt: BlockFormat,
) -> None:
    """Add piece ``[start, stop)``'s entry ``name`` to the whole parameter's (in ``whole``)."""
    first, end = _blocks(start, stop, fmt)
    value = value.detach().reshape(-1).cpu()
    count = -(-numel // fmt.block_size)
    if name.endswith("_scales"):
        buffer = whole.setdefault(name, torch.zeros(count, dtype=value.dtype))
        buffer[first:end] = value
        return
    unit = fmt.block_size // fmt.per_byte
    buffer = whole.setdefault(name, torch.zeros(count * unit, dtype=torch.uint8))
    buffer[first * unit : end * unit] |= value


def cut_blockwise(
    name: str, value: torch.Tensor, start: int, stop: int, fmt: BlockFormat
) -> torch.Tensor:
    """Piece ``[start, stop)``'s entry ``name``, cut from the whole parameter's ``value``."""
    first, end = _blocks(start, stop, fmt)
    if name.endswith("_scales"):
        return value[first:end].clone()
    unit = fmt.block_size // fmt.per_byte
    region = value[first * unit : end * unit]
    return region_codes(elementwise_codes(region, start, stop, fmt), start, stop, fmt)


def formats_of(
    param_groups: Sequence[Mapping[str, Any]], params: Sequence[Any]
) -> dict[int, BlockFormat]:
    """The :class:`BlockFormat` of each param of a low-bit optimizer, by global index (groups
    with ``block_size`` and ``kind``; their ``params`` are tensors of ``params`` or indices)."""
    index_of = {id(p): i for i, p in enumerate(params)}
    formats: dict[int, BlockFormat] = {}
    for group in param_groups:
        if "block_size" not in group or "kind" not in group:
            continue
        fmt = BlockFormat(int(group["block_size"]), 2 if group["kind"] == "int4" else 1)
        for p in group["params"]:
            formats[p if isinstance(p, int) else index_of[id(p)]] = fmt
    return formats


def touched_blocks(start: int, stop: int, fmt: BlockFormat) -> tuple[int, int]:
    """The blocks elements ``[start, stop)`` touch."""
    return _blocks(start, stop, fmt)


def owned_blocks(start: int, stop: int, fmt: BlockFormat) -> tuple[int, int]:
    """The blocks whose first element lies in ``[start, stop)`` (each block has one owner)."""
    bs = fmt.block_size
    return -(-start // bs), -(-stop // bs)


def elementwise_codes(
    region: torch.Tensor, start: int, stop: int, fmt: BlockFormat
) -> torch.Tensor:
    """One code per element of ``[start, stop)`` (unpacked), from the piece's block codes."""
    return region_to_elements(region, start, stop, fmt.block_size, fmt.per_byte)


def region_codes(elements: torch.Tensor, start: int, stop: int, fmt: BlockFormat) -> torch.Tensor:
    """The piece's block codes (packed, zero outside it) from one code per element."""
    return elements_to_region(elements, start, stop, fmt.block_size, fmt.per_byte)
