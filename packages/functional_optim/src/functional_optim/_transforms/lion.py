"""optax's Lion (``scale_by_lion``), which torch.optim lacks: the sign of a momentum mix.

Counts are kept per param (0-d tensors), so a param whose update is ``None`` keeps its momentum
and its count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._tail_kernels import LION_TAIL
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import moment
from functional_optim._transforms._optax_moments import Scalar, keep, moment_zeros
from functional_optim._tree import PyTree

__all__ = ["ScaleByLionState", "scale_by_lion"]


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`: step counts and the momentum ``mu``."""

    count: PyTree
    mu: PyTree


@transform_factory
def scale_by_lion(
    b1: Scalar = 0.9, b2: Scalar = 0.99, mu_dtype: torch.dtype | None = None
) -> GradientTransformation:
    """Lion: output ``sign((1 - b1) * g + b1 * mu)``, then ``mu = b2 * mu + (1 - b2) * g``.

    Args:
        b1: rate combining the momentum and the current update.
        b2: decay of the momentum.
        mu_dtype: dtype of the stored momentum (None: the params' dtype).

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByLionState`.
    """

    def init(params: PyTree) -> ScaleByLionState:
        return ScaleByLionState(_ops.zero_counts(params), moment_zeros(params, mu_dtype))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor) -> tuple[Tensor, ...]:
            out = torch.sign((1 - b1) * g + b1 * mu)
            new_mu = moment(g, mu, b2)
            return out, _ops.increment(count, inplace), keep(mu, new_mu, inplace)

        return _ops.map_state(updates, state, ScaleByLionState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        mu = view.gather(state.mu)
        _ops.increment_counts(view.gather(state.count))
        out = list(torch._foreach_mul(updates, 1 - b1))
        torch._foreach_add_(out, torch._foreach_mul(mu, b1))
        torch._foreach_sign_(out)
        torch._foreach_mul_(mu, b2)  # b2 * mu + (1 - b2) * g: the same sum as moment()
        torch._foreach_add_(mu, torch._foreach_mul(updates, 1 - b2))
        return out, state

    same_dtype = mu_dtype is None and not isinstance(b1, Tensor) and not isinstance(b2, Tensor)
    lists = None
    if same_dtype:
        hyper = {"b1": b1, "b2": b2}
        lists = ListTransform("scale_by_lion", hyper, apply, False, tail=LION_TAIL)
    return GradientTransformation(init, update, lists=lists)
