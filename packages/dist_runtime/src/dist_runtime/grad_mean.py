"""The mean of the gradients over a process group, in one all-reduce (DDP's phase of a warm start).

The values are what DDP's ``allreduce_hook`` gives: every gradient divided by the group size,
then summed over the group. One flat float buffer is all-reduced (all gradients of one dtype,
the parameters' order) and copied back into each ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dist_runtime.process_group import resolve_group

__all__ = ["allreduce_grad_mean"]


def allreduce_grad_mean(params: Sequence[Tensor], process_group: ProcessGroup | None) -> int:
    """Replace every ``p.grad`` of ``params`` by its mean over the group.

    Args:
        params: parameters whose ``.grad`` is set (all of one dtype and device).
        process_group: the group; None for the default group.

    Returns:
        The payload bytes this rank handed to the all-reduce.

    Raises:
        ValueError: if a parameter has no gradient, or the gradients' dtypes differ.
    """
    grads = [p.grad for p in params]
    missing = [i for i, g in enumerate(grads) if g is None]
    if missing:
        raise ValueError(
            f"parameters {missing} have no .grad: average the gradients after backward() and "
            "before optimizer.step(), passing only parameters that received a gradient"
        )
    present = [g for g in grads if g is not None]
    if len({g.dtype for g in present}) > 1:
        raise ValueError("the gradients to average must share one dtype")
    if not present:
        return 0
    group = resolve_group(process_group)
    flat = torch.cat([g.reshape(-1) for g in present])
    flat.div_(dist.get_world_size(group))
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in present:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()
