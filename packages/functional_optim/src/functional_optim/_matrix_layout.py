"""Where each rank's local block of a sharded DTensor matrix sits in the whole matrix.

A 2-D DTensor on a device mesh is split along its rows by the ``Shard(0)`` /
``_StridedShard(0)`` placements and along its columns by the ``Shard(1)`` /
``_StridedShard(1)`` ones, in mesh-dim order (FSDP2 and tensor parallelism both produce these);
``Replicate`` leaves a dim alone. Rows and columns split independently, so a rank's local block
is ``whole[rows][:, cols]`` for two index sets computed here from ``torch.chunk``'s rule (chunks
of ``ceil(size / parts)``, then empty ones) without any communication. A strided shard first
cuts the dim into ``split_factor`` pieces, cuts each into the mesh dim's parts and gives rank
``s`` the ``s``-th part of every piece, in order.

:func:`local_region` gives one rank's block; :func:`same_shape` checks it against the local
tensor, so a layout this module does not model (e.g. a non-default shard order) is refused
with a clear error instead of producing wrong numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["Region", "local_region", "region_get", "region_set", "split_dims"]

#: a contiguous index range ``(start, stop)`` or the indices themselves
Span = tuple[int, int] | Tensor


class Region(NamedTuple):
    """One rank's block of a matrix: the rows and columns it holds (``whole[rows][:, cols]``).

    Attributes:
        rows: a ``(start, stop)`` range or an index tensor along dim 0.
        cols: the same along dim 1.
        shape: ``(len(rows), len(cols))``.
    """

    rows: Span
    cols: Span
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        """The number of elements of the block."""
        return self.shape[0] * self.shape[1]


def _chunk(index: Tensor, parts: int, part: int) -> Tensor:
    """``torch.chunk(index, parts)[part]``, empty where ``torch.chunk`` has fewer chunks."""
    size = -(-index.numel() // parts) if index.numel() else 0
    start = min(index.numel(), part * size)
    return index[start : min(index.numel(), start + size)]


def split_dims(placement: Any) -> tuple[int, int] | None:
    """``(tensor dim, split factor)`` of a ``Shard`` / ``_StridedShard`` placement (factor 1 for
    a plain shard); None for ``Replicate``.

    Raises:
        ValueError: for any other placement (``Partial``).
    """
    if type(placement).__name__ == "_StridedShard":
        return int(placement.dim), int(placement.split_factor)
    if placement.is_shard():
        return int(placement.dim), 1
    if placement.is_replicate():
        return None
    raise ValueError(f"placement {placement} is neither Shard nor Replicate")


def _span(index: Tensor) -> Span:
    """A range when ``index`` is contiguous and increasing, else the index tensor."""
    n = index.numel()
    if n == 0:
        return (0, 0)
    start = int(index[0])
    if int(index[-1]) - start == n - 1 and bool((index.diff() == 1).all()):
        return (start, start + n)
    return index


def local_region(
    shape: tuple[int, int],
    placements: Sequence[Any],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> Region:
    """The block of a ``shape`` matrix held at ``coordinate`` of a mesh of ``mesh_shape``.

    Args:
        shape: the matrix's global shape.
        placements: one placement per mesh dim.
        mesh_shape: the mesh's size along each dim.
        coordinate: the rank's coordinate in the mesh.

    Returns:
        The rank's :class:`Region`.

    Raises:
        ValueError: for a placement other than Shard / Replicate or a shard of a dim > 1.
    """
    index = [torch.arange(shape[0]), torch.arange(shape[1])]
    for d, placement in enumerate(placements):
        split = split_dims(placement)
        if split is None:
            continue
        dim, factor = split
        if dim not in (0, 1):
            raise ValueError(f"placement {placement} shards dim {dim} of a 2-D matrix")
        parts, part = int(mesh_shape[d]), int(coordinate[d])
        if factor == 1:
            index[dim] = _chunk(index[dim], parts, part)
        else:
            pieces = [_chunk(index[dim], factor, f) for f in range(factor)]
            index[dim] = torch.cat([_chunk(p, parts, part) for p in pieces])
    rows, cols = index
    return Region(_span(rows), _span(cols), (rows.numel(), cols.numel()))


def region_get(whole: Tensor, region: Region) -> Tensor:
    """The block ``whole[rows][:, cols]`` (a view where both spans are ranges)."""
    out = whole
    if isinstance(region.rows, Tensor):
        out = out.index_select(0, region.rows.to(whole.device))
    else:
        out = out[region.rows[0] : region.rows[1]]
    if isinstance(region.cols, Tensor):
        return out.index_select(1, region.cols.to(whole.device))
    return out[:, region.cols[0] : region.cols[1]]


def region_set(whole: Tensor, region: Region, block: Tensor) -> None:
    """Write ``block`` (shaped ``region.shape``) into its place in ``whole``."""
    rows, cols = region.rows, region.cols
    if not isinstance(rows, Tensor) and not isinstance(cols, Tensor):
        whole[rows[0] : rows[1], cols[0] : cols[1]].copy_(block)
        return
    r = torch.arange(*rows) if not isinstance(rows, Tensor) else rows
    c = torch.arange(*cols) if not isinstance(cols, Tensor) else cols
    whole.index_put_((r.to(whole.device)[:, None], c.to(whole.device)[None, :]), block)
