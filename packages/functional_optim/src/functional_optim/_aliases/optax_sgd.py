"""optax's sign-, trust-ratio- and SGD-style optimizers that torch.optim lacks.

``lion``, ``lars``, ``sm3``, ``fromage``, ``noisy_sgd`` and ``sign_sgd``, built like the Adam
family (see :mod:`functional_optim._aliases.optax_adaptive`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from functional_optim._aliases._common import LearningRate
from functional_optim._aliases._optax_common import (
    Scalar,
    check,
    guarded,
    inject,
    is_zero,
    masked_decay,
)
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms.lion import scale_by_lion
from functional_optim._transforms.masking import MaskOrFn, masked
from functional_optim._transforms.momentum import trace
from functional_optim._transforms.optax_layerwise import scale_by_sm3
from functional_optim._transforms.optax_misc import (
    NoiseKey,
    add_noise,
    noise_seed,
    scale_by_sign,
    scale_by_trust_ratio,
)
from functional_optim._transforms.scale import scale_by_learning_rate
from functional_optim._transforms.weight_decay import add_decayed_weights

__all__ = ["fromage", "lars", "lion", "noisy_sgd", "sign_sgd", "sm3"]


def _lion(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    mu_dtype: torch.dtype | None,
    weight_decay: Scalar,
    mask: MaskOrFn,
) -> GradientTransformation:
    check(
        learning_rate, b1=(b1, 0.0, 1.0), b2=(b2, 0.0, 1.0), weight_decay=(weight_decay, 0.0, None)
    )
    return guarded(
        chain(
            scale_by_lion(b1, b2, mu_dtype),
            masked_decay(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        ),
        not is_zero(weight_decay),
    )


@transform_factory
def lion(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.99,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Scalar = 1e-3,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023): ``-lr * (sign((1 - b1) g + b1 m) + wd * p)``, ``m`` an EMA (b2).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: rate combining momentum and gradient in the sign.
        b2: decay of the momentum.
        mu_dtype: dtype of the stored momentum (None: the params' dtype).
        weight_decay: decoupled weight decay (multiplied by the learning rate).
        mask: where to apply the weight decay (pytree/prefix of bools or callable).

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_lion, ("mu_dtype", "mask"))(learning_rate, b1, b2, mu_dtype, weight_decay, mask)


def _lars(
    learning_rate: LearningRate,
    weight_decay: Scalar,
    weight_decay_mask: MaskOrFn,
    trust_coefficient: Scalar,
    eps: Scalar,
    trust_ratio_mask: MaskOrFn,
    momentum: Scalar,
    nesterov: bool,
) -> GradientTransformation:
    check(
        learning_rate,
        weight_decay=(weight_decay, 0.0, None),
        trust_coefficient=(trust_coefficient, 0.0, None),
        eps=(eps, 0.0, None),
        momentum=(momentum, 0.0, None),
    )
    ratio = scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps)
    return guarded(
        chain(
            masked_decay(weight_decay, weight_decay_mask),
            ratio if trust_ratio_mask is True else masked(ratio, trust_ratio_mask),
            scale_by_learning_rate(learning_rate),
            trace(momentum, nesterov=nesterov),  # type: ignore[arg-type]
        ),
        True,
    )


@transform_factory
def lars(
    learning_rate: LearningRate,
    weight_decay: Scalar = 0.0,
    weight_decay_mask: MaskOrFn = True,
    trust_coefficient: Scalar = 0.001,
    eps: Scalar = 0.0,
    trust_ratio_mask: MaskOrFn = True,
    momentum: Scalar = 0.9,
    nesterov: bool = False,
) -> GradientTransformation:
    """LARS (You et al., 2017): weight decay, trust-ratio scaling, learning rate, then momentum
    (``trace``, applied after the learning rate as in optax).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        weight_decay: L2 weight decay added to the gradient.
        weight_decay_mask: where to apply the weight decay.
        trust_coefficient: multiplier of the trust ratio.
        eps: added to the update norm in the ratio.
        trust_ratio_mask: where to apply the trust ratio.
        momentum: momentum decay.
        nesterov: Nesterov momentum.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_lars, ("weight_decay_mask", "trust_ratio_mask"))(
        learning_rate,
        weight_decay,
        weight_decay_mask,
        trust_coefficient,
        eps,
        trust_ratio_mask,
        momentum,
        nesterov,
    )


def _sm3(learning_rate: LearningRate, momentum: Scalar) -> GradientTransformation:
    check(learning_rate, momentum=(momentum, 0.0, 1.0))
    return guarded(
        chain(scale_by_sm3(momentum), scale_by_learning_rate(learning_rate)),
        False,
    )


@transform_factory
def sm3(learning_rate: LearningRate, momentum: Scalar = 0.9) -> GradientTransformation:
    """SM3 (Anil et al., 2019): memory-efficient adaptive scaling with per-dimension accumulators.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        momentum: decay of the momentum.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_sm3)(learning_rate, momentum)


def _fromage(learning_rate: Scalar, min_norm: Scalar) -> GradientTransformation:
    if callable(learning_rate):
        raise TypeError("fromage's learning_rate must be a number or a 0-d tensor, not a schedule")
    check(learning_rate, min_norm=(min_norm, 0.0, None))
    if isinstance(learning_rate, Tensor):
        mult: Scalar = 1 / torch.sqrt(1 + learning_rate**2)
    else:
        mult = 1 / math.sqrt(1 + learning_rate**2)
    return guarded(
        chain(
            scale_by_trust_ratio(min_norm),
            scale_by_learning_rate(learning_rate * mult),
            add_decayed_weights(mult - 1),
        ),
        True,
    )


@transform_factory
def fromage(learning_rate: Scalar, min_norm: Scalar = 1e-6) -> GradientTransformation:
    """Fromage (Bernstein et al., 2020): trust-ratio steps shrunk by ``1 / sqrt(1 + lr**2)``.

    Args:
        learning_rate: a float or a 0-d tensor.
        min_norm: lower bound of the norms in the trust ratio.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_fromage)(learning_rate, min_norm)


def _noisy_sgd(
    learning_rate: LearningRate, eta: Scalar, gamma: Scalar, key: int
) -> GradientTransformation:
    check(learning_rate, eta=(eta, 0.0, None), gamma=(gamma, 0.0, None))
    return guarded(
        chain(add_noise(eta, gamma, key), scale_by_learning_rate(learning_rate)),
        False,
    )


@transform_factory
def noisy_sgd(
    learning_rate: LearningRate,
    eta: Scalar = 0.01,
    gamma: Scalar = 0.55,
    key: NoiseKey | None = None,
    *,
    seed: NoiseKey | None = None,
) -> GradientTransformation:
    """SGD on gradients plus Gaussian noise of variance ``eta / t**gamma`` (Neelakantan et al.).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        eta: base variance of the noise.
        gamma: decay exponent of the variance.
        key: optax's PRNG key: an int seed, a one-element integer tensor or a
            ``torch.Generator`` (torch's generator: optax's distribution, not its samples).
        seed: the older name of ``key``.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        TypeError: both ``key`` and ``seed``, or a key of another type.
    """
    return inject(_noisy_sgd)(learning_rate, eta, gamma, noise_seed(key, seed, name="noisy_sgd"))


def _sign_sgd(learning_rate: LearningRate) -> GradientTransformation:
    check(learning_rate)
    return guarded(
        chain(scale_by_sign(), scale_by_learning_rate(learning_rate)),
        False,
    )


@transform_factory
def sign_sgd(learning_rate: LearningRate) -> GradientTransformation:
    """signSGD (Bernstein et al., 2018): ``-lr * sign(g)``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_sign_sgd)(learning_rate)
