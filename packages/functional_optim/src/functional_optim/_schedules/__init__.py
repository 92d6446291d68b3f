"""Schedules: functions from a step count to a value (for ``scale_by_learning_rate``).

A schedule takes the count as a 0-d integer tensor (what ``scale_by_schedule`` passes; no
``.item()``, so the pure path stays traceable) or a Python int, and returns a 0-d float64
tensor. Formulas and argument names follow optax's schedules of the same names.

* :mod:`~functional_optim._schedules.decay`: one curve from ``init_value`` (constant, linear,
  polynomial, exponential, cosine);
* :mod:`~functional_optim._schedules.piecewise`: piecewise constant or interpolated, one-cycle;
* :mod:`~functional_optim._schedules.composite`: joins of schedules (warmups, SGDR).
"""

from functional_optim._schedules.composite import (
    join_schedules,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from functional_optim._schedules.decay import (
    constant_schedule,
    cosine_decay_schedule,
    exponential_decay,
    linear_schedule,
    polynomial_schedule,
)
from functional_optim._schedules.piecewise import (
    cosine_onecycle_schedule,
    linear_onecycle_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
)

__all__ = [
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "exponential_decay",
    "join_schedules",
    "linear_onecycle_schedule",
    "linear_schedule",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "sgdr_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
]
