"""Flat parameter buckets: one contiguous buffer per (device, rank) with parameter views.

With ``parameters_as_bucket_view=True`` a sharded optimizer keeps, for each device and each rank,
the trainable parameters that rank updates in one flat tensor, and re-points every ``param.data``
at its slice. Syncing a shard is then one collective on the bucket instead of one per parameter,
and the local optimizer updates the bucket in place through the views.

Frozen parameters stay out of the buckets; a parameter that was bucketed before and is frozen now
gets a private copy of its data so that rebuilding the buckets cannot pull the storage from under
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "build_rank_buckets",
    "flatten_into_bucket",
    "params_by_device",
]


def params_by_device(
    params_per_rank: Sequence[Iterable[torch.Tensor]],
) -> dict[torch.device, list[list[torch.Tensor]]]:
    """Split each rank's parameters by device.

    Args:
        params_per_rank: ``params_per_rank[r]``: the parameters rank ``r`` updates, in order.

    Returns:
        ``{device: [params of rank 0 on device, params of rank 1 on device, ...]}``, devices in
        order of first appearance (rank 0 first), parameters in their original order. Buckets
        are matched across ranks by this position, so every rank must place its parameters on
        devices in the same pattern.
    """
    world_size = len(params_per_rank)
    by_device: dict[torch.device, list[list[torch.Tensor]]] = {}
    for rank, params in enumerate(params_per_rank):
        for param in params:
            per_rank = by_device.get(param.device)
            if per_rank is None:
                per_rank = by_device[param.device] = [[] for _ in range(world_size)]
            per_rank[rank].append(param)
    return by_device


def flatten_into_bucket(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Copy ``params`` into one new flat tensor and re-point each ``param.data`` at its slice.

    Args:
        params: non-empty, same dtype, all on ``device``.
        device: where the bucket lives.

    Returns:
        The bucket; ``params[i].data`` is a view of ``bucket[offset_i : offset_i + numel_i]``.

    Raises:
        ValueError: if ``params`` is empty or mixes dtypes.
    """
    if not params:
        raise ValueError("flatten_into_bucket needs at least one parameter")
    dtype = params[0].dtype
    if any(p.dtype != dtype for p in params):
        raise ValueError(f"a bucket holds one dtype, got {sorted({str(p.dtype) for p in params})}")
    bucket = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
    offset = 0
    for param in params:
        end = offset + param.numel()
        view = bucket[offset:end]
        view.copy_(param.data.reshape(-1))
        param.data = view.view_as(param.data)
        offset = end
    return bucket


def build_rank_buckets(
    device_to_params_per_rank: dict[torch.device, list[list[torch.Tensor]]],
) -> list[list[torch.Tensor]]:
    """Build the bucket of every (device, rank) pair from the trainable parameters.

    Args:
        device_to_params_per_rank: as returned by :func:`params_by_device`.

    Returns:
        ``buckets[d][r]``: the flat bucket for the ``d``-th device and rank ``r``. A pair without
        trainable parameters gets a one-element float32 placeholder (what torch uses), so every
        rank issues the same collectives.
    """
    buckets: list[list[torch.Tensor]] = []
    for device, params_per_rank in device_to_params_per_rank.items():
        per_rank: list[torch.Tensor] = []
        for params in params_per_rank:
            trainable = []
            for param in params:
                if param.requires_grad:
                    trainable.append(param)
                else:
                    # It may still be a view of an old bucket: give it its own storage.
                    param.data = param.data.detach().clone()
            if trainable:
                per_rank.append(flatten_into_bucket(trainable, device))
            else:
                per_rank.append(torch.zeros(1, device=device))
        buckets.append(per_rank)
    return buckets
