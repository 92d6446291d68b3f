"""``adagrad``, ``adadelta`` and ``adamax`` as transform chains with fused steps."""

from __future__ import annotations

from torch import Tensor

from functional_optim._aliases._common import (
    LearningRate,
    as_float,
    check_betas,
    check_lr,
    check_nonneg,
    torch_chain,
)
from functional_optim._aliases._kernel_step import fused
from functional_optim._base import GradientTransformation
from functional_optim._transforms.adam import scale_by_adamax
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.rms import (
    scale_by_adadelta,
    scale_by_adagrad,
)

__all__ = ["adadelta", "adagrad", "adamax"]


def _build_adagrad(
    lr: LearningRate,
    lr_decay: float,
    weight_decay: float,
    initial_accumulator_value: float,
    eps: float,
    maximize: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(lr_decay, "lr_decay value")
    check_nonneg(weight_decay, "weight_decay value")
    check_nonneg(initial_accumulator_value, "initial_accumulator_value value")
    check_nonneg(eps, "epsilon value")
    tx = torch_chain(
        maximize, weight_decay, lr, scale_by_adagrad(lr_decay, eps, initial_accumulator_value)
    )
    return fused(
        tx,
        "adagrad",
        lr=lr,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        eps=eps,
        maximize=maximize,
    )


def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: float = 0,
    weight_decay: float = 0,
    initial_accumulator_value: float = 0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adagrad (``torch.optim.Adagrad``, dense gradients): ``chain(maximize,
    add_decayed_weights, scale_by_adagrad, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        lr_decay: learning-rate decay.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: starting value of the sums of squares.
        eps: added to the denominator.
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adagrad)(
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        initial_accumulator_value=initial_accumulator_value,
        eps=eps,
        maximize=maximize,
    )


def _build_adadelta(
    lr: LearningRate, rho: float, eps: float, weight_decay: float, maximize: bool
) -> GradientTransformation:
    lr = check_lr(lr)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Invalid rho value: {rho}")
    check_nonneg(eps, "epsilon value")
    check_nonneg(weight_decay, "weight_decay value")
    tx = torch_chain(maximize, weight_decay, lr, scale_by_adadelta(rho, eps))
    return fused(
        tx, "adadelta", lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize
    )


def adadelta(
    lr: LearningRate = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adadelta (``torch.optim.Adadelta``): ``chain(maximize, add_decayed_weights,
    scale_by_adadelta, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: coefficient scaling the delta: a float, a 0-d tensor or a schedule.
        rho: decay of the running averages.
        eps: added inside the square roots.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adadelta)(
        lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize
    )


def _build_adamax(
    lr: LearningRate,
    betas: tuple[float | Tensor, float | Tensor],
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(eps, "epsilon value")
    check_betas(betas)
    check_nonneg(weight_decay, "weight_decay value")
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    tx = torch_chain(maximize, weight_decay, lr, scale_by_adamax(b1, b2, eps))
    return fused(
        tx,
        "adamax",
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
    )


def adamax(
    lr: LearningRate = 2e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """Adamax (``torch.optim.Adamax``): ``chain(maximize, add_decayed_weights,
    scale_by_adamax, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decay rates of the first moment and of the infinity norm.
        eps: added to ``|g|``.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adamax)(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize
    )
