"""Pure layout of a balanced flat partition: parameters laid end to end, cut into equal shards.

The parameters of one (dtype, device) bucket are concatenated, in global index order, into one
flat buffer of ``world_size * shard_size`` elements, ``shard_size = ceil(total / world_size)``.
Rank ``r`` owns the elements ``[r * shard_size, (r + 1) * shard_size)``: every shard has the same
size (what ``reduce_scatter``/``all_gather`` into one tensor need, with no copy) and differs from
``total / world_size`` by less than one element. The at most ``world_size - 1`` padding elements
sit at the end of the buffer and belong to no parameter. A parameter may straddle ranks: each
rank sees it as one or more :class:`FlatSlice` element ranges.

Nothing here touches a tensor or a process group: sizes in, slices out, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, TypeVar

__all__ = [
    "FlatLayout",
    "FlatSlice",
    "group_by_key",
    "plan_flat_layout",
    "shard_numels",
]

K = TypeVar("K", bound=Hashable)


class FlatSlice(NamedTuple):
    """The part of one parameter held by one shard.

    Attributes:
        param_index: the parameter's position in the sequence given to :func:`plan_flat_layout`.
        start: first element of the parameter (in its flattened order) in this shard.
        stop: one past the last such element.
        offset: where ``start`` lies in the flat buffer (``flat[offset : offset + stop - start]``).
    """

    param_index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements in the slice."""
        return self.stop - self.start


class FlatLayout(NamedTuple):
    """A flat buffer cut into ``world_size`` equal shards.

    Attributes:
        numels: the size of each parameter, in buffer order.
        offsets: where each parameter starts in the flat buffer.
        world_size: the number of shards.
        shard_size: elements per shard (``ceil(total / world_size)``; 0 for an empty buffer).
        slices: ``slices[r]``: the parameter slices in rank ``r``'s shard, in buffer order.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int
    shard_size: int
    slices: tuple[tuple[FlatSlice, ...], ...]

    @property
    def total(self) -> int:
        """Number of parameter elements (without padding)."""
        return sum(self.numels)

    @property
    def padded_size(self) -> int:
        """Size of the flat buffer (``world_size * shard_size``)."""
        return self.world_size * self.shard_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(begin, end)`` of rank ``rank``'s shard in the flat buffer."""
        return rank * self.shard_size, (rank + 1) * self.shard_size


def plan_flat_layout(numels: Sequence[int], world_size: int) -> FlatLayout:
    """Lay ``numels`` end to end and split the result into ``world_size`` equal shards.

    Args:
        numels: the number of elements of each parameter, in the order they are concatenated.
        world_size: the number of ranks (>= 1).

    Returns:
        The layout; empty parameters appear in no slice.

    Raises:
        ValueError: if ``world_size < 1`` or a size is negative.

    Example::

        >>> layout = plan_flat_layout([5, 2], 2)
        >>> layout.shard_size, [list(s) for s in layout.slices]
        (4, [[FlatSlice(param_index=0, start=0, stop=4, offset=0)],
             [FlatSlice(param_index=0, start=4, stop=5, offset=4),
              FlatSlice(param_index=1, start=0, stop=2, offset=5)]])
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be non-negative, got {list(numels)}")
    offsets: list[int] = []
    total = 0
    for n in numels:
        offsets.append(total)
        total += n
    shard = -(-total // world_size)
    slices: list[list[FlatSlice]] = [[] for _ in range(world_size)]
    for index, (n, begin) in enumerate(zip(numels, offsets)):
        position = begin
        end = begin + n
        while position < end:
            rank = position // shard
            cut = min(end, (rank + 1) * shard)
            slices[rank].append(FlatSlice(index, position - begin, cut - begin, position))
            position = cut
    return FlatLayout(
        tuple(numels), tuple(offsets), world_size, shard, tuple(tuple(s) for s in slices)
    )


def shard_numels(layout: FlatLayout) -> list[int]:
    """Parameter elements (padding excluded) held by each rank: its optimizer-state footprint."""
    return [sum(s.numel for s in per_rank) for per_rank in layout.slices]


def group_by_key(keys: Sequence[K]) -> dict[K, list[int]]:
    """Indices of ``keys`` grouped by value, groups in order of first appearance.

    Used to split the parameters into one flat buffer per ``(dtype, device)``.
    """
    groups: dict[K, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return groups
