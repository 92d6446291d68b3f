"""``rmsprop`` and ``rprop`` as transform chains with fused steps."""

from __future__ import annotations

import torch

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    LearningRate,
    as_float,
    check_lr,
    check_nonneg,
    kernel_path,
    maximize_tx,
    torch_chain,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._aliases.sgd import TRACE_NAMES
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.momentum import TraceState, trace
from functional_optim._transforms.rms import (
    ScaleByRmsState,
    scale_by_rms,
)
from functional_optim._transforms.rprop import ScaleByRpropState, scale_by_rprop
from functional_optim._transforms.scale import scale
from functional_optim.functional import (
    FunctionalRMSprop,
    FunctionalRprop,
)

__all__ = ["RMSPROP", "RPROP", "rmsprop", "rprop"]


def _build_rmsprop(
    lr: LearningRate,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    capturable: bool,
    foreach: bool | None,
    maximize: bool,
    differentiable: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(eps, "epsilon value")
    check_nonneg(momentum, "momentum value")
    check_nonneg(weight_decay, "weight_decay value")
    check_nonneg(alpha, "alpha value")
    tx = torch_chain(
        maximize, weight_decay, lr, scale_by_rms(alpha, eps, centered), trace(momentum)
    )
    return RMSPROP.fused(
        tx,
        path=kernel_path(
            "rmsprop", foreach=foreach, capturable=capturable, differentiable=differentiable
        ),
        lr=lr,
        alpha=alpha,
        eps=eps,
        weight_decay=weight_decay,
        momentum=momentum,
        centered=centered,
        maximize=maximize,
    )


@transform_factory
def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0,
    momentum: float = 0,
    centered: bool = False,
    capturable: bool = False,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
) -> GradientTransformation:
    """RMSprop (``torch.optim.RMSprop``): ``chain(maximize, add_decayed_weights, scale_by_rms,
    trace(momentum), scale_by_learning_rate)``, fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        alpha: smoothing constant.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum factor.
        centered: normalise by the estimated variance.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_rmsprop)(
        lr=lr,
        alpha=alpha,
        eps=eps,
        weight_decay=weight_decay,
        momentum=momentum,
        centered=centered,
        capturable=capturable,
        foreach=foreach,
        maximize=maximize,
        differentiable=differentiable,
    )


def _build_rprop(
    lr: LearningRate,
    etas: tuple[float, float],
    step_sizes: tuple[float, float],
    capturable: bool,
    foreach: bool | None,
    maximize: bool,
    differentiable: bool,
) -> GradientTransformation:
    if callable(lr):
        raise TypeError("rprop's lr only sets the initial step sizes; pass a float, not a schedule")
    lr = check_lr(lr)
    if not 0.0 < etas[0] < 1.0 < etas[1]:
        raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")
    tx = chain(
        maximize_tx(maximize),
        scale_by_rprop(as_float(lr), etas, step_sizes),
        scale(-1.0),
    )
    return RPROP.fused(
        tx,
        path=kernel_path(
            "rprop", foreach=foreach, capturable=capturable, differentiable=differentiable
        ),
        step_size_min=float(step_sizes[0]),
        step_size_max=float(step_sizes[1]),
        etaminus=float(etas[0]),
        etaplus=float(etas[1]),
        maximize=maximize,
    )


@transform_factory
def rprop(
    lr: float | torch.Tensor = 1e-2,
    etas: tuple[float, float] = (0.5, 1.2),
    step_sizes: tuple[float, float] = (1e-6, 50),
    *,
    capturable: bool = False,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
) -> GradientTransformation:
    """Rprop (``torch.optim.Rprop``): ``chain(maximize, scale_by_rprop, scale(-1))``, fused
    ``step``. ``lr`` is the initial step size, read when the state is created (as torch reads
    it when a param's state is created).

    Args:
        lr: initial step size.
        etas: ``(etaminus, etaplus)``.
        step_sizes: ``(min, max)`` step sizes.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_rprop)(
        lr=lr,
        etas=etas,
        step_sizes=step_sizes,
        capturable=capturable,
        foreach=foreach,
        maximize=maximize,
        differentiable=differentiable,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.RMSprop.
RMSPROP = Algorithm(
    name="rmsprop",
    torch_name="RMSprop",
    elementwise=True,
    alias=rmsprop,
    transform=scale_by_rms,
    state_type=ScaleByRmsState,
    state_names={
        ScaleByRmsState: {"count": "step", "nu": "square_avg", "mu": "grad_avg"},
        **TRACE_NAMES,
    },
    kernel=kernels.rmsprop,
    kernel_args=(
        PARAMS, GRADS, state("nu"), state("mu", when="centered"),
        state("momentum_buffer", when="momentum", of=TraceState, fill="zeros"),
        state("count"), LR, "alpha", "eps", "weight_decay", "momentum", "centered",
        "maximize", IMPL,
    ),
    functional=FunctionalRMSprop,
    promotes=True,
    one_dtype_when="centered",
)  # fmt: skip

#: The entry mirroring torch.optim.Rprop.
RPROP = Algorithm(
    name="rprop",
    torch_name="Rprop",
    elementwise=True,
    alias=rprop,
    transform=scale_by_rprop,
    state_type=ScaleByRpropState,
    state_names={
        ScaleByRpropState: {"count": "step", "prev": "prev", "step_size": "step_size"}
    },
    kernel=kernels.rprop,
    kernel_args=(
        PARAMS, GRADS, state("prev"), state("step_size"), state("count"),
        "step_size_min", "step_size_max", "etaminus", "etaplus", "maximize", IMPL,
    ),
    functional=FunctionalRprop,
    promotes=True,
)  # fmt: skip
