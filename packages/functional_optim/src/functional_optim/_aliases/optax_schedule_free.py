"""optax-contrib's ``schedule_free_sgd`` and ``schedule_free_adamw``."""

from __future__ import annotations

import torch
from torch import Tensor

from functional_optim._aliases._optax_common import guarded
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms._leaf import check_range
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.scale import Schedule, scale_by_learning_rate
from functional_optim._transforms.schedule_free import scale_by_rms_debiased, schedule_free
from functional_optim._transforms.weight_decay import add_decayed_weights

__all__ = ["schedule_free_adamw", "schedule_free_sgd"]

Scalar = float | Tensor


def _lr(learning_rate: Scalar, warmup_steps: int | None) -> Scalar | Schedule:
    """The learning rate, or optax's ``warmup_constant_schedule(0, learning_rate, warmup_steps)``
    (written so that a tensor learning rate stays differentiable)."""
    check_range(learning_rate, "learning_rate", 0.0)
    if warmup_steps is None:
        return learning_rate
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    steps = warmup_steps

    def warmup(count: Tensor | int) -> Tensor:
        c = torch.as_tensor(count).to(torch.float64)
        frac = torch.clamp(c / steps, max=1.0) if steps > 0 else torch.ones_like(c)
        return frac * learning_rate

    return warmup


def _check_b1(b1: Scalar, weight_lr_power: Scalar) -> None:
    check_range(b1, "b1", 0.0, 1.0, low_open=True)
    check_range(weight_lr_power, "weight_lr_power", 0.0)


def _sgd(
    learning_rate: Scalar,
    warmup_steps: int | None,
    b1: Scalar,
    weight_decay: Scalar | None,
    weight_lr_power: Scalar,
) -> GradientTransformation:
    lr = _lr(learning_rate, warmup_steps)
    _check_b1(b1, weight_lr_power)
    base = scale_by_learning_rate(lr)
    if weight_decay is not None:
        check_range(weight_decay, "weight_decay", 0.0)
        base = chain(add_decayed_weights(weight_decay), base)
    return guarded(schedule_free(base, lr, b1, weight_lr_power), True)


@transform_factory
def schedule_free_sgd(
    learning_rate: Scalar = 1.0,
    warmup_steps: int | None = None,
    b1: Scalar = 0.9,
    weight_decay: Scalar | None = None,
    weight_lr_power: Scalar = 2.0,
) -> GradientTransformation:
    """Schedule-Free SGD (optax-contrib): ``schedule_free(sgd(lr), lr, b1)``.

    Evaluate the model at ``fo.schedule_free_eval_params(state, params)``.

    Args:
        learning_rate: the SGD learning rate.
        warmup_steps: length of a linear warmup from 0 (None: none).
        b1: interpolation between the average and the iterate, in (0, 1).
        weight_decay: L2 weight decay added to the gradient (None: none).
        weight_lr_power: power of the learning rate in the averaging weights.

    Returns:
        An injected ``GradientTransformation``; ``update`` needs ``params``.
    """
    return inject_hyperparams(_sgd)(learning_rate, warmup_steps, b1, weight_decay, weight_lr_power)


def _adamw(
    learning_rate: Scalar,
    warmup_steps: int | None,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    weight_decay: Scalar,
    weight_lr_power: Scalar,
) -> GradientTransformation:
    lr = _lr(learning_rate, warmup_steps)
    _check_b1(b1, weight_lr_power)
    check_range(b2, "b2", 0.0, 1.0)
    check_range(eps, "eps", 0.0)
    check_range(weight_decay, "weight_decay", 0.0)
    base = chain(
        scale_by_rms_debiased(b2, eps),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    return guarded(schedule_free(base, lr, b1, weight_lr_power), True)


@transform_factory
def schedule_free_adamw(
    learning_rate: Scalar = 0.0025,
    warmup_steps: int | None = None,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    weight_lr_power: Scalar = 2.0,
) -> GradientTransformation:
    """Schedule-Free AdamW (optax-contrib): AdamW without momentum (``b1`` is the schedule-free
    interpolation), wrapped by :func:`schedule_free`.

    Args:
        learning_rate: the AdamW learning rate.
        warmup_steps: length of a linear warmup from 0 (None: none).
        b1: interpolation between the average and the iterate, in (0, 1).
        b2: decay of the second moment.
        eps: added outside the root.
        weight_decay: decoupled weight decay.
        weight_lr_power: power of the learning rate in the averaging weights.

    Returns:
        An injected ``GradientTransformation``; ``update`` needs ``params``.
    """
    return inject_hyperparams(_adamw)(
        learning_rate, warmup_steps, b1, b2, eps, weight_decay, weight_lr_power
    )
