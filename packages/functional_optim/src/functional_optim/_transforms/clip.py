"""``clip_by_global_norm``: ``torch.nn.utils.clip_grad_norm_`` as a transform."""

from __future__ import annotations

import torch

from functional_optim._base import GradientTransformation, OptState, init_empty
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, global_norm, tree_flatten

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(max_norm / (total_norm + 1e-6), 1)``.

    ``total_norm`` is the 2-norm of all updates seen as one vector, computed as
    ``torch.nn.utils.clip_grad_norm_(..., foreach=False)`` does, so results match it.

    Args:
        max_norm: the largest allowed total norm.

    Returns:
        A stateless ``GradientTransformation``.

    Raises:
        ValueError: if ``max_norm`` is negative.
    """
    if max_norm < 0.0:
        raise ValueError(f"Invalid max_norm value: {max_norm}; it must be >= 0")

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        leaves, spec = tree_flatten(updates)
        if _ops.none_or(leaves):
            return updates, state
        total = global_norm(leaves)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        out = [
            None if u is None else _ops.mul(u, _ops.like(coef.to(u.device), u), inplace)
            for u in leaves
        ]
        return spec.unflatten(out), state

    return GradientTransformation(init_empty, update)
