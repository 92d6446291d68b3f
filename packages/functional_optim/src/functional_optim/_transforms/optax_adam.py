"""optax's flavour of Adam and its AMSGrad, with optax's names, defaults and maths.

``scale_by_optax_adam`` (used by ``nadamw`` and ``lamb``: ``eps_root`` and Nesterov momentum)
and ``scale_by_amsgrad``. Moments follow optax's ``update_moment`` and ``bias_correction``
(:mod:`functional_optim._transforms._optax_moments`); counts are kept per param (0-d tensors),
so a param whose update is ``None`` keeps its moments and its count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import debias, moment, store
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._transforms._optax_moments import (
    Scalar,
    keep,
    moment_zeros,
    nesterov_mu_hat,
)
from functional_optim._transforms.adam import ScaleByAdamState
from functional_optim._tree import PyTree, tree_zeros_like

__all__ = ["ScaleByAmsgradState", "scale_by_amsgrad", "scale_by_optax_adam"]


class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_amsgrad` (optax's): counts, moments, max of ``nu_hat``."""

    count: PyTree
    mu: PyTree
    nu: PyTree
    nu_max: PyTree


@transform_factory
def scale_by_optax_adam(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """optax's ``scale_by_adam``: ``m_hat / (sqrt(v_hat + eps_root) + eps)`` (optionally Nesterov).

    ``fo.scale_by_adam`` keeps torch's op order; this one is optax's (used by ``nadamw`` and
    ``lamb``), with ``eps_root`` inside the root and Dozat's Nesterov momentum.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the root.
        eps_root: added inside the root (make it > 0 to differentiate through at zero).
        mu_dtype: dtype of the stored first moment (None: the params' dtype).
        nesterov: use Nesterov momentum (NAdam).

    Returns:
        A ``GradientTransformation`` with state ``ScaleByAdamState`` (``nu_max`` is None).
    """

    def init(params: PyTree) -> ScaleByAdamState:
        return ScaleByAdamState(
            _ops.zero_counts(params), moment_zeros(params, mu_dtype), tree_zeros_like(params), None
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor, _: None) -> tuple[object, ...]:
            new_mu, new_nu = moment(g, mu, b1), moment(g, nu, b2, 2)
            count = _ops.increment(count, inplace)
            if nesterov:
                mu_hat = nesterov_mu_hat(new_mu, g, b1, count)
            else:
                mu_hat = debias(new_mu, b1, count)
            out = mu_hat / (torch.sqrt(debias(new_nu, b2, count) + eps_root) + eps)
            return out, count, keep(mu, new_mu, inplace), store(nu, new_nu, inplace), None

        return _ops.map_state(updates, state, ScaleByAdamState, leaf, ("nu_max",))

    lists = leafwise_lists("scale_by_optax_adam", {}, update)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def scale_by_amsgrad(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """optax's AMSGrad: ``m_hat / (sqrt(nu_max + eps_root) + eps)``, ``nu_max = max(nu_max,
    v_hat)``.

    optax keeps the maximum of the bias-corrected ``v_hat``; ``torch.optim.Adam(amsgrad=True)``
    (``fo.adam(amsgrad=True)``) keeps the maximum of the raw ``v`` and divides it by the current
    correction, so the two differ while ``1 - b2**t`` changes.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator outside the root.
        eps_root: added inside the root.
        mu_dtype: dtype of the stored first moment (None: the params' dtype).

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAmsgradState`.
    """

    def init(params: PyTree) -> ScaleByAmsgradState:
        zeros = tree_zeros_like
        return ScaleByAmsgradState(
            _ops.zero_counts(params), moment_zeros(params, mu_dtype), zeros(params), zeros(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(
            g: Tensor, count: Tensor, mu: Tensor, nu: Tensor, nu_max: Tensor
        ) -> tuple[Tensor, ...]:
            new_mu, new_nu = moment(g, mu, b1), moment(g, nu, b2, 2)
            count = _ops.increment(count, inplace)
            new_max = torch.maximum(nu_max, debias(new_nu, b2, count))
            out = debias(new_mu, b1, count) / (torch.sqrt(new_max + eps_root) + eps)
            mu, nu = keep(mu, new_mu, inplace), store(nu, new_nu, inplace)
            return out, count, mu, nu, store(nu_max, new_max, inplace)

        return _ops.map_state(updates, state, ScaleByAmsgradState, leaf)

    lists = leafwise_lists("scale_by_amsgrad", {}, update)
    return GradientTransformation(init, update, lists=lists)
