"""Yes/no answers and counts over DTensor shards: "is there a NaN anywhere in the tensor?".

Wrappers that branch on what they find in the updates (``apply_if_finite``, ``zero_nans``,
``MultiSteps``' ``skip_not_finite``) see only the local shards when ``fo.Optimizer`` steps
DTensor params (see :mod:`functional_optim._sharded_params`). Their answers must be the
answers for the whole tensors, the same on every rank, or the ranks would take different
branches. These helpers finish a local answer with ONE ``all_reduce`` (a sum of 0/1 values,
read as "any") over the mesh dims where some owner is sharded. Without a shard context (plain
tensors) they return None and callers keep their local answer, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from functional_optim._shard_context import (
    _all_reduce_sum,
    _contributing,
    owner_infos,
    summed_over_shards,
)

__all__ = ["any_over_shards", "each_any_over_shards", "summed_over_shards_of"]


def any_over_shards(local: Tensor, owners: Sequence[Tensor]) -> Tensor | None:
    """Whether ``local`` (a 0-d bool, true when some local shard has the property) holds on
    some rank, with one collective over every mesh dim where an owner is sharded.

    Args:
        local: the local answer (0-d bool).
        owners: the local params the tested tensors belong to (looked up in the shard context).

    Returns:
        The global answer (0-d bool, on ``local``'s device), or None when no owner is a shard.
    """
    infos = owner_infos(owners)
    if infos is None:
        return None
    mesh, dims, _ = _contributing(infos)  # a replica repeating a True changes nothing
    if not dims:
        return local
    total = _all_reduce_sum(local.reshape(1).to(torch.float32), mesh, dims)
    return total[0] > 0


def each_any_over_shards(local: Sequence[Tensor], owners: Sequence[Tensor]) -> list[Tensor]:
    """Per tensor, whether ``local[i]`` (0-d bool) holds on some shard of tensor ``i``, with one
    collective for all of them (each tensor reduced over its own shard dims only).

    Args:
        local: the local answers, one 0-d bool per tensor.
        owners: the local param each answer belongs to.

    Returns:
        One 0-d bool per tensor (on its local answer's device); ``local`` itself when no owner
        is a shard.
    """
    infos = owner_infos(owners)
    if infos is None or not local:
        return list(local)
    first = local[0].device
    flags = torch.stack([f.to(device=first, dtype=torch.float32) for f in local])
    total = summed_over_shards(flags, infos)
    return [(t > 0).to(f.device) for t, f in zip(total.unbind(0), local, strict=True)]


def summed_over_shards_of(local: Tensor, owners: Sequence[Tensor]) -> Tensor | None:
    """Entry ``i`` of ``local`` (a count over the local shard of tensor ``i``) summed over that
    tensor's shards, with one collective (see :func:`summed_over_shards`).

    Args:
        local: a 1-D tensor, one entry per owner.
        owners: the local param each entry belongs to.

    Returns:
        The whole-tensor sums, or None when no owner is a shard.
    """
    infos = owner_infos(owners)
    return None if infos is None else summed_over_shards(local, infos)
