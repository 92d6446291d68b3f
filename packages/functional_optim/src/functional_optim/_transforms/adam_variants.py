"""NAdam and RAdam scalings: ``scale_by_nadam`` and ``scale_by_radam``.

Both follow the op order of their ``torch.optim`` per-tensor (``foreach=False``) paths up to
where the learning rate is applied; chain with ``scale_by_learning_rate`` for a descent step.
The data-dependent branch of RAdam is a ``torch.where``, so the pure path stays traceable by
``torch.func``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = ["ScaleByNadamState", "ScaleByRadamState", "scale_by_nadam", "scale_by_radam"]


class ScaleByNadamState(NamedTuple):
    """State of :func:`scale_by_nadam`; torch's ``step``, ``mu_product``, ``exp_avg``,
    ``exp_avg_sq``."""

    count: PyTree
    mu_product: PyTree
    mu: PyTree
    nu: PyTree


class ScaleByRadamState(NamedTuple):
    """State of :func:`scale_by_radam`; torch's ``step``, ``exp_avg``, ``exp_avg_sq``."""

    count: PyTree
    mu: PyTree
    nu: PyTree


def _ones_like_counts(params: PyTree) -> PyTree:
    """One 0-d ``1`` per param in the step dtype (torch's initial ``mu_product``)."""
    leaves, spec = tree_flatten(params)
    dtype = _ops.scalar_dtype()
    ones = [None if p is None else torch.ones((), dtype=dtype, device=p.device) for p in leaves]
    return spec.unflatten(ones)


def _momentum_cache(b1: float, momentum_decay: float, step: Tensor) -> Tensor:
    """``b1 * (1 - 0.5 * 0.96 ** (step * momentum_decay))`` in float64."""
    return b1 * (1.0 - 0.5 * torch.pow(0.96, step * momentum_decay))


@transform_factory
def scale_by_nadam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, momentum_decay: float = 4e-3
) -> GradientTransformation:
    """Rescale updates by NAdam: Adam with Nesterov momentum and a decaying momentum schedule.

    With ``mu_t = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` and ``P_t = mu_1 ... mu_t``
    (kept in the state as ``mu_product``), the output is
    ``(1 - mu_t) / (1 - P_t) * g / d + mu_{t+1} / (1 - P_t * mu_{t+1}) * m / d`` with
    ``d = sqrt(v / (1 - b2**t)) + eps``, as ``torch.optim.NAdam(foreach=False)``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        momentum_decay: decay of the momentum coefficient.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByNadamState`.
    """

    def init(params: PyTree) -> ScaleByNadamState:
        return ScaleByNadamState(
            _ops.zero_counts(params),
            _ones_like_counts(params),
            tree_zeros_like(params),
            tree_zeros_like(params),
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(
            g: Tensor, count: Tensor, mu_product: Tensor, mu: Tensor, nu: Tensor
        ) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            step = count.to(torch.float64)
            bc2 = _ops.bias_correction(b2, count)
            mu_t = _momentum_cache(b1, momentum_decay, step)
            mu_next = _momentum_cache(b1, momentum_decay, step + 1)
            mu_product = _ops.mul(mu_product, _ops.like(mu_t, mu_product), inplace)
            mu = _ops.lerp(mu, g, 1 - b1, inplace)
            nu = _ops.addcmul(_ops.mul(nu, b2, inplace), g, g, 1 - b2, inplace)
            denom = nu.div(_ops.like(bc2, nu)).sqrt().add(eps)
            product = mu_product.to(torch.float64)
            coef_g = (1.0 - mu_t) / (1.0 - product)
            coef_m = mu_next / (1.0 - product * mu_next)
            out = g.mul(_ops.like(coef_g, g)).div(denom)
            out = out.add(mu.mul(_ops.like(coef_m, mu)).div(denom))
            return out, count, mu_product, mu, nu

        return _ops.map_state(updates, state, ScaleByNadamState, leaf)

    lists = leafwise_lists("scale_by_nadam", {}, update)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescale updates by RAdam: bias-corrected momentum, with the adaptive rate used only once
    its variance is tractable (``rho_t > 5``) and then rectified.

    Output ``m_hat * sqrt(1 - b2**t) / (sqrt(v) + eps) * r_t`` when ``rho_t > 5``, else
    ``m_hat``, as ``torch.optim.RAdam(foreach=False)``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByRadamState`.
    """
    rho_inf = 2 / (1 - b2) - 1

    def init(params: PyTree) -> ScaleByRadamState:
        return ScaleByRadamState(
            _ops.zero_counts(params), tree_zeros_like(params), tree_zeros_like(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            mu = _ops.lerp(mu, g, 1 - b1, inplace)
            nu = _ops.addcmul(_ops.mul(nu, b2, inplace), g, g, 1 - b2, inplace)
            step = count.to(torch.float64)
            bc1 = _ops.bias_correction(b1, count)
            bc2 = _ops.bias_correction(b2, count)
            corrected = mu.div(_ops.like(bc1, mu))
            rho_t = rho_inf - 2 * step * torch.pow(b2, step) / bc2
            tractable = rho_t > 5.0
            safe_rho = torch.where(tractable, rho_t, torch.full_like(rho_t, 6.0))
            rect = (
                (safe_rho - 4)
                * (safe_rho - 2)
                * rho_inf
                / ((rho_inf - 4) * (rho_inf - 2) * safe_rho)
            ).sqrt()
            adaptive = _ops.like(bc2.sqrt(), nu) / nu.sqrt().add(eps)
            rectified = corrected.mul(adaptive).mul(_ops.like(rect, corrected))
            return torch.where(tractable, rectified, corrected), count, mu, nu

        return _ops.map_state(updates, state, ScaleByRadamState, leaf)

    lists = leafwise_lists("scale_by_radam", {}, update)
    return GradientTransformation(init, update, lists=lists)
