"""Whether autograd (or a ``torch.func`` transform) may record a step's operations: then the
differentiable per-leaf path runs instead of the in-place or out-of-place list kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from functional_optim._tree import PyTree, tree_leaves

__all__ = ["REQUIRES_GRAD", "leaves_recording", "recording"]

#: ``tensor.requires_grad`` as a C function (a ``TypeError`` for anything but a tensor)
REQUIRES_GRAD: Callable[[Any], bool] = Tensor.requires_grad.__get__  # type: ignore[attr-defined]


def recording(*trees: PyTree) -> bool:
    """Whether autograd (or a ``torch.func`` transform) may record ops on these trees."""
    return leaves_recording(*map(tree_leaves, trees))


def leaves_recording(*leaf_lists: list[Any]) -> bool:
    """:func:`recording` of trees already flattened (one list of leaves each)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    if not torch.is_grad_enabled():
        return False
    for leaves in leaf_lists:
        try:  # every leaf a tensor (params, gradients): one C loop
            if any(map(REQUIRES_GRAD, leaves)):
                return True
        except TypeError:  # a state with a count or a hyperparameter among its leaves
            if any(map(REQUIRES_GRAD, [x for x in leaves if isinstance(x, Tensor)])):
                return True
    return False
