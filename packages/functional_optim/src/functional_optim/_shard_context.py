"""The shard context: which local tensors of a step are shards of DTensor params.

``fo.Optimizer`` steps the local shards of DTensor params as plain tensors (see
:mod:`functional_optim._sharded_params`). Element-wise maths needs nothing more; a reduction
over a whole tensor (a global norm, a per-tensor norm) must add up the shards. For the length
of a step the optimizer installs a context mapping each local param to its
:class:`ShardInfo`; the reduction helpers here look their *owners* (the local params the
reduced tensors belong to, e.g. ``view.params``) up in it and finish the reduction with ONE
``all_reduce`` over the mesh dims where some owner is sharded. Without a context (plain
tensors) they return None and callers keep their unsharded maths, bit for bit.

A tensor replicated over a mesh dim of that collective contributes from coordinate 0 of the
dim only, so each tensor is summed over exactly its own shard dims. The collective goes
through ``torch.ops._c10d_functional`` (this package never imports ``torch.distributed``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ShardInfo",
    "owner_infos",
    "shard_context",
    "sharded_global_norm",
    "sharded_norms",
    "sharded_rms",
    "summed_over_shards",
]


class ShardInfo(NamedTuple):
    """How a local tensor sits in its DTensor.

    Attributes:
        mesh: the ``DeviceMesh``.
        shard_dims: the mesh dims over which the tensor is split (``Shard``, ``_StridedShard``).
        numel: the number of elements of the whole (global) tensor.
    """

    mesh: Any
    shard_dims: frozenset[int]
    numel: int


#: the contexts installed, innermost last: ``id(local param) -> ShardInfo``
_ACTIVE: list[dict[int, ShardInfo]] = []

#: ``(mesh, dims) -> group names`` of the collective over those mesh dims
_GROUPS: dict[tuple[Any, tuple[int, ...]], list[str]] = {}


@contextlib.contextmanager
def shard_context(infos: dict[int, ShardInfo]) -> Iterator[None]:
    """Install ``infos`` (``id(local param) -> ShardInfo``) for the duration of a step.

    Args:
        infos: the group's local params by id; the caller keeps the tensors alive.
    """
    _ACTIVE.append(infos)
    try:
        yield
    finally:
        _ACTIVE.pop()


def owner_infos(owners: Sequence[Tensor]) -> list[ShardInfo] | None:
    """The :class:`ShardInfo` of each owner, or None when no context is active or no owner is
    a local shard (the caller then keeps its unsharded maths).

    Raises:
        ValueError: if some owners are shards and others are not.
    """
    if not _ACTIVE or not owners:
        return None
    infos = _ACTIVE[-1]
    found = [infos.get(id(t)) for t in owners]
    if all(info is None for info in found):
        return None
    missing = [i for i, info in enumerate(found) if info is None]
    if missing:
        raise ValueError(
            f"a reduction mixes DTensor shards with plain tensors (entries {missing[:5]})"
        )
    return found  # type: ignore[return-value]


def _group_names(mesh: Any, dims: tuple[int, ...]) -> list[str]:
    """Process-group names of one collective over ``dims`` of ``mesh`` (the flattened mesh
    when it spans several named dims; else one group per dim)."""
    key = (mesh, dims)
    names = _GROUPS.get(key)
    if names is None:
        if len(dims) == 1:
            names = [mesh.get_group(dims[0]).group_name]
        elif mesh.mesh_dim_names:
            sub = (
                mesh
                if len(dims) == mesh.ndim
                else mesh[tuple(mesh.mesh_dim_names[d] for d in dims)]
            )
            names = [sub._flatten().get_group().group_name]
        else:
            names = [mesh.get_group(d).group_name for d in dims]
        _GROUPS[key] = names
    return names


def _all_reduce_sum(t: Tensor, mesh: Any, dims: tuple[int, ...]) -> Tensor:
    for name in _group_names(mesh, dims):
        t = torch.ops._c10d_functional.all_reduce(t, "sum", name)
        t = torch.ops._c10d_functional.wait_tensor(t)
    return t


def _contributing(infos: Sequence[ShardInfo]) -> tuple[Any, tuple[int, ...], list[bool]]:
    """The mesh, the mesh dims of the collective, and whether each entry contributes on this
    rank (a tensor replicated over one of those dims contributes from coordinate 0 only)."""
    mesh = infos[0].mesh
    if any(info.mesh is not mesh and info.mesh != mesh for info in infos):
        raise ValueError("a reduction spans DTensors on different device meshes")
    dims = tuple(sorted(frozenset().union(*(info.shard_dims for info in infos))))
    coordinate = mesh.get_coordinate() if dims else None
    if coordinate is None:
        return mesh, dims, [True] * len(infos)
    keep = [all(coordinate[d] == 0 for d in dims if d not in info.shard_dims) for info in infos]
    return mesh, dims, keep


def summed_over_shards(local: Tensor, infos: Sequence[ShardInfo]) -> Tensor:
    """Entry ``i`` of ``local`` (a sum over the local elements of tensor ``i``) summed over
    tensor ``i``'s shards, for every ``i``, with one collective.

    Args:
        local: a 1-D tensor, one entry per owner.
        infos: the owners' :class:`ShardInfo` (from :func:`owner_infos`).

    Returns:
        The sums over the whole tensors.
    """
    mesh, dims, keep = _contributing(infos)
    if not dims:
        return local
    if not all(keep):
        local = local * torch.tensor(keep, dtype=local.dtype, device=local.device)
    return _all_reduce_sum(local, mesh, dims)


def sharded_global_norm(norms: Sequence[Tensor], infos: Sequence[ShardInfo]) -> Tensor:
    """The 2-norm of all tensors seen as one vector from the local 2-norms of their shards.

    Computed as torch's DTensor ``clip_grad_norm_`` does: the norm of the stacked local norms,
    then ``(sum over shards of it ** 2) ** 0.5``.

    Args:
        norms: the 0-d local norm of each tensor.
        infos: the owners' :class:`ShardInfo`.

    Returns:
        A 0-d tensor.
    """
    mesh, dims, keep = _contributing(infos)
    first = norms[0].device
    kept = [n.to(first) for n, k in zip(norms, keep, strict=True) if k]
    local: Tensor
    if kept:
        local = torch.linalg.vector_norm(torch.stack(kept), 2.0)
    else:
        local = torch.zeros((), dtype=norms[0].dtype, device=first)
    if not dims:
        return local
    total = _all_reduce_sum(torch.pow(local, 2.0), mesh, dims)
    root: Tensor = torch.pow(total, 0.5)
    return root


def _global_squares(tensors: Sequence[Tensor], infos: Sequence[ShardInfo]) -> Tensor:
    """Each tensor's sum of squares over its whole DTensor (float64, one collective)."""
    first = tensors[0].device
    local = torch.stack(
        [torch.linalg.vector_norm(t, 2.0, dtype=torch.float64).square().to(first) for t in tensors]
    )
    return summed_over_shards(local, infos)


def sharded_norms(tensors: Sequence[Tensor], owners: Sequence[Tensor]) -> list[Tensor] | None:
    """Each tensor's 2-norm over its whole DTensor, with one collective for all of them.

    Args:
        tensors: local tensors (shards of DTensors).
        owners: the local param each tensor belongs to (looked up in the shard context).

    Returns:
        One 0-d norm per tensor (its dtype and device), or None when no owner is a shard.
    """
    infos = owner_infos(owners)
    if infos is None:
        return None
    roots = _global_squares(tensors, infos).sqrt()
    return [
        r.to(device=t.device, dtype=t.dtype) for r, t in zip(roots.unbind(0), tensors, strict=True)
    ]


def sharded_rms(tensors: Sequence[Tensor], owners: Sequence[Tensor]) -> list[Tensor] | None:
    """Each tensor's root mean square over its whole DTensor (see :func:`sharded_norms`).

    Returns:
        One 0-d value per tensor, or None when no owner is a shard.
    """
    infos = owner_infos(owners)
    if infos is None:
        return None
    numel = torch.tensor([float(info.numel) for info in infos], dtype=torch.float64)
    roots = (_global_squares(tensors, infos) / numel.to(tensors[0].device)).sqrt()
    return [
        r.to(device=t.device, dtype=t.dtype) for r, t in zip(roots.unbind(0), tensors, strict=True)
    ]
