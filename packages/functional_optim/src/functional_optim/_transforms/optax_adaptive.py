"""optax's adaptive scalings with a second moment of their own, which torch.optim lacks.

``scale_by_belief`` (AdaBelief), ``scale_by_yogi`` and ``scale_by_adan``, with optax's names,
defaults and maths. Moments follow optax's ``update_moment`` (``(1 - decay) * g**order + decay *
m``) and ``bias_correction`` (``m / (1 - decay**t)``); counts are kept per param (0-d tensors),
so a param whose update is ``None`` keeps its moments and its count. optax's flavour of Adam and
its AMSGrad are in :mod:`functional_optim._transforms.optax_adam`, Lion in
:mod:`functional_optim._transforms.lion`.
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
from functional_optim._transforms._optax_moments import Scalar, nesterov_mu_hat
from functional_optim._tree import PyTree, tree_full_like, tree_zeros_like

__all__ = [
    "ScaleByAdanState",
    "ScaleByBeliefState",
    "ScaleByYogiState",
    "scale_by_adan",
    "scale_by_belief",
    "scale_by_yogi",
]


class ScaleByBeliefState(NamedTuple):
    """State of :func:`scale_by_belief`: counts, first moment, second central moment."""

    count: PyTree
    mu: PyTree
    nu: PyTree


class ScaleByYogiState(NamedTuple):
    """State of :func:`scale_by_yogi`: counts and the two moments."""

    count: PyTree
    mu: PyTree
    nu: PyTree


class ScaleByAdanState(NamedTuple):
    """State of :func:`scale_by_adan` (optax's field names): moments ``m``, ``v``, ``n``, the
    previous update ``g`` and the counts ``t``."""

    m: PyTree
    v: PyTree
    n: PyTree
    g: PyTree
    t: PyTree


@transform_factory
def scale_by_belief(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-16,
    eps_root: Scalar = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief: Adam whose second moment tracks ``(g - mu)**2`` (``mu`` already updated), plus
    ``eps_root`` added to the stored moment, as optax does.

    Args:
        b1: decay of the first moment.
        b2: decay of the second central moment.
        eps: added to the denominator outside the root.
        eps_root: added to the second moment at every step.
        nesterov: use Nesterov momentum.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByBeliefState`.
    """

    def init(params: PyTree) -> ScaleByBeliefState:
        zeros = tree_zeros_like
        return ScaleByBeliefState(_ops.zero_counts(params), zeros(params), zeros(params))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            new_mu = moment(g, mu, b1)
            new_nu = moment(g - new_mu, nu, b2, 2) + eps_root
            count = _ops.increment(count, inplace)
            if nesterov:
                mu_hat = nesterov_mu_hat(new_mu, g, b1, count)
            else:
                mu_hat = debias(new_mu, b1, count)
            out = mu_hat / (torch.sqrt(debias(new_nu, b2, count)) + eps)
            return out, count, store(mu, new_mu, inplace), store(nu, new_nu, inplace)

        return _ops.map_state(updates, state, ScaleByBeliefState, leaf)

    lists = leafwise_lists("scale_by_belief", {}, update)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def scale_by_yogi(
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-3,
    eps_root: Scalar = 0.0,
    initial_accumulator_value: float = 1e-6,
) -> GradientTransformation:
    """Yogi: ``nu = nu - (1 - b2) * sign(nu - g**2) * g**2``, output
    ``m_hat / (sqrt(v_hat + eps_root) + eps)``; both moments start at
    ``initial_accumulator_value``.

    Args:
        b1: decay of the first moment.
        b2: rate of the additive second-moment change.
        eps: added to the denominator outside the root.
        eps_root: added inside the root.
        initial_accumulator_value: starting value of both moments.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByYogiState`.
    """

    def init(params: PyTree) -> ScaleByYogiState:
        value = float(initial_accumulator_value)
        return ScaleByYogiState(
            _ops.zero_counts(params), tree_full_like(params, value), tree_full_like(params, value)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            new_mu = moment(g, mu, b1)
            g2 = g * g
            new_nu = nu - (1 - b2) * torch.sign(nu - g2) * g2
            count = _ops.increment(count, inplace)
            denom = torch.sqrt(debias(new_nu, b2, count) + eps_root) + eps
            out = debias(new_mu, b1, count) / denom
            return out, count, store(mu, new_mu, inplace), store(nu, new_nu, inplace)

        return _ops.map_state(updates, state, ScaleByYogiState, leaf)

    lists = leafwise_lists("scale_by_yogi", {}, update)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def scale_by_adan(
    b1: Scalar = 0.98,
    b2: Scalar = 0.92,
    b3: Scalar = 0.99,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
) -> GradientTransformation:
    """Adan (Algorithm 1 of Xie et al. as optax writes it).

    ``d = g - g_prev`` (0 on the first step), ``m = ema(g, b1)``, ``v = ema(d, b2)``,
    ``n = ema((g + (1 - b2) d)**2, b3)``; output
    ``(m_hat + (1 - b2) v_hat) / (sqrt(n_hat + eps_root) + eps)``.

    Args:
        b1: decay of the gradient average.
        b2: decay of the gradient-difference average.
        b3: decay of the squared term.
        eps: added to the denominator outside the root.
        eps_root: added inside the root.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdanState`.
    """

    def init(params: PyTree) -> ScaleByAdanState:
        z = tree_zeros_like
        return ScaleByAdanState(
            z(params), z(params), z(params), z(params), _ops.zero_counts(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(
            g: Tensor, m: Tensor, v: Tensor, n: Tensor, prev: Tensor, t: Tensor
        ) -> tuple[Tensor, ...]:
            diff = torch.where(t == 0, torch.zeros_like(g), g - prev)
            new_m, new_v = moment(g, m, b1), moment(diff, v, b2)
            new_n = moment(g + (1 - b2) * diff, n, b3, 2)
            t = _ops.increment(t, inplace)
            num = debias(new_m, b1, t) + (1 - b2) * debias(new_v, b2, t)
            out = num / (torch.sqrt(debias(new_n, b3, t) + eps_root) + eps)
            m, v, n = store(m, new_m, inplace), store(v, new_v, inplace), store(n, new_n, inplace)
            return out, m, v, n, store(prev, g, inplace), t

        return _ops.map_state(updates, state, ScaleByAdanState, leaf)

    lists = leafwise_lists("scale_by_adan", {}, update)
    return GradientTransformation(init, update, lists=lists)
