"""optax's adaptive scalings that torch.optim lacks, with optax's names, defaults and maths.

``scale_by_lion``, ``scale_by_amsgrad``, ``scale_by_belief``, ``scale_by_yogi``,
``scale_by_adan`` and the optax flavour of Adam used by
``nadamw`` and ``lamb`` (``eps_root`` and Nesterov momentum). Moments follow optax's
``update_moment`` (``(1 - decay) * g**order + decay * m``) and ``bias_correction``
(``m / (1 - decay**t)``); counts are kept per param (0-d tensors), so a param whose update is
``None`` keeps its moments and its count.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import debias, moment, store
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._transforms.adam import ScaleByAdamState
from functional_optim._tree import (
    PyTree,
    tree_flatten,
    tree_full_like,
    tree_zeros_like,
)

__all__ = [
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByYogiState",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_belief",
    "scale_by_lion",
    "scale_by_optax_adam",
    "scale_by_yogi",
]

Scalar = float | Tensor


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`: step counts and the momentum ``mu``."""

    count: PyTree
    mu: PyTree


class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_amsgrad` (optax's): counts, moments, max of ``nu_hat``."""

    count: PyTree
    mu: PyTree
    nu: PyTree
    nu_max: PyTree


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


def _zeros(params: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Zeros like ``params`` (in ``dtype`` when given: optax's ``mu_dtype``)."""
    zeros = tree_zeros_like(params)
    if dtype is None:
        return zeros
    leaves, spec = tree_flatten(zeros)
    return spec.unflatten([None if z is None else z.to(dtype) for z in leaves])


def _keep(buf: Tensor, new: Tensor, inplace: bool) -> Tensor:
    """Store ``new`` in ``buf``'s dtype (the output uses ``new`` itself, as optax does)."""
    return store(buf, new if new.dtype == buf.dtype else new.to(buf.dtype), inplace)


def _nesterov_mu_hat(mu: Tensor, g: Tensor, b1: Scalar, count: Tensor) -> Tensor:
    """Dozat's Nesterov estimate as optax forms it: ``b1 * m / (1 - b1**(t+1))
    + (1 - b1) * g / (1 - b1**t)``."""
    return b1 * debias(mu, b1, count + 1) + (1 - b1) * debias(g, b1, count)


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
            _ops.zero_counts(params), _zeros(params, mu_dtype), tree_zeros_like(params), None
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor, _: None) -> tuple[object, ...]:
            new_mu, new_nu = moment(g, mu, b1), moment(g, nu, b2, 2)
            count = _ops.increment(count, inplace)
            if nesterov:
                mu_hat = _nesterov_mu_hat(new_mu, g, b1, count)
            else:
                mu_hat = debias(new_mu, b1, count)
            out = mu_hat / (torch.sqrt(debias(new_nu, b2, count) + eps_root) + eps)
            return out, count, _keep(mu, new_mu, inplace), store(nu, new_nu, inplace), None

        return _ops.map_state(updates, state, ScaleByAdamState, leaf, ("nu_max",))

    lists = leafwise_lists("scale_by_optax_adam", {}, update)
    return GradientTransformation(init, update, lists=lists)


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
        return ScaleByLionState(_ops.zero_counts(params), _zeros(params, mu_dtype))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor) -> tuple[Tensor, ...]:
            out = torch.sign((1 - b1) * g + b1 * mu)
            new_mu = moment(g, mu, b2)
            return out, _ops.increment(count, inplace), _keep(mu, new_mu, inplace)

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
        lists = ListTransform("scale_by_lion", {"b1": b1, "b2": b2}, apply, writes_updates=False)
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
            _ops.zero_counts(params), _zeros(params, mu_dtype), zeros(params), zeros(params)
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
            mu, nu = _keep(mu, new_mu, inplace), store(nu, new_nu, inplace)
            return out, count, mu, nu, store(nu_max, new_max, inplace)

        return _ops.map_state(updates, state, ScaleByAmsgradState, leaf)

    lists = leafwise_lists("scale_by_amsgrad", {}, update)
    return GradientTransformation(init, update, lists=lists)


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
                mu_hat = _nesterov_mu_hat(new_mu, g, b1, count)
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
