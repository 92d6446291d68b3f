"""``nadam`` and ``radam``: torch.optim.NAdam / RAdam as transform chains with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    KernelPath,
    LearningRate,
    as_float,
    check_betas,
    check_lr,
    check_nonneg,
    kernel_path,
    torch_chain,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._base import GradientTransformation
from functional_optim._recipes import transform_factory
from functional_optim._transforms.adam_variants import (
    ScaleByNadamState,
    ScaleByRadamState,
    scale_by_nadam,
    scale_by_radam,
)
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim.functional import (
    FunctionalNAdam,
    FunctionalRAdam,
)

__all__ = ["NADAM", "RADAM", "nadam", "radam"]

Betas = tuple[float | Tensor, float | Tensor]


def _check_adam_like(
    lr: LearningRate, betas: Betas, eps: float, weight_decay: float
) -> LearningRate:
    """torch's checks, in torch's order, for NAdam and RAdam; returns the chain's ``lr``
    (:func:`check_lr`)."""
    lr = check_lr(lr)
    check_nonneg(eps, "epsilon value")
    check_betas(betas)
    check_nonneg(weight_decay, "weight_decay value")
    return lr


def _path(name: str, foreach: bool | None, capturable: bool, differentiable: bool) -> KernelPath:
    return kernel_path(name, foreach=foreach, capturable=capturable, differentiable=differentiable)


def _build_nadam(
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    momentum_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
) -> GradientTransformation:
    lr = _check_adam_like(lr, betas, eps, weight_decay)
    check_nonneg(momentum_decay, "momentum_decay value")
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    decoupled = decoupled_weight_decay
    tx = torch_chain(
        maximize,
        0.0 if decoupled else weight_decay,
        lr,
        scale_by_nadam(b1, b2, eps, momentum_decay),
        add_decayed_weights(weight_decay if decoupled else 0.0),
    )
    return NADAM.fused(
        tx,
        path=_path("nadam", foreach, capturable, differentiable),
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        momentum_decay=momentum_decay,
        decoupled=decoupled,
        maximize=maximize,
    )


@transform_factory
def nadam(
    lr: LearningRate = 2e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
) -> GradientTransformation:
    """NAdam (``torch.optim.NAdam``): ``chain(maximize, add_decayed_weights, scale_by_nadam,
    add_decayed_weights (decoupled), scale_by_learning_rate)`` with a fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: moment decay rates.
        eps: added to the denominator.
        weight_decay: weight decay (L2 penalty unless ``decoupled_weight_decay``).
        momentum_decay: decay of the momentum coefficient.
        decoupled_weight_decay: decay the weights directly (as AdamW).
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.
        differentiable: stored; runs the for-loop path.

    Returns:
        An injected ``GradientTransformation``; ``step`` runs ``kernels.nadam``.

    Raises:
        ValueError: with torch's messages, e.g. ``Invalid momentum_decay value: -1``.
    """
    return inject_hyperparams(_build_nadam)(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        momentum_decay=momentum_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
    )


def _build_radam(
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
) -> GradientTransformation:
    lr = _check_adam_like(lr, betas, eps, weight_decay)
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    decoupled = decoupled_weight_decay
    tx = torch_chain(
        maximize,
        0.0 if decoupled else weight_decay,
        lr,
        scale_by_radam(b1, b2, eps),
        add_decayed_weights(weight_decay if decoupled else 0.0),
    )
    return RADAM.fused(
        tx,
        path=_path("radam", foreach, capturable, differentiable),
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        maximize=maximize,
    )


@transform_factory
def radam(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    decoupled_weight_decay: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
) -> GradientTransformation:
    """RAdam (``torch.optim.RAdam``): ``chain(maximize, add_decayed_weights, scale_by_radam,
    add_decayed_weights (decoupled), scale_by_learning_rate)`` with a fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: moment decay rates.
        eps: added to the denominator.
        weight_decay: weight decay (L2 penalty unless ``decoupled_weight_decay``).
        decoupled_weight_decay: decay the weights directly (as AdamW).
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.
        differentiable: stored; runs the for-loop path.

    Returns:
        An injected ``GradientTransformation``; ``step`` runs ``kernels.radam``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_radam)(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        decoupled_weight_decay=decoupled_weight_decay,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.NAdam.
NADAM = Algorithm(
    name="nadam",
    torch_name="NAdam",
    elementwise=True,
    alias=nadam,
    transform=scale_by_nadam,
    state_type=ScaleByNadamState,
    state_names={
        ScaleByNadamState: {
            "count": "step",
            "mu_product": "mu_product",
            "mu": "exp_avg",
            "nu": "exp_avg_sq",
        }
    },
    kernel=kernels.nadam,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("mu_product", shape="scalar"),
        state("count"),
        "b1", "b2", LR, "weight_decay", "momentum_decay", "eps", "decoupled", "maximize",
        IMPL,
    ),
    functional=FunctionalNAdam,
)  # fmt: skip

#: The entry mirroring torch.optim.RAdam.
RADAM = Algorithm(
    name="radam",
    torch_name="RAdam",
    elementwise=True,
    alias=radam,
    transform=scale_by_radam,
    state_type=ScaleByRadamState,
    state_names={ScaleByRadamState: {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}},
    kernel=kernels.radam,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("count"),
        "b1", "b2", LR, "weight_decay", "eps", "decoupled", "maximize", IMPL,
    ),
    functional=FunctionalRAdam,
)  # fmt: skip
