"""optax's Adam-family optimizers that torch.optim lacks, with optax's names, defaults, maths.

``lamb``, ``nadamw``, ``amsgrad``, ``adabelief``, ``yogi``, ``novograd`` and ``adan``. Each alias
is built through :func:`inject_hyperparams` (numeric hyperparameters live in
``state.hyperparams``, so ``fo.Optimizer`` exposes them in ``param_groups`` and they can be
tensors for meta-learning); masks are static. Arguments are checked at construction
(``ValueError`` naming the argument) and inputs before any component runs. The generic chains
have no fused ``step``: ``fo.Optimizer`` runs them with ``update(inplace=True)``.
"""

from __future__ import annotations

import torch

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
from functional_optim._transforms.masking import MaskOrFn
from functional_optim._transforms.optax_adam import scale_by_amsgrad, scale_by_optax_adam
from functional_optim._transforms.optax_adaptive import (
    scale_by_adan,
    scale_by_belief,
    scale_by_yogi,
)
from functional_optim._transforms.optax_layerwise import scale_by_novograd
from functional_optim._transforms.optax_misc import scale_by_trust_ratio
from functional_optim._transforms.scale import scale_by_learning_rate

__all__ = ["adabelief", "adan", "amsgrad", "lamb", "nadamw", "novograd", "yogi"]


def _lamb(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    weight_decay: Scalar,
    mask: MaskOrFn,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
        weight_decay=(weight_decay, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_optax_adam(b1, b2, eps, eps_root),
            masked_decay(weight_decay, mask),
            scale_by_trust_ratio(),
            scale_by_learning_rate(learning_rate),
        ),
        True,
    )


@transform_factory
def lamb(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-6,
    eps_root: Scalar = 0.0,
    weight_decay: Scalar = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """LAMB (You et al., 2020): Adam plus decoupled weight decay, scaled per param block by the
    trust ratio ``||p|| / ||u||``.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added outside the root.
        eps_root: added inside the root.
        weight_decay: decoupled weight decay.
        mask: where to apply the weight decay.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_lamb, ("mask",))(learning_rate, b1, b2, eps, eps_root, weight_decay, mask)


def _nadamw(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    mu_dtype: torch.dtype | None,
    weight_decay: Scalar,
    mask: MaskOrFn,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
        weight_decay=(weight_decay, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_optax_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=True),
            masked_decay(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        ),
        not is_zero(weight_decay),
    )


@transform_factory
def nadamw(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    mu_dtype: torch.dtype | None = None,
    weight_decay: Scalar = 1e-4,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """NAdamW: Adam with Dozat's Nesterov momentum and decoupled weight decay (optax's).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added outside the root.
        eps_root: added inside the root.
        mu_dtype: dtype of the stored first moment (None: the params' dtype).
        weight_decay: decoupled weight decay (multiplied by the learning rate).
        mask: where to apply the weight decay.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_nadamw, ("mu_dtype", "mask"))(
        learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask
    )


def _amsgrad(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    mu_dtype: torch.dtype | None,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_amsgrad(b1, b2, eps, eps_root, mu_dtype),
            scale_by_learning_rate(learning_rate),
        ),
        False,
    )


@transform_factory
def amsgrad(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """AMSGrad as optax computes it (max of the bias-corrected second moment; see
    :func:`scale_by_amsgrad` for the difference from ``fo.adam(amsgrad=True)``).

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added outside the root.
        eps_root: added inside the root.
        mu_dtype: dtype of the stored first moment (None: the params' dtype).

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_amsgrad, ("mu_dtype",))(learning_rate, b1, b2, eps, eps_root, mu_dtype)


def _adabelief(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    nesterov: bool,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov),
            scale_by_learning_rate(learning_rate),
        ),
        False,
    )


@transform_factory
def adabelief(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-16,
    eps_root: Scalar = 1e-16,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """AdaBelief (Zhuang et al., 2020): Adam normalised by the spread of ``g`` around its mean.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: decay of the second central moment.
        eps: added outside the root.
        eps_root: added to the second moment.
        nesterov: Nesterov momentum.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_adabelief)(learning_rate, b1, b2, eps, eps_root, nesterov)


def _yogi(
    learning_rate: LearningRate, b1: Scalar, b2: Scalar, eps: Scalar
) -> GradientTransformation:
    check(learning_rate, b1=(b1, 0.0, 1.0), b2=(b2, 0.0, 1.0), eps=(eps, 0.0, None))
    return guarded(
        chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(learning_rate)),
        False,
    )


@transform_factory
def yogi(
    learning_rate: LearningRate, b1: Scalar = 0.9, b2: Scalar = 0.999, eps: Scalar = 1e-3
) -> GradientTransformation:
    """Yogi (Zaheer et al., 2018): Adam with an additive, sign-controlled second moment.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the first moment.
        b2: rate of the second-moment change.
        eps: added outside the root.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_yogi)(learning_rate, b1, b2, eps)


def _novograd(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    weight_decay: Scalar,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
        weight_decay=(weight_decay, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_novograd(b1, b2, eps, eps_root, weight_decay),
            scale_by_learning_rate(learning_rate),
        ),
        not is_zero(weight_decay),
    )


@transform_factory
def novograd(
    learning_rate: LearningRate,
    b1: Scalar = 0.9,
    b2: Scalar = 0.25,
    eps: Scalar = 1e-6,
    eps_root: Scalar = 0.0,
    weight_decay: Scalar = 0.0,
) -> GradientTransformation:
    """NovoGrad (Ginsburg et al., 2019): layer-wise second moments of the gradient norm.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the momentum.
        b2: decay of the squared norm.
        eps: added outside the root.
        eps_root: added inside the root.
        weight_decay: weight decay inside the momentum.

    Returns:
        An injected ``GradientTransformation`` (its ``update`` needs ``params`` when
        ``weight_decay`` is non-zero).
    """
    return inject(_novograd)(learning_rate, b1, b2, eps, eps_root, weight_decay)


def _adan(
    learning_rate: LearningRate,
    b1: Scalar,
    b2: Scalar,
    b3: Scalar,
    eps: Scalar,
    eps_root: Scalar,
    weight_decay: Scalar,
    mask: MaskOrFn,
) -> GradientTransformation:
    check(
        learning_rate,
        b1=(b1, 0.0, 1.0),
        b2=(b2, 0.0, 1.0),
        b3=(b3, 0.0, 1.0),
        eps=(eps, 0.0, None),
        eps_root=(eps_root, 0.0, None),
        weight_decay=(weight_decay, 0.0, None),
    )
    return guarded(
        chain(
            scale_by_adan(b1, b2, b3, eps, eps_root),
            masked_decay(weight_decay, mask),
            scale_by_learning_rate(learning_rate),
        ),
        not is_zero(weight_decay),
    )


@transform_factory
def adan(
    learning_rate: LearningRate,
    b1: Scalar = 0.98,
    b2: Scalar = 0.92,
    b3: Scalar = 0.99,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """Adan (Xie et al., 2022): adaptive Nesterov momentum from gradient differences.

    Args:
        learning_rate: a float, a 0-d tensor or a schedule.
        b1: decay of the gradient average.
        b2: decay of the gradient-difference average.
        b3: decay of the squared term.
        eps: added outside the root.
        eps_root: added inside the root.
        weight_decay: decoupled weight decay.
        mask: where to apply the weight decay.

    Returns:
        An injected ``GradientTransformation``.
    """
    return inject(_adan, ("mask",))(learning_rate, b1, b2, b3, eps, eps_root, weight_decay, mask)
