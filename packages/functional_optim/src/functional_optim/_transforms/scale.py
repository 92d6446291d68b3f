"""Scaling transforms: ``scale``, ``scale_by_schedule``, ``scale_by_learning_rate``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, init_empty
from functional_optim._lists import LeafView, ListTransform, foreach_scale
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_flatten

__all__ = [
    "Schedule",
    "ScaleByScheduleState",
    "scale",
    "scale_by_learning_rate",
    "scale_by_schedule",
]

#: Maps a step count (a 0-d integer tensor, or an int) to a value (float or 0-d tensor).
Schedule = Callable[[Tensor | int], float | Tensor]


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`: how many updates were made (a 0-d int64 tensor)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax


def _scale_leaves(updates: PyTree, factor: float | Tensor, inplace: bool) -> PyTree:
    leaves, spec = tree_flatten(updates)
    out = [None if u is None else _ops.mul(u, _ops.like(factor, u), inplace) for u in leaves]
    return spec.unflatten(out)


@transform_factory
def scale(step_size: float | Tensor) -> GradientTransformation:
    """Multiply updates by a constant.

    Args:
        step_size: the factor (a 0-d tensor keeps it differentiable).

    Returns:
        A stateless ``GradientTransformation``.
    """

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        return _scale_leaves(updates, step_size, inplace), state

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        del view
        foreach_scale(updates, step_size)
        return updates, state

    lists = ListTransform("scale", {"step_size": step_size}, apply)
    return GradientTransformation(init_empty, update, lists=lists)


@transform_factory
def scale_by_schedule(schedule: Schedule) -> GradientTransformation:
    """Multiply updates by ``schedule(count)``, ``count`` being the number of earlier updates.

    Args:
        schedule: maps the step count (0 on the first update) to a factor.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByScheduleState`.
    """

    def init(params: PyTree) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(torch.zeros((), dtype=torch.int64))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        factor = schedule(state.count)
        out = _scale_leaves(updates, factor, inplace)
        return out, ScaleByScheduleState(_ops.increment(state.count, inplace))

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        del view
        foreach_scale(updates, schedule(state.count))
        state.count.add_(1)
        return updates, state

    lists = ListTransform("scale_by_schedule", {"schedule": schedule}, apply)
    return GradientTransformation(init, update, lists=lists)


def _negate(schedule: Schedule) -> Schedule:
    def negated(count: Tensor | int) -> float | Tensor:
        return -schedule(count)

    return negated


@transform_factory
def scale_by_learning_rate(
    learning_rate: float | Tensor | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (a descent step), or ``+`` with ``flip_sign=False``.

    Args:
        learning_rate: a float, a 0-d tensor (differentiable, e.g. for meta-learning) or a
            schedule mapping the step count to the learning rate.
        flip_sign: negate, so that ``apply_updates`` descends.

    Returns:
        ``scale(...)`` for a constant, ``scale_by_schedule(...)`` for a schedule.
    """
    if callable(learning_rate):
        return scale_by_schedule(_negate(learning_rate) if flip_sign else learning_rate)
    return scale(-learning_rate if flip_sign else learning_rate)
