"""``sgd``: torch.optim.SGD as a transform chain with a fused step."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    LearningRate,
    check_fused,
    check_lr,
    check_nonneg,
    kernel_path,
    torch_chain,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._base import GradientTransformation
from functional_optim._recipes import transform_factory
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.momentum import TraceState, trace
from functional_optim.functional import FunctionalSGD

__all__ = ["SGD", "TRACE_NAMES", "sgd"]


def _build(
    lr: LearningRate,
    momentum: float,
    dampening: float,
    weight_decay: float | Tensor,
    nesterov: bool,
    maximize: bool,
    foreach: bool | None,
    differentiable: bool,
    fused: bool | None,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(momentum, "momentum value")
    check_nonneg(weight_decay, "weight_decay value")  # type: ignore[arg-type]
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    check_fused(fused, foreach, differentiable)
    tx = torch_chain(maximize, weight_decay, lr, trace(momentum, dampening, nesterov))
    return SGD.fused(
        tx,
        path=kernel_path("sgd", foreach=foreach, fused=fused, differentiable=differentiable),
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=float(weight_decay),
        nesterov=nesterov,
        maximize=maximize,
    )


@transform_factory
def sgd(
    lr: LearningRate = 1e-3,
    momentum: float = 0,
    dampening: float = 0,
    weight_decay: float | Tensor = 0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    differentiable: bool = False,
    fused: bool | None = None,
) -> GradientTransformation:
    """SGD (``torch.optim.SGD``): ``chain(maximize, add_decayed_weights, trace,
    scale_by_learning_rate)`` with a fused ``step`` (``functional_optim.kernels.sgd``).

    Args:
        lr: learning rate: a float, a 0-d tensor (differentiable in the pure path) or a schedule.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: Nesterov momentum.
        maximize: maximize the objective.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        differentiable: stored; runs the for-loop path.
        fused: torch's fused kernel (``torch._fused_sgd_``).

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages, e.g. ``Invalid momentum value: -1``.
        RuntimeError: ``fused`` with ``foreach`` or ``differentiable`` (torch's messages).
    """
    return inject_hyperparams(_build)(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        foreach=foreach,
        differentiable=differentiable,
        fused=fused,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: torch's key of :class:`TraceState`'s buffer (SGD's, and RMSprop's momentum).
TRACE_NAMES: dict[type, Mapping[str, str]] = {TraceState: {"momentum_buffer": "momentum_buffer"}}

#: The entry mirroring torch.optim.SGD.
SGD = Algorithm(
    name="sgd",
    torch_name="SGD",
    elementwise=True,
    alias=sgd,
    transform=trace,
    state_type=TraceState,
    state_names=TRACE_NAMES,
    kernel=kernels.sgd,
    kernel_args=(
        PARAMS, GRADS, state("momentum_buffer", when="momentum", fill="kernel"),
        LR, "momentum", "dampening", "weight_decay", "nesterov", "maximize", IMPL,
    ),
    functional=FunctionalSGD,
    has_fused=True,
    takes_sparse=True,
    promotes=True,
)  # fmt: skip
