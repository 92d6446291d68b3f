"""State buffers of sharded DTensor params whose maths is not element-wise, and their checks.

Adafactor's factors and SM3's accumulators reduce a param along some dims. On a DTensor param
(``fo.Optimizer``'s local step) such a buffer is split like the param along the dims it keeps
and whole (replicated) along the ones it reduced: :func:`state_zeros` lays it out. The checks
say which layouts the sharded maths (:mod:`functional_optim._sharded_adafactor`,
``scale_by_sm3``) can step, before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._matrix_layout import Region, local_region, split_dims

__all__ = [
    "all_reduce_max",
    "check_factored_placements",
    "check_row_placements",
    "is_row_sharded",
    "matrix_region",
    "state_zeros",
]


def check_row_placements(i: int, params: Sequence[Any], name: str) -> None:
    """Raise unless every sharded DTensor of group ``i`` is ``Shard(0)`` on a 1-D mesh.

    Args:
        i: the group's index.
        params: its DTensor params.
        name: the maths, for the message (``"Adafactor"``, ``"SM3"``).

    Raises:
        ValueError: naming the first param with another layout.
    """
    for k, p in enumerate(params):
        placements = tuple(p.placements)
        if all(placement.is_replicate() for placement in placements):
            continue
        if not is_row_sharded(p):
            raise ValueError(
                f"param {k} of param group {i} has placements {placements} on a "
                f"{len(placements)}-D device mesh; {name} steps sharded params with "
                "Shard(0) on a 1-D mesh (FSDP2) only"
            )


def check_factored_placements(i: int, params: Sequence[Any]) -> None:
    """Raise unless Adafactor can step every sharded DTensor of group ``i``: a matrix split
    along its rows and/or columns (``Shard(0|1)``, ``_StridedShard(0|1)``, ``Replicate`` on any
    mesh: FSDP2, tensor parallelism), a vector, or a param of 3+ dims split by its leading dim
    on a 1-D mesh.

    Raises:
        ValueError: naming the first param with another layout.
    """
    for k, p in enumerate(params):
        placements = tuple(p.placements)
        if all(placement.is_replicate() for placement in placements) or is_row_sharded(p):
            continue
        splits = [split_dims(placement) for placement in placements]
        if p.dim() <= 2 and all(s is None or s[0] < max(p.dim(), 1) for s in splits):
            if p.dim() == 2:
                matrix_region(p)  # a layout torch.chunk's rule does not give raises here
            continue
        raise ValueError(
            f"param {k} of param group {i} has placements {placements} on a "
            f"{len(placements)}-D device mesh; Adafactor steps matrices split along rows or "
            "columns, vectors, and params of 3+ dims split by Shard(0) on a 1-D mesh"
        )


#: ``(shape, placements, mesh shape, coordinate) -> region`` of this rank's block
_REGIONS: dict[tuple[Any, ...], Region] = {}


def matrix_region(p: Any) -> Region:
    """This rank's block of the DTensor matrix ``p``."""
    mesh = p.device_mesh
    key = (tuple(p.shape), tuple(p.placements), tuple(mesh.shape), tuple(mesh.get_coordinate()))
    region = _REGIONS.get(key)
    if region is None:
        region = _REGIONS[key] = local_region(key[0], key[1], key[2], key[3])
        if region.shape != tuple(p._local_tensor.shape):
            raise ValueError(
                f"a param with placements {key[1]} has a local shape "
                f"{tuple(p._local_tensor.shape)}, not the {region.shape} of torch.chunk's rule "
                "in mesh-dim order; a non-default shard order is not supported"
            )
    return region


def is_row_sharded(p: Any) -> bool:
    """Whether ``p`` is a DTensor split by rows only: ``Shard(0)`` on a 1-D mesh (FSDP2)."""
    placements = getattr(p, "placements", None)
    if placements is None or not hasattr(p, "_local_tensor") or len(placements) != 1:
        return False
    first = placements[0]
    return bool(first.is_shard(0)) and type(first).__name__ != "_StridedShard"


def state_zeros(p: Any, shape: tuple[int, ...], follows: dict[int, int]) -> Tensor:
    """Zeros of ``shape`` for a state buffer of ``p``: ``p.new_zeros``, except on a sharded
    DTensor, where each buffer dim in ``follows`` is split as ``p``'s dim it maps to (``{0: 0}``:
    the buffer's rows are ``p``'s rows) and the buffer is whole along the others (replicated
    over the mesh dims that split nothing it follows).

    Args:
        p: the param.
        shape: the buffer's global shape.
        follows: buffer dim -> the dim of ``p`` it follows.
    """
    placements = getattr(p, "placements", None)
    if placements is None or all(pl.is_replicate() for pl in placements):
        return p.new_zeros(shape)  # type: ignore[no-any-return]
    by_param_dim = {d: b for b, d in follows.items()}
    replicate = p.new_empty(()).placements[0]
    out, local = [], list(shape)
    for placement in placements:
        split = split_dims(placement)
        if split is None or split[0] not in by_param_dim:
            out.append(replicate)
            continue
        dim, factor = split
        b = by_param_dim[dim]
        kind = type(placement)
        out.append(kind(b) if factor == 1 else kind(b, split_factor=factor))
    for b, d in follows.items():
        local[b] = p._local_tensor.shape[d]
    stride = torch.empty(shape, device="meta").stride()
    return type(p).from_local(  # type: ignore[no-any-return]
        p._local_tensor.new_zeros(local), p.device_mesh, out, run_check=False,
        shape=torch.Size(shape), stride=stride,
    )  # fmt: skip


def all_reduce_max(t: Tensor, mesh: Any) -> Tensor:
    """The element-wise maximum of ``t`` over the ranks of the 1-D ``mesh``."""
    ops = torch.ops._c10d_functional
    out = ops.all_reduce(t, "max", mesh.get_group(0).group_name)
    return ops.wait_tensor(out)  # type: ignore[no-any-return]
