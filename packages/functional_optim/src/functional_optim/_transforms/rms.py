"""Second-moment scalings: ``scale_by_rms``, ``scale_by_adagrad``, ``scale_by_adadelta``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._tail_kernels import RMS_TAIL
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_full_like, tree_zeros_like

__all__ = [
    "ScaleByAdadeltaState",
    "ScaleByAdagradState",
    "ScaleByRmsState",
    "scale_by_adadelta",
    "scale_by_adagrad",
    "scale_by_rms",
]


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms`; torch's ``step``, ``square_avg``, ``grad_avg``
    (``mu`` is ``None`` unless centered)."""

    count: PyTree
    nu: PyTree
    mu: PyTree


class ScaleByAdagradState(NamedTuple):
    """State of :func:`scale_by_adagrad`; torch's ``step`` and ``sum``."""

    count: PyTree
    sum_of_squares: PyTree


class ScaleByAdadeltaState(NamedTuple):
    """State of :func:`scale_by_adadelta`; torch's ``step``, ``square_avg``, ``acc_delta``."""

    count: PyTree
    nu: PyTree
    acc_delta: PyTree


@transform_factory
def scale_by_rms(
    alpha: float = 0.99, eps: float = 1e-8, centered: bool = False
) -> GradientTransformation:
    """Divide updates by the root of their running mean square (RMSprop's ``g / avg``).

    ``v = alpha * v + (1 - alpha) * g**2``; centered: ``m = lerp(m, g, 1 - alpha)`` and
    ``avg = sqrt(v - m**2) + eps``, else ``avg = sqrt(v) + eps``. Op order of
    ``torch.optim.RMSprop(foreach=False)``; chain with :func:`trace` for its momentum.

    Args:
        alpha: smoothing constant.
        eps: added to the denominator.
        centered: normalise by the estimated variance.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByRmsState`.
    """

    def init(params: PyTree) -> ScaleByRmsState:
        mu = tree_zeros_like(params) if centered else None
        return ScaleByRmsState(_ops.zero_counts(params), tree_zeros_like(params), mu)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(
            g: Tensor, count: Tensor, nu: Tensor, mu: Tensor | None
        ) -> tuple[Tensor | None, ...]:
            count = _ops.increment(count, inplace)
            nu = _ops.addcmul(_ops.mul(nu, alpha, inplace), g, g, 1 - alpha, inplace)
            if centered:
                mu = _ops.lerp(mu, g, 1 - alpha, inplace)  # type: ignore[arg-type]
                avg = nu.addcmul(mu, mu, value=-1).sqrt()
            else:
                avg = nu.sqrt()
            return g.div(avg.add(eps)), count, nu, mu

        absent = () if centered else ("mu",)
        return _ops.map_state(updates, state, ScaleByRmsState, leaf, absent)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        nu = view.gather(state.nu)
        _ops.increment_counts(view.gather(state.count))
        torch._foreach_mul_(nu, alpha)
        torch._foreach_addcmul_(nu, updates, updates, value=1 - alpha)
        if centered:
            mu = view.gather(state.mu)
            torch._foreach_lerp_(mu, updates, 1 - alpha)
            avg = torch._foreach_addcmul(nu, mu, mu, value=-1)
            torch._foreach_sqrt_(avg)
        else:
            avg = torch._foreach_sqrt(nu)
        torch._foreach_add_(avg, eps)
        return list(torch._foreach_div(updates, avg)), state

    hyper = {"alpha": alpha, "eps": eps, "centered": centered}
    lists = ListTransform("scale_by_rms", hyper, apply, False, tail=RMS_TAIL)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def scale_by_adagrad(
    lr_decay: float = 0.0, eps: float = 1e-10, initial_accumulator_value: float = 0.0
) -> GradientTransformation:
    """Divide updates by the root of their running sum of squares (Adagrad).

    ``s += g**2``; output ``g / (sqrt(s) + eps) / (1 + (t - 1) * lr_decay)``, the op order of
    ``torch.optim.Adagrad(foreach=False)`` for dense gradients.

    Args:
        lr_decay: learning-rate decay per step.
        eps: added to the denominator.
        initial_accumulator_value: starting value of the sums.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdagradState`.
    """

    def init(params: PyTree) -> ScaleByAdagradState:
        sums = tree_full_like(params, initial_accumulator_value)
        return ScaleByAdagradState(_ops.zero_counts(params), sums)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, s: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            s = _ops.addcmul(s, g, g, 1.0, inplace)
            u = g.div(s.sqrt().add(eps))
            if lr_decay != 0:
                u = u.div(_ops.like(1 + (count.to(torch.float64) - 1) * lr_decay, u))
            return u, count, s

        return _ops.map_state(updates, state, ScaleByAdagradState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        counts, sums = view.gather(state.count), view.gather(state.sum_of_squares)
        _ops.increment_counts(counts)
        torch._foreach_addcmul_(sums, updates, updates, value=1.0)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, eps)
        out = list(torch._foreach_div(updates, std))
        if lr_decay != 0:
            torch._foreach_div_(out, _decay_factors(counts, out, lr_decay))
        return out, state

    hyper = {
        "lr_decay": lr_decay,
        "eps": eps,
        "initial_accumulator_value": initial_accumulator_value,
    }
    lists = ListTransform("scale_by_adagrad", hyper, apply, writes_updates=False)
    return GradientTransformation(init, update, lists=lists)


def _decay_factors(counts: list[Tensor], like: list[Tensor], lr_decay: float) -> list[float]:
    """Adagrad's ``1 + (t - 1) * lr_decay`` per leaf, computed as the per-leaf maths does
    (float64, then rounded to the leaf's dtype) once per distinct (count, dtype)."""
    cache: dict[tuple[float, torch.dtype], float] = {}
    out: list[float] = []
    for count, x in zip(counts, like, strict=True):
        key = (float(count), x.dtype)
        if key not in cache:
            cache[key] = float(_ops.like(1 + (count.to(torch.float64) - 1) * lr_decay, x))
        out.append(cache[key])
    return out


@transform_factory
def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Rescale updates by Adadelta's ratio of running RMS of deltas and of updates.

    Op order of ``torch.optim.Adadelta(foreach=False)``: ``v = rho*v + (1-rho)*g**2``,
    ``delta = sqrt(a + eps) / sqrt(v + eps) * g``, ``a = rho*a + (1-rho)*delta**2``; output
    ``delta``.

    Args:
        rho: decay of the running averages.
        eps: added inside the square roots.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdadeltaState`.
    """

    def init(params: PyTree) -> ScaleByAdadeltaState:
        return ScaleByAdadeltaState(
            _ops.zero_counts(params), tree_zeros_like(params), tree_zeros_like(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, nu: Tensor, acc: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            nu = _ops.addcmul(_ops.mul(nu, rho, inplace), g, g, 1 - rho, inplace)
            std = nu.add(eps).sqrt()
            delta = acc.add(eps).sqrt().div(std).mul(g)
            acc = _ops.addcmul(_ops.mul(acc, rho, inplace), delta, delta, 1 - rho, inplace)
            return delta, count, nu, acc

        return _ops.map_state(updates, state, ScaleByAdadeltaState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        nu, acc = view.gather(state.nu), view.gather(state.acc_delta)
        _ops.increment_counts(view.gather(state.count))
        torch._foreach_mul_(nu, rho)
        torch._foreach_addcmul_(nu, updates, updates, value=1 - rho)
        std = torch._foreach_add(nu, eps)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(acc, eps)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, updates)
        torch._foreach_mul_(acc, rho)
        torch._foreach_addcmul_(acc, delta, delta, value=1 - rho)
        return list(delta), state

    lists = ListTransform("scale_by_adadelta", {"rho": rho, "eps": eps}, apply, False)
    return GradientTransformation(init, update, lists=lists)
