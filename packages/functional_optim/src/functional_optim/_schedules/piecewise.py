"""Piecewise schedules: constant or interpolated between boundaries, and the one-cycle
schedules built on them."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from functional_optim._schedules._count import as_count
from functional_optim._transforms.scale import Schedule

__all__ = [
    "cosine_onecycle_schedule",
    "linear_onecycle_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
]


def _sorted_scales(boundaries_and_scales: Mapping[int, float] | None) -> list[tuple[int, float]]:
    items = sorted((boundaries_and_scales or {}).items())
    for boundary, factor in items:
        if factor < 0:
            raise ValueError(f"scale factors must be >= 0, got {factor} at boundary {boundary}")
    return items


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    """``init_value`` times every scale whose boundary is ``<= t``.

    Args:
        init_value: value before the first boundary.
        boundaries_and_scales: step -> non-negative factor applied from that step on.

    Returns:
        A schedule.

    Raises:
        ValueError: if a factor is negative.
    """
    items = _sorted_scales(boundaries_and_scales)

    def schedule(count: Tensor | int) -> Tensor:
        c = as_count(count)
        value = torch.full_like(c, init_value)
        for boundary, factor in items:
            value = torch.where(c < boundary, value, value * factor)
        return value

    return schedule


def piecewise_interpolate_schedule(
    interpolate_type: str,
    init_value: float,
    boundaries_and_scales: Mapping[int, float] | None = None,
) -> Schedule:
    """Interpolate (``"linear"`` or ``"cosine"``) between the values at the boundaries.

    The value at boundary ``b_i`` is ``init_value`` times the factors of all boundaries up to it;
    the last value holds from the last boundary on.

    Args:
        interpolate_type: ``"linear"`` or ``"cosine"``.
        init_value: value at step 0.
        boundaries_and_scales: step -> non-negative factor.

    Returns:
        A schedule.

    Raises:
        ValueError: for another ``interpolate_type`` or a negative factor.
    """
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError(f"interpolate_type must be 'linear' or 'cosine', got {interpolate_type!r}")
    items = _sorted_scales(boundaries_and_scales)
    bounds = [0] + [b for b, _ in items]
    values = [float(init_value)]
    for _, factor in items:
        values.append(values[-1] * factor)

    def interpolate(start: float, end: float, pct: Tensor) -> Tensor:
        if interpolate_type == "linear":
            return (end - start) * pct + start
        return end + (start - end) / 2.0 * (torch.cos(math.pi * pct) + 1)

    def schedule(count: Tensor | int) -> Tensor:
        c = as_count(count)
        value = torch.where(bounds[-1] <= c, torch.full_like(c, values[-1]), 0.0)
        for i in range(len(bounds) - 1):
            size = bounds[i + 1] - bounds[i]
            inside = (bounds[i] <= c) & (c < bounds[i + 1])
            pct = (c - bounds[i]) / size if size else torch.zeros_like(c)
            value = value + torch.where(inside, interpolate(values[i], values[i + 1], pct), 0.0)
        return value

    return schedule


def linear_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    pct_final: float = 0.85,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """One-cycle with linear ramps: up to ``peak_value`` over ``pct_start`` of the steps, back
    down until ``pct_final``, then to ``peak / div_factor / final_div_factor``.

    Args:
        transition_steps: total length (> 0).
        peak_value: the maximum.
        pct_start: fraction spent increasing.
        pct_final: fraction at which the value is back to its start.
        div_factor: start value is ``peak_value / div_factor``.
        final_div_factor: final value is the start value divided by it.

    Returns:
        A schedule.

    Raises:
        ValueError: if ``transition_steps <= 0``.
    """
    if transition_steps <= 0:
        raise ValueError(
            f"linear_onecycle_schedule needs transition_steps > 0, got {transition_steps}"
        )
    return piecewise_interpolate_schedule(
        "linear",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(pct_final * transition_steps): 1.0 / div_factor,
            transition_steps: 1.0 / final_div_factor,
        },
    )


def cosine_onecycle_schedule(
    transition_steps: int,
    peak_value: float,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
) -> Schedule:
    """One-cycle with cosine ramps: up to ``peak_value`` over ``pct_start`` of the steps, then
    down to ``peak / div_factor / final_div_factor``.

    Args:
        transition_steps: total length (> 0).
        peak_value: the maximum.
        pct_start: fraction spent increasing.
        div_factor: start value is ``peak_value / div_factor``.
        final_div_factor: final value is the start value divided by it.

    Returns:
        A schedule.

    Raises:
        ValueError: if ``transition_steps <= 0``.
    """
    if transition_steps <= 0:
        raise ValueError(
            f"cosine_onecycle_schedule needs transition_steps > 0, got {transition_steps}"
        )
    return piecewise_interpolate_schedule(
        "cosine",
        peak_value / div_factor,
        {
            int(pct_start * transition_steps): div_factor,
            int(transition_steps): 1.0 / (div_factor * final_div_factor),
        },
    )
