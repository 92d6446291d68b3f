"""Schedules that follow one curve from ``init_value``: constant, linear, polynomial,
exponential and cosine decay."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from functional_optim._schedules._count import as_count
from functional_optim._transforms.scale import Schedule

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "exponential_decay",
    "linear_schedule",
    "polynomial_schedule",
]


def constant_schedule(value: float) -> Schedule:
    """Return a schedule that is ``value`` at every step.

    Args:
        value: the constant.

    Returns:
        A schedule.
    """

    def schedule(count: Tensor | int) -> Tensor:
        return torch.full((), value, dtype=torch.float64, device=as_count(count).device)

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Go linearly from ``init_value`` to ``end_value`` over ``transition_steps`` steps.

    The value is ``init_value`` before ``transition_begin`` and ``end_value`` from
    ``transition_begin + transition_steps`` on.

    Args:
        init_value: starting value.
        end_value: final value.
        transition_steps: length of the ramp; ``<= 0`` gives a constant ``init_value``.
        transition_begin: steps to wait before the ramp.

    Returns:
        A schedule.

    Raises:
        ValueError: if ``transition_begin`` is negative.
    """
    if transition_begin < 0:
        raise ValueError(f"transition_begin must be >= 0, got {transition_begin}")
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count: Tensor | int) -> Tensor:
        c = as_count(count)
        frac = torch.clamp(c - transition_begin, 0, transition_steps) / transition_steps
        return init_value + frac * (end_value - init_value)

    return schedule


def polynomial_schedule(
    init_value: float,
    end_value: float,
    power: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    """``(init - end) * (1 - s / transition_steps) ** power + end``, ``s`` clipped to the ramp.

    Args:
        init_value: value before and at ``transition_begin``.
        end_value: value from ``transition_begin + transition_steps`` on.
        power: exponent of the polynomial.
        transition_steps: length of the ramp (> 0).
        transition_begin: steps before the ramp (>= 0).

    Returns:
        A schedule.

    Raises:
        ValueError: if ``transition_steps <= 0`` or ``transition_begin < 0``.
    """
    if transition_steps <= 0:
        raise ValueError(f"polynomial_schedule needs transition_steps > 0, got {transition_steps}")
    if transition_begin < 0:
        raise ValueError(f"transition_begin must be >= 0, got {transition_begin}")

    def schedule(count: Tensor | int) -> Tensor:
        steps = torch.clamp(as_count(count) - transition_begin, 0, transition_steps)
        frac = 1 - steps / transition_steps
        return (init_value - end_value) * frac**power + end_value

    return schedule


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """``init_value * decay_rate ** ((t - transition_begin) / transition_steps)``.

    The value is ``init_value`` up to ``transition_begin``; ``staircase`` floors the exponent;
    ``end_value`` bounds the value (below when ``decay_rate < 1``, above otherwise).

    Args:
        init_value: starting value.
        transition_steps: steps per factor of ``decay_rate`` (> 0).
        decay_rate: the decay factor (non-zero).
        transition_begin: steps before the decay starts (>= 0).
        staircase: decay in whole steps of ``transition_steps``.
        end_value: bound of the value, or None.

    Returns:
        A schedule.

    Raises:
        ValueError: if ``transition_steps <= 0``, ``decay_rate == 0`` or
            ``transition_begin < 0`` (optax warns and falls back; an error names the mistake).
    """
    if transition_steps <= 0:
        raise ValueError(f"exponential_decay needs transition_steps > 0, got {transition_steps}")
    if decay_rate == 0:
        raise ValueError("exponential_decay needs a non-zero decay_rate")
    if transition_begin < 0:
        raise ValueError(f"transition_begin must be >= 0, got {transition_begin}")

    def schedule(count: Tensor | int) -> Tensor:
        elapsed = as_count(count) - transition_begin
        power = elapsed / transition_steps
        if staircase:
            power = torch.floor(power)
        value = torch.where(elapsed <= 0, init_value, init_value * decay_rate**power)
        if end_value is not None:
            bound = torch.full_like(value, end_value)
            value = torch.maximum(value, bound) if decay_rate < 1 else torch.minimum(value, bound)
        return value

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps`` steps.

    ``value(t) = init_value * ((1 - alpha) * (0.5 * (1 + cos(pi * min(t, T) / T))) ** exponent
    + alpha)``.

    Args:
        init_value: starting value.
        decay_steps: ``T``, the number of steps to decay over (> 0).
        alpha: final value as a fraction of ``init_value``.
        exponent: power of the cosine factor (optax's ``exponent``; 1 is plain cosine decay).

    Returns:
        A schedule.

    Raises:
        ValueError: if ``decay_steps`` is not positive.
    """
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")

    def schedule(count: Tensor | int) -> Tensor:
        c = torch.clamp(as_count(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * c / decay_steps))
        if exponent != 1.0:
            cosine = cosine**exponent
        return init_value * ((1 - alpha) * cosine + alpha)

    return schedule
