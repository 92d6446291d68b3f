"""Where the blocks of a low-bit state lie: over the *global* flattened parameter.

Block ``b`` of a parameter is elements ``[b * B, (b + 1) * B)`` of the whole parameter,
flattened, however the parameter is sharded. A local tensor that is a contiguous range of the
flattened parameter (the whole parameter, a ZeRO ``partition="flat"`` piece, an FSDP2
``Shard(0)`` shard) is described by a :class:`Placement`; it touches blocks
``offset // B`` to ``ceil((offset + n) / B)``, and its codes occupy a *region* of whole
blocks, the elements of other ranks' pieces (and past the parameter's end) held as code zero.

A block that straddles a cut between two ranks' pieces is *shared*: its scale (the largest
magnitude in the block) needs the other ranks' elements. Every cut of every parameter has a
*slot* in one vector per step; each rank writes the largest local magnitude of the block
around each cut it touches and the vector is all-reduced with MAX (:class:`Sharing`), so every
rank gets the scale one process would compute, bit for bit.

The caller that shards (ZeRO, the DTensor step of ``fo.Optimizer``) installs a
:class:`Sharing` with :func:`sharing_context` for the step; without one, every tensor is a
whole parameter.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from torch import Tensor

__all__ = [
    "Batch",
    "GroupLayout",
    "Placement",
    "Sharing",
    "active_sharing",
    "cached_layout",
    "sharing_context",
]


class Placement(NamedTuple):
    """A local tensor as the range ``[offset, offset + local numel)`` of its parameter.

    Attributes:
        numel: elements of the whole (global) parameter.
        offset: where the local tensor starts in the flattened parameter.
        cuts: every boundary between two ranks' pieces inside the parameter (all ranks),
            ascending, without ``0`` and ``numel``.
        slot: the position of this parameter's first cut in the step's slot vector.
    """

    numel: int
    offset: int = 0
    cuts: tuple[int, ...] = ()
    slot: int = 0


class Sharing(NamedTuple):
    """The placements of one step's local tensors and the collective over their ranks.

    Attributes:
        placements: ``id(local tensor) -> Placement``.
        slots: length of the slot vector (every cut of every sharded parameter, all ranks).
        all_reduce_max: all-reduces a 1-D fp32 tensor with MAX over the ranks sharing the
            parameters, returning the result.
    """

    placements: dict[int, Placement]
    slots: int
    all_reduce_max: Callable[[Tensor], Tensor]


_ACTIVE: list[Sharing] = []


@contextlib.contextmanager
def sharing_context(sharing: Sharing) -> Iterator[None]:
    """Install ``sharing`` for the steps run inside (the caller keeps the tensors alive)."""
    _ACTIVE.append(sharing)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_sharing() -> Sharing | None:
    """The innermost installed :class:`Sharing`, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class Batch(NamedTuple):
    """A contiguous run of whole blocks of the flat region buffer, processed at once.

    Attributes:
        start: first element (a multiple of the block size).
        stop: one past the last element.
        pieces: ``(param position, local start, local stop, element in the batch)``.
    """

    start: int
    stop: int
    pieces: tuple[tuple[int, int, int, int], ...]


class GroupLayout:
    """The regions of a group's quantised tensors in one flat buffer per state field.

    Args:
        sizes: local numel of each quantised tensor.
        placements: their placements.
        block_size: elements per block.
        batch_elements: about how many elements one batch holds.

    Attributes:
        region: ``(first element, region elements)`` of each tensor in the flat buffer.
        pad_front: elements before the tensor's data in its first block.
        blocks: ``(first block, block count)`` of each tensor in the flat scales buffer.
        elements: the flat buffer's length.
        batches: the flat buffer cut into :class:`Batch` es.
        shared: ``(slot, flat block)`` of every block this rank must reduce with others.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        placements: Sequence[Placement],
        block_size: int,
        batch_elements: int,
    ) -> None:
        bs = block_size
        self.region: list[tuple[int, int]] = []
        self.pad_front: list[int] = []
        self.blocks: list[tuple[int, int]] = []
        self.shared: list[tuple[int, int]] = []
        at = 0
        for n, place in zip(sizes, placements, strict=True):
            first = place.offset // bs
            count = -(-(place.offset + n) // bs) - first if n else 0
            self.region.append((at * bs, count * bs))
            self.pad_front.append(place.offset - first * bs)
            self.blocks.append((at, count))
            for k, cut in enumerate(place.cuts):
                block = cut // bs
                if cut % bs and n and first <= block < first + count:
                    self.shared.append((place.slot + k, at + block - first))
            at += count
        span = max(bs, batch_elements // bs * bs)
        self.elements = at * bs
        self.batches = self._batches(sizes, bs, span)

    def _batches(self, sizes: Sequence[int], bs: int, span: int) -> list[Batch]:
        """Cut the buffer into runs of about ``span`` elements, at block boundaries."""
        batches: list[Batch] = []
        pieces: list[tuple[int, int, int, int]] = []
        start = 0
        for j, n in enumerate(sizes):
            if not n:
                continue
            begin, length = self.region[j]
            data0 = begin + self.pad_front[j]  # where element 0 of the tensor is
            pos = begin
            while pos < begin + length:
                stop = min(begin + length, start + span)
                lo, hi = max(pos, data0) - data0, min(stop, data0 + n) - data0
                if hi > lo:
                    pieces.append((j, lo, hi, lo + data0 - start))
                pos = stop
                if stop - start >= span:
                    batches.append(Batch(start, stop, tuple(pieces)))
                    pieces, start = [], stop
        if start < self.elements:
            batches.append(Batch(start, self.elements, tuple(pieces)))
        return batches


@functools.lru_cache(maxsize=64)
def cached_layout(
    sizes: tuple[int, ...], placements: tuple[Placement, ...], block_size: int, batch: int
) -> GroupLayout:
    """The :class:`GroupLayout` of a group, made once per layout (a step reuses it)."""
    return GroupLayout(sizes, placements, block_size, batch)
