"""DTensor params in the ``FunctionalX`` classes: step the local shards as plain tensors.

An element-wise kernel gives the same result on a shard as on the whole tensor, so the
functional optimizers hand their kernels the local tensors of DTensor params, gradients and
buffers (no DTensor dispatch per op); the buffers stay DTensors in ``state``. These helpers
run in eager mode only: TorchScript has no DTensors, and the callers guard them with
``torch.jit.is_scripting()``.
"""

from typing import List, Optional

import torch
from torch import Tensor


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


@torch.jit.unused
def has_dtensor(params: List[Tensor]) -> bool:
    """Whether any of ``params`` is a DTensor (duck-typed)."""
    return any(_is_dtensor(p) for p in params)


@torch.jit.unused
def check_local_step(params: List[Tensor], grads: List[Tensor], name: str) -> None:
    """Check that each gradient has its param's layout before the local tensors are stepped.

    Args:
        params: the params that have a gradient.
        grads: their gradients, in order.
        name: the optimizer's name, for messages.

    Raises:
        TypeError: if a param is a DTensor and its gradient is not, or the other way round.
        ValueError: if a param and its gradient are placed differently.
    """
    for i in range(len(params)):
        p, g = params[i], grads[i]
        if _is_dtensor(p) != _is_dtensor(g):
            raise TypeError(
                f"{name}: param {i} is {'a DTensor' if _is_dtensor(p) else 'a plain tensor'} "
                f"but its gradient is {'a DTensor' if _is_dtensor(g) else 'a plain tensor'}"
            )
        p_layout = (getattr(p, "placements", None), getattr(p, "device_mesh", None))
        g_layout = (getattr(g, "placements", None), getattr(g, "device_mesh", None))
        if _is_dtensor(p) and p_layout != g_layout:
            raise ValueError(
                f"{name}: param {i} has placements {p_layout[0]} but its gradient {g_layout[0]}"
            )


@torch.jit.unused
def refuse_sharded(params: List[Tensor], name: str) -> None:
    """Refuse sharded DTensor params for an optimizer that reads whole tensors.

    Raises:
        ValueError: naming the first param split over a mesh dimension.
    """
    for i in range(len(params)):
        placements = getattr(params[i], "placements", ())
        if _is_dtensor(params[i]) and any(not pl.is_replicate() for pl in placements):
            raise ValueError(
                f"{name}: param {i} is a sharded DTensor ({placements}), but {name} reads "
                "whole tensors (matrix or factored statistics); it can't step shards"
            )


@torch.jit.unused
def local_tensors(tensors: List[Tensor]) -> List[Tensor]:
    """The local tensors of DTensors; plain tensors as they are."""
    return [t._local_tensor if _is_dtensor(t) else t for t in tensors]  # type: ignore[attr-defined]


@torch.jit.unused
def local_optional(tensors: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
    """:func:`local_tensors` for a list with missing entries."""
    return [
        None if t is None else (t._local_tensor if _is_dtensor(t) else t)  # type: ignore[attr-defined]
        for t in tensors
    ]


@torch.jit.unused
def wrap_like(local: Tensor, param: Tensor) -> Tensor:
    """A buffer the kernel created for a DTensor ``param``'s shard, as a DTensor like ``param``."""
    if not _is_dtensor(param) or _is_dtensor(local):
        return local
    p = param
    return type(p).from_local(  # type: ignore[no-any-return, attr-defined]
        local,
        p.device_mesh,  # type: ignore[attr-defined]
        p.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=p.shape,
        stride=p.stride(),
    )
