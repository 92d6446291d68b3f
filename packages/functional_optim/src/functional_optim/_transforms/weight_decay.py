"""``add_decayed_weights``: L2 weight decay added to the updates (torch's ``weight_decay``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from functional_optim._base import NO_OP, GradientTransformation, OptState, init_empty
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree

__all__ = ["add_decayed_weights"]


@transform_factory
def add_decayed_weights(weight_decay: float | Tensor = 0.0) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update (``grad.add(param, alpha=weight_decay)``).

    Placed before a scaling transform it is torch's coupled L2 decay (SGD, Adam, ...); placed
    after ``scale_by_adam`` and before ``scale_by_learning_rate`` it is AdamW's decoupled decay.

    Args:
        weight_decay: the decay factor; 0 makes the transform a no-op.

    Returns:
        A stateless ``GradientTransformation`` whose ``update`` needs ``params``.
    """

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        if not isinstance(weight_decay, Tensor) and weight_decay == 0:
            return updates, state
        _ops.require_params(params, "add_decayed_weights")
        leaves, spec, (ps,) = _ops.flat(updates, params)
        out: list[Tensor | None] = []
        for u, p in zip(leaves, ps, strict=True):
            if u is None:
                out.append(None)
            elif isinstance(weight_decay, Tensor):
                out.append(_ops.add(u, p * weight_decay, inplace))
            else:
                out.append(_ops.add(u, p, inplace, alpha=weight_decay))
        return spec.unflatten(out), state

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        if isinstance(weight_decay, Tensor):
            torch._foreach_add_(updates, [p * weight_decay for p in view.params])
        else:
            torch._foreach_add_(updates, view.params, alpha=weight_decay)
        return updates, state

    if not isinstance(weight_decay, Tensor) and weight_decay == 0:
        lists = NO_OP
    else:
        lists = ListTransform("add_decayed_weights", {"weight_decay": weight_decay}, apply)
    return GradientTransformation(init_empty, update, lists=lists)
