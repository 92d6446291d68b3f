"""``scale_by_rprop``: resilient backpropagation's sign-based, per-element step sizes."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_full_like, tree_zeros_like

__all__ = ["ScaleByRpropState", "scale_by_rprop"]


class ScaleByRpropState(NamedTuple):
    """State of :func:`scale_by_rprop`; torch's ``step``, ``prev``, ``step_size``."""

    count: PyTree
    prev: PyTree
    step_size: PyTree


@transform_factory
def scale_by_rprop(
    init_step_size: float,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50.0),
) -> GradientTransformation:
    """Rprop: output ``sign(g') * step_size`` with per-element adaptive step sizes.

    Where ``g * prev`` is positive the step size grows by ``etas[1]``, where negative it shrinks
    by ``etas[0]`` and ``g'`` is zeroed (``g' = g`` elsewhere); sizes are clamped to
    ``step_sizes`` and ``prev = g'``. Follows ``torch.optim.Rprop(foreach=False)``; chain with
    ``scale(-1.0)`` for a descent step. The step sizes start at ``init_step_size`` (torch's
    ``lr``) when the state is created.

    Args:
        init_step_size: initial step size of every element.
        etas: ``(etaminus, etaplus)`` multiplicative decrease and increase factors.
        step_sizes: ``(min, max)`` allowed step sizes.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByRpropState`.
    """
    etaminus, etaplus = etas
    size_min, size_max = step_sizes

    def init(params: PyTree) -> ScaleByRpropState:
        return ScaleByRpropState(
            _ops.zero_counts(params),
            tree_zeros_like(params),
            tree_full_like(params, float(init_step_size)),
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, prev: Tensor, size: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            sign = g.mul(prev).sign()
            factor = torch.where(
                sign > 0, etaplus, torch.where(sign < 0, etaminus, torch.where(sign == 0, 1, sign))
            )
            size = _ops.mul(size, factor, inplace)
            size = size.clamp_(size_min, size_max) if inplace else size.clamp(size_min, size_max)
            g = torch.where(factor == etaminus, 0, g)
            prev = prev.copy_(g) if inplace else g
            return g.sign().mul(size), count, prev, size

        return _ops.map_state(updates, state, ScaleByRpropState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        prev, sizes = view.gather(state.prev), view.gather(state.step_size)
        _ops.increment_counts(view.gather(state.count))
        signs = torch._foreach_mul(updates, prev)
        torch._foreach_sign_(signs)
        factors = [
            torch.where(s > 0, etaplus, torch.where(s < 0, etaminus, torch.where(s == 0, 1, s)))
            for s in signs
        ]
        torch._foreach_mul_(sizes, factors)
        torch._foreach_clamp_min_(sizes, size_min)
        torch._foreach_clamp_max_(sizes, size_max)
        kept = [torch.where(f == etaminus, 0, g) for f, g in zip(factors, updates, strict=True)]
        torch._foreach_copy_(prev, kept)
        out = torch._foreach_sign(kept)
        torch._foreach_mul_(out, sizes)
        return list(out), state

    hyper = {"init_step_size": init_step_size, "etas": etas, "step_sizes": step_sizes}
    lists = ListTransform("scale_by_rprop", hyper, apply, writes_updates=False)
    return GradientTransformation(init, update, lists=lists)
