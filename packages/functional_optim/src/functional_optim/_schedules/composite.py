"""Schedules made of other schedules: :func:`join_schedules`, the warmups and SGDR."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._schedules._count import as_count
from functional_optim._schedules.decay import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
)
from functional_optim._transforms.scale import Schedule

__all__ = [
    "join_schedules",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules[i + 1]`` from ``boundaries[i]`` on, with the count restarted at 0.

    Args:
        schedules: the schedules, in order.
        boundaries: one step fewer than ``schedules``: where each next schedule starts.

    Returns:
        A schedule.

    Raises:
        ValueError: if ``len(boundaries) != len(schedules) - 1``.
    """
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules needs len(boundaries) == len(schedules) - 1, got "
            f"{len(boundaries)} boundaries for {len(schedules)} schedules"
        )

    def schedule(count: Tensor | int) -> Tensor:
        c = as_count(count)
        value: Tensor = torch.as_tensor(schedules[0](c), dtype=torch.float64)
        for boundary, nxt in zip(boundaries, schedules[1:], strict=True):
            value = torch.where(
                c < boundary, value, torch.as_tensor(nxt(c - boundary), dtype=torch.float64)
            )
        return value

    return schedule


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then constant.

    Args:
        init_value: value at step 0.
        peak_value: value from ``warmup_steps`` on.
        warmup_steps: length of the warmup.

    Returns:
        A schedule.
    """
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps), constant_schedule(peak_value)],
        [warmup_steps],
    )


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    Args:
        init_value: value at step 0.
        peak_value: value reached after ``warmup_steps``.
        warmup_steps: length of the warmup.
        decay_steps: total length of the schedule, warmup included (> ``warmup_steps``).
        end_value: value from ``decay_steps`` on.
        exponent: power of the cosine factor (see :func:`cosine_decay_schedule`).

    Returns:
        A schedule.

    Raises:
        ValueError: if ``decay_steps <= warmup_steps`` or ``warmup_steps < 0``.
    """
    if warmup_steps < 0 or decay_steps <= warmup_steps:
        raise ValueError(
            "need 0 <= warmup_steps < decay_steps, got "
            f"warmup_steps={warmup_steps}, decay_steps={decay_steps}"
        )
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    span = decay_steps - warmup_steps
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, span, alpha, exponent)

    def schedule(count: Tensor | int) -> Tensor:
        c = as_count(count)
        return torch.where(c < warmup_steps, warmup(c), decay(c - warmup_steps))

    return schedule


def warmup_exponential_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Linear warmup to ``peak_value``, then :func:`exponential_decay` from it.

    Args:
        init_value: value at step 0.
        peak_value: value at the end of the warmup.
        warmup_steps: length of the warmup.
        transition_steps: see :func:`exponential_decay`.
        decay_rate: see :func:`exponential_decay`.
        transition_begin: see :func:`exponential_decay`.
        staircase: see :func:`exponential_decay`.
        end_value: see :func:`exponential_decay`.

    Returns:
        A schedule.
    """
    decay = exponential_decay(
        peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value
    )
    return join_schedules(
        [linear_schedule(init_value, peak_value, warmup_steps), decay], [warmup_steps]
    )


def sgdr_schedule(cosine_kwargs: Iterable[Mapping[str, Any]]) -> Schedule:
    """SGD with warm restarts: :func:`warmup_cosine_decay_schedule` cycles, one after another.

    Args:
        cosine_kwargs: the keyword arguments of each cycle; a cycle lasts its ``decay_steps``.

    Returns:
        A schedule.
    """
    schedules, boundaries, step = [], [], 0
    for kwargs in cosine_kwargs:
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += int(kwargs["decay_steps"])
        boundaries.append(step)
    if not schedules:
        raise ValueError("sgdr_schedule needs at least one cycle")
    return join_schedules(schedules, boundaries[:-1])
