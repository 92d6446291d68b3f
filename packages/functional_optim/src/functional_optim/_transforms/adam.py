"""Adam-family scalings: ``scale_by_adam`` (with AMSGrad) and ``scale_by_adamax``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform, with_active_leaves
from functional_optim._recipes import transform_factory
from functional_optim._tail_kernels import ADAM_TAIL, ADAMAX_TAIL
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_zeros_like

__all__ = ["ScaleByAdamState", "ScaleByAdamaxState", "scale_by_adam", "scale_by_adamax"]


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`; torch's ``step``, ``exp_avg``, ``exp_avg_sq``,
    ``max_exp_avg_sq``. ``nu_max`` is ``None`` without AMSGrad."""

    count: PyTree
    mu: PyTree
    nu: PyTree
    nu_max: PyTree


class ScaleByAdamaxState(NamedTuple):
    """State of :func:`scale_by_adamax`; torch's ``step``, ``exp_avg``, ``exp_inf``."""

    count: PyTree
    mu: PyTree
    nu: PyTree


@transform_factory
def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, amsgrad: bool = False
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments: ``m_hat / (sqrt(v_hat) + eps)``.

    Op order follows ``torch.optim.Adam(foreach=False)``: ``m.lerp_(g, 1 - b1)``,
    ``v.mul_(b2).addcmul_(g, g, value=1 - b2)``, ``denom = sqrt(v) / sqrt(1 - b2**t) + eps``,
    output ``m / (1 - b1**t) / denom`` (bias corrections in float64). Step counts are per param
    0-d tensors, so a param whose update is ``None`` keeps its count, as in torch.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.
        amsgrad: normalise by the running maximum of the second moment.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdamState`.
    """

    def init(params: PyTree) -> ScaleByAdamState:
        nu_max = tree_zeros_like(params) if amsgrad else None
        return ScaleByAdamState(
            _ops.zero_counts(params), tree_zeros_like(params), tree_zeros_like(params), nu_max
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(
            g: Tensor, count: Tensor, mu: Tensor, nu: Tensor, nu_max: Tensor | None
        ) -> tuple[Tensor | None, ...]:
            count = _ops.increment(count, inplace)
            mu = _ops.lerp(mu, g, 1 - b1, inplace)
            nu = _ops.addcmul(_ops.mul(nu, b2, inplace), g, g, 1 - b2, inplace)
            new_nu = nu
            bc1 = _ops.bias_correction(b1, count)
            bc2_sqrt = _ops.bias_correction(b2, count) ** 0.5
            if amsgrad:
                nu_max = nu = _ops.maximum(nu_max, nu, inplace)  # type: ignore[arg-type]
            denom = (nu.sqrt() / _ops.like(bc2_sqrt, nu)).add(eps)
            return mu.div(_ops.like(bc1, mu)).div(denom), count, mu, new_nu, nu_max

        absent = () if amsgrad else ("nu_max",)
        return _ops.map_state(updates, state, ScaleByAdamState, leaf, absent)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        counts, mu, nu = view.gather(state.count), view.gather(state.mu), view.gather(state.nu)
        _ops.increment_counts(counts)
        torch._foreach_lerp_(mu, updates, 1 - b1)
        torch._foreach_mul_(nu, b2)
        torch._foreach_addcmul_(nu, updates, updates, value=1 - b2)
        second = nu
        if amsgrad:
            second = view.gather(state.nu_max)
            torch._foreach_maximum_(second, nu)
        return _scaled(counts, mu, second, b1, b2, eps), state

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        # ``apply``'s maths with out-of-place first ops: no copy of the state beforehand.
        if not updates:
            return updates, state
        counts = list(torch._foreach_add(view.gather(state.count), 1))
        mu = list(torch._foreach_lerp(view.gather(state.mu), updates, 1 - b1))
        nu = list(torch._foreach_mul(view.gather(state.nu), b2))
        torch._foreach_addcmul_(nu, updates, updates, value=1 - b2)
        second, nu_max = nu, state.nu_max
        if amsgrad:
            second = list(torch._foreach_maximum(view.gather(state.nu_max), nu))
            nu_max = with_active_leaves(view, state.nu_max, second)
        out = _scaled(counts, mu, second, b1, b2, eps)
        new = ScaleByAdamState(
            with_active_leaves(view, state.count, counts),
            with_active_leaves(view, state.mu, mu),
            with_active_leaves(view, state.nu, nu),
            nu_max,
        )
        return out, new

    hyper = {"b1": b1, "b2": b2, "eps": eps, "amsgrad": amsgrad}
    lists = ListTransform("scale_by_adam", hyper, apply, False, apply_pure, tail=ADAM_TAIL)
    return GradientTransformation(init, update, lists=lists)


def _scaled(
    counts: list[Tensor], mu: list[Tensor], second: list[Tensor], b1: float, b2: float, eps: float
) -> list[Tensor]:
    """``mu / bc1 / (sqrt(second) / sqrt(bc2) + eps)`` as new tensors, in the per-leaf order."""
    bc1, bc2_sqrt = _bias_corrections(counts, mu, b1, b2)
    denom = torch._foreach_sqrt(second)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    out = torch._foreach_div(mu, bc1)
    torch._foreach_div_(out, denom)
    return list(out)


def _bias_corrections(
    counts: list[Tensor], like: list[Tensor], b1: float, b2: float
) -> tuple[list[float], list[float]]:
    """``1 - b1**t`` and ``sqrt(1 - b2**t)`` per leaf, computed as the per-leaf maths does
    (float64, then rounded to the leaf's dtype) once per distinct (count, dtype)."""
    cache: dict[tuple[float, torch.dtype], tuple[float, float]] = {}
    bc1: list[float] = []
    bc2: list[float] = []
    for count, x in zip(counts, like, strict=True):
        key = (float(count), x.dtype)
        if key not in cache:
            first = _ops.like(_ops.bias_correction(b1, count), x)
            second = _ops.like(_ops.bias_correction(b2, count) ** 0.5, x)
            cache[key] = (float(first), float(second))
        a, b = cache[key]
        bc1.append(a)
        bc2.append(b)
    return bc1, bc2


@transform_factory
def scale_by_adamax(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformation:
    """Rescale updates by Adamax: ``m / (1 - b1**t) / u`` with ``u = max(b2 * u, |g| + eps)``.

    Op order follows ``torch.optim.Adamax(foreach=False)``.

    Args:
        b1: decay of the first moment.
        b2: decay of the infinity norm.
        eps: added to ``|g|``.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdamaxState`.
    """

    def init(params: PyTree) -> ScaleByAdamaxState:
        return ScaleByAdamaxState(
            _ops.zero_counts(params), tree_zeros_like(params), tree_zeros_like(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            mu = _ops.lerp(mu, g, 1 - b1, inplace)
            nu = _ops.maximum(_ops.mul(nu, b2, inplace), g.abs().add(eps), inplace)
            out = mu.div(_ops.like(_ops.bias_correction(b1, count), mu)).div(nu)
            return out, count, mu, nu

        return _ops.map_state(updates, state, ScaleByAdamaxState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        counts, mu, nu = view.gather(state.count), view.gather(state.mu), view.gather(state.nu)
        _ops.increment_counts(counts)
        torch._foreach_lerp_(mu, updates, 1 - b1)
        torch._foreach_mul_(nu, b2)
        bound = torch._foreach_abs(updates)
        torch._foreach_add_(bound, eps)
        torch._foreach_maximum_(nu, bound)
        bc1, _ = _bias_corrections(counts, mu, b1, b2)
        out = torch._foreach_div(mu, bc1)
        torch._foreach_div_(out, nu)
        return list(out), state

    hyper = {"b1": b1, "b2": b2, "eps": eps}
    lists = ListTransform("scale_by_adamax", hyper, apply, False, tail=ADAMAX_TAIL)
    return GradientTransformation(init, update, lists=lists)
