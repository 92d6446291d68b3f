"""The :class:`~.layout.Placement` of each local tensor of a step.

Three sources, in order: a :class:`~.layout.Sharing` installed by the caller (ZeRO's flat
pieces), the DTensor a local tensor belongs to (``fo.Optimizer``'s local step of FSDP2
params: ``Shard(0)`` on one mesh dim, Replicate elsewhere), or else the tensor is a whole
parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._lowbit.layout import Placement, active_sharing
from functional_optim._owner_compute import _ACTIVE as _OUTER_PARAMS
from functional_optim._shard_context import _group_names
from functional_optim._sharded_params import is_dtensor

__all__ = ["group_placements"]

MaxReducer = Callable[[Tensor], Tensor]


def _no_reduction(t: Tensor) -> Tensor:
    return t


def _dtensor_placement(p: Any, where: str) -> tuple[Placement, int | None]:
    """The placement of ``p``'s local shard and the mesh dim it is split over (or None)."""
    shard_dims = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if not shard_dims:
        return Placement(p.numel()), None
    dim = shard_dims[0]
    placement = p.placements[dim]
    if len(shard_dims) > 1 or not placement.is_shard() or placement.dim != 0:
        raise ValueError(
            f"{where} has placements {tuple(p.placements)}; low-bit optimizer states on "
            "DTensor params need Shard(0) on one mesh dim and Replicate elsewhere (FSDP2's "
            "layout), so that a local shard is one range of the flattened parameter"
        )
    rows = p.shape[0]
    row = p.numel() // rows if rows else 0
    world = p.device_mesh.size(dim)
    chunk = -(-rows // world)
    coordinate = p.device_mesh.get_coordinate()[dim]
    starts = [min(r * chunk, rows) * row for r in range(world + 1)]
    cuts = tuple(sorted({c for c in starts if 0 < c < p.numel()}))
    return Placement(p.numel(), starts[coordinate], cuts), dim


def group_placements(
    params: Sequence[Tensor],
) -> tuple[list[Placement], int, MaxReducer]:
    """The placements of a group's local tensors, the slot count and the MAX reducer.

    Raises:
        ValueError: a DTensor placement other than FSDP2's, or sharded params of one group
            split over different mesh dims.
    """
    sharing = active_sharing()
    if sharing is not None and any(id(p) in sharing.placements for p in params):
        whole = [Placement(p.numel()) for p in params]
        found = [sharing.placements.get(id(p), w) for p, w in zip(params, whole, strict=True)]
        return found, sharing.slots, sharing.all_reduce_max
    outer = _OUTER_PARAMS[-1] if _OUTER_PARAMS else {}
    placements: list[Placement] = []
    slots, mesh, dims = 0, None, set()
    for j, p in enumerate(params):
        dt = outer.get(id(p), p if is_dtensor(p) else None)
        if dt is None:
            placements.append(Placement(p.numel()))
            continue
        place, dim = _dtensor_placement(dt, f"param {j}")
        if dim is not None:
            mesh = dt.device_mesh
            dims.add(dim)
            place = place._replace(slot=slots)
            slots += len(place.cuts)
        placements.append(place)
    if len(dims) > 1:
        raise ValueError(
            f"the params of a group are sharded over mesh dims {sorted(dims)}; low-bit states "
            "need one"
        )
    if not slots:
        return placements, 0, _no_reduction
    (name,) = _group_names(mesh, tuple(dims))

    def all_reduce_max(t: Tensor) -> Tensor:
        out = torch.ops._c10d_functional.all_reduce(t, "max", name)
        return torch.ops._c10d_functional.wait_tensor(out)  # type: ignore[no-any-return]

    return placements, slots, all_reduce_max
