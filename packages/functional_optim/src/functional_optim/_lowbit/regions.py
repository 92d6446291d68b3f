"""Convert a piece's block codes (its *region*) to one code per element and back.

A local tensor covering elements ``[start, stop)`` of its parameter keeps the codes of the
blocks it touches (code 0 outside its elements; 4-bit codes two per byte, the even element in
the low nibble). Checkpoints that reshard store one code per element instead, which splits
like the parameter itself.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["elements_to_region", "region_to_elements", "touched_blocks"]


def touched_blocks(start: int, stop: int, block_size: int) -> tuple[int, int]:
    """The blocks ``[first, end)`` that elements ``[start, stop)`` touch."""
    first = start // block_size
    return first, (-(-stop // block_size) if stop > start else first)


def region_to_elements(
    region: Tensor, start: int, stop: int, block_size: int, per_byte: int
) -> Tensor:
    """One code per element of ``[start, stop)`` (unpacked), from the region's codes."""
    elements = region
    if per_byte == 2:
        elements = torch.stack([region & 15, region >> 4], dim=1).view(-1)
    offset = start - (start // block_size) * block_size
    return elements[offset : offset + stop - start].contiguous()


def elements_to_region(
    elements: Tensor, start: int, stop: int, block_size: int, per_byte: int
) -> Tensor:
    """The region's codes (packed, code 0 outside ``[start, stop)``) from one code per
    element."""
    first, end = touched_blocks(start, stop, block_size)
    region = torch.zeros((end - first) * block_size, dtype=torch.uint8, device=elements.device)
    offset = start - first * block_size
    region[offset : offset + stop - start] = elements.reshape(-1)
    if per_byte == 2:
        pairs = region.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    return region
