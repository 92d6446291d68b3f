"""``adagrad``, ``adadelta`` and ``adamax`` as transform chains with fused steps."""

from __future__ import annotations

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    LearningRate,
    as_float,
    check_betas,
    check_fused,
    check_lr,
    check_nonneg,
    kernel_path,
    torch_chain,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._base import GradientTransformation
from functional_optim._recipes import transform_factory
from functional_optim._transforms.adam import (
    ScaleByAdamaxState,
    scale_by_adamax,
)
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.rms import (
    ScaleByAdadeltaState,
    ScaleByAdagradState,
    scale_by_adadelta,
    scale_by_adagrad,
)
from functional_optim.functional import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdamax,
)

__all__ = ["ADADELTA", "ADAGRAD", "ADAMAX", "adadelta", "adagrad", "adamax"]


def _build_adagrad(
    lr: LearningRate,
    lr_decay: float,
    weight_decay: float,
    initial_accumulator_value: float,
    eps: float,
    foreach: bool | None,
    maximize: bool,
    differentiable: bool,
    fused: bool | None,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(lr_decay, "lr_decay value")
    check_nonneg(weight_decay, "weight_decay value")
    check_nonneg(initial_accumulator_value, "initial_accumulator_value value")
    check_nonneg(eps, "epsilon value")
    check_fused(fused, foreach, differentiable)
    tx = torch_chain(
        maximize, weight_decay, lr, scale_by_adagrad(lr_decay, eps, initial_accumulator_value)
    )
    return ADAGRAD.fused(
        tx,
        path=kernel_path("adagrad", foreach=foreach, fused=fused, differentiable=differentiable),
        lr=lr,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        eps=eps,
        maximize=maximize,
    )


@transform_factory
def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: float = 0,
    weight_decay: float = 0,
    initial_accumulator_value: float = 0,
    eps: float = 1e-10,
    foreach: bool | None = None,
    *,
    maximize: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
) -> GradientTransformation:
    """Adagrad (``torch.optim.Adagrad``, dense gradients): ``chain(maximize,
    add_decayed_weights, scale_by_adagrad, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        lr_decay: learning-rate decay.
        weight_decay: L2 penalty added to the gradient.
        initial_accumulator_value: starting value of the sums of squares.
        eps: added to the denominator.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.
        fused: torch's fused CPU kernel (``torch._fused_adagrad_``).

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
        RuntimeError: ``fused`` with ``foreach`` or ``differentiable`` (torch's messages).
    """
    return inject_hyperparams(_build_adagrad)(
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        initial_accumulator_value=initial_accumulator_value,
        eps=eps,
        foreach=foreach,
        maximize=maximize,
        differentiable=differentiable,
        fused=fused,
    )


def _build_adadelta(
    lr: LearningRate,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    capturable: bool,
    foreach: bool | None,
    differentiable: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Invalid rho value: {rho}")
    check_nonneg(eps, "epsilon value")
    check_nonneg(weight_decay, "weight_decay value")
    tx = torch_chain(maximize, weight_decay, lr, scale_by_adadelta(rho, eps))
    path = kernel_path(
        "adadelta", foreach=foreach, capturable=capturable, differentiable=differentiable
    )
    return ADADELTA.fused(
        tx,
        path=path,
        lr=lr,
        rho=rho,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
    )


@transform_factory
def adadelta(
    lr: LearningRate = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0,
    foreach: bool | None = None,
    *,
    capturable: bool = False,
    maximize: bool = False,
    differentiable: bool = False,
) -> GradientTransformation:
    """Adadelta (``torch.optim.Adadelta``): ``chain(maximize, add_decayed_weights,
    scale_by_adadelta, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: coefficient scaling the delta: a float, a 0-d tensor or a schedule.
        rho: decay of the running averages.
        eps: added inside the square roots.
        weight_decay: L2 penalty added to the gradient.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adadelta)(
        lr=lr,
        rho=rho,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
        capturable=capturable,
        foreach=foreach,
        differentiable=differentiable,
    )


def _build_adamax(
    lr: LearningRate,
    betas: tuple[float | Tensor, float | Tensor],
    eps: float,
    weight_decay: float,
    foreach: bool | None,
    maximize: bool,
    differentiable: bool,
    capturable: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(eps, "epsilon value")
    check_betas(betas)
    check_nonneg(weight_decay, "weight_decay value")
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    tx = torch_chain(maximize, weight_decay, lr, scale_by_adamax(b1, b2, eps))
    return ADAMAX.fused(
        tx,
        path=kernel_path(
            "adamax", foreach=foreach, capturable=capturable, differentiable=differentiable
        ),
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
    )


@transform_factory
def adamax(
    lr: LearningRate = 2e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    foreach: bool | None = None,
    *,
    maximize: bool = False,
    differentiable: bool = False,
    capturable: bool = False,
) -> GradientTransformation:
    """Adamax (``torch.optim.Adamax``): ``chain(maximize, add_decayed_weights,
    scale_by_adamax, scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        betas: decay rates of the first moment and of the infinity norm.
        eps: added to ``|g|``.
        weight_decay: L2 penalty added to the gradient.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adamax)(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        foreach=foreach,
        maximize=maximize,
        differentiable=differentiable,
        capturable=capturable,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.Adamax.
ADAMAX = Algorithm(
    name="adamax",
    torch_name="Adamax",
    elementwise=True,
    alias=adamax,
    transform=scale_by_adamax,
    state_type=ScaleByAdamaxState,
    state_names={ScaleByAdamaxState: {"count": "step", "mu": "exp_avg", "nu": "exp_inf"}},
    kernel=kernels.adamax,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("count"),
        "eps", "b1", "b2", LR, "weight_decay", "maximize", IMPL,
    ),
    functional=FunctionalAdamax,
)  # fmt: skip

#: The entry mirroring torch.optim.Adagrad.
ADAGRAD = Algorithm(
    name="adagrad",
    torch_name="Adagrad",
    elementwise=True,
    alias=adagrad,
    transform=scale_by_adagrad,
    state_type=ScaleByAdagradState,
    state_names={ScaleByAdagradState: {"count": "step", "sum_of_squares": "sum"}},
    kernel=kernels.adagrad,
    kernel_args=(
        PARAMS, GRADS, state("sum_of_squares"), state("count"),
        LR, "weight_decay", "lr_decay", "eps", "maximize", IMPL,
    ),
    functional=FunctionalAdagrad,
    has_fused=True,
    takes_sparse=True,
    promotes=True,
)  # fmt: skip

#: The entry mirroring torch.optim.Adadelta.
ADADELTA = Algorithm(
    name="adadelta",
    torch_name="Adadelta",
    elementwise=True,
    alias=adadelta,
    transform=scale_by_adadelta,
    state_type=ScaleByAdadeltaState,
    state_names={
        ScaleByAdadeltaState: {"count": "step", "nu": "square_avg", "acc_delta": "acc_delta"}
    },
    kernel=kernels.adadelta,
    kernel_args=(
        PARAMS, GRADS, state("nu"), state("acc_delta"), state("count"),
        LR, "rho", "eps", "weight_decay", "maximize", IMPL,
    ),
    functional=FunctionalAdadelta,
    promotes=True,
)  # fmt: skip
