"""Whether every rank holds the same tensor values, checked with a few bytes instead of the tensors.

An averager that starts from the model every rank already holds (DDP and our examples broadcast
or seed the initial weights) needs no full average to align the replicas; this check tells when
that is safe. It compares bit-level checksums, so ``-0.0`` and ``0.0`` (or two NaN payloads)
count as different: in doubt, the caller averages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["fingerprint", "replicas_identical"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_PRIME = 65521  # position weights cycle through 1..65521


def fingerprint(tensor: Tensor) -> Tensor:
    """Two int64 checksums of a tensor's bits: their sum and a position-weighted sum.

    Args:
        tensor: any tensor whose element size is 1, 2, 4 or 8 bytes.

    Returns:
        A 2-element int64 tensor on ``tensor``'s device (int64 sums wrap around).
    """
    flat = tensor.detach().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % _PRIME + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def replicas_identical(
    tensors: Sequence[Tensor], group: ProcessGroup | None = None
) -> tuple[bool, int]:
    """Whether every rank of ``group`` holds bitwise the same ``tensors`` (one all-reduce).

    Every rank gets the same answer. Collectives: one ``all_reduce(MAX)`` of ``4 * len(tensors)``
    int64 values (each checksum and its bitwise complement, so the maximum also gives the
    minimum).

    Args:
        tensors: this rank's tensors, the same number, shapes and dtypes on every rank.
        group: the process group; None for the default group.

    Returns:
        ``(identical, payload bytes this rank handed to the all-reduce)``.
    """
    if not tensors:
        return True, 0
    local = torch.cat([fingerprint(t) for t in tensors])
    packed = torch.cat([local, torch.bitwise_not(local)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = packed[: local.numel()], torch.bitwise_not(packed[local.numel() :])
    return bool(torch.equal(highest, lowest)), packed.numel() * packed.element_size()
