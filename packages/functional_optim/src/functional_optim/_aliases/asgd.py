"""``asgd``: torch.optim.ASGD as a transform chain with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    check_lr,
    check_nonneg,
    kernel_path,
    maximize_tx,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms.asgd import ScaleByAsgdState, scale_by_asgd
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim.functional import FunctionalASGD

__all__ = ["ASGD", "asgd"]


def _build_asgd(
    lr: float | Tensor,
    lambd: float,
    alpha: float,
    t0: float,
    weight_decay: float,
    foreach: bool | None,
    maximize: bool,
    differentiable: bool,
    capturable: bool,
) -> GradientTransformation:
    if callable(lr):
        raise TypeError(
            "asgd's lr sets its step-size state (eta) each step; pass a float, not a schedule"
        )
    lr = check_lr(lr)
    check_nonneg(weight_decay, "weight_decay value")
    tx = chain(
        maximize_tx(maximize),
        add_decayed_weights(weight_decay),
        scale_by_asgd(lr if isinstance(lr, Tensor) else float(lr), lambd, alpha, t0),
    )
    return ASGD.fused(
        tx,
        path=kernel_path(
            "asgd", foreach=foreach, capturable=capturable, differentiable=differentiable
        ),
        lr=lr,
        lambd=lambd,
        alpha=alpha,
        t0=t0,
        weight_decay=weight_decay,
        maximize=maximize,
    )


@transform_factory
def asgd(
    lr: float | Tensor = 1e-2,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float = 0,
    foreach: bool | None = None,
    maximize: bool = False,
    differentiable: bool = False,
    capturable: bool = False,
) -> GradientTransformation:
    """Averaged SGD (``torch.optim.ASGD``): ``chain(maximize, add_decayed_weights,
    scale_by_asgd)`` with a fused ``step``. The averaged params are ``state``'s ``ax``.

    Args:
        lr: learning rate (a float or 0-d tensor; it sets ``eta`` each step). The pure
            ``update`` keeps a tensor ``lr`` a tensor (differentiable, vmappable); the fused
            ``step`` reads it as a float, as torch does.
        lambd: decay term.
        alpha: power of the ``eta`` update.
        t0: step at which averaging starts.
        weight_decay: L2 penalty added to the gradient.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.
        differentiable: stored; runs the for-loop path.
        capturable: stored; a step on params off CUDA/XPU/HPU raises torch's AssertionError.

    Returns:
        An injected ``GradientTransformation``; ``step`` runs ``kernels.asgd``.

    Raises:
        ValueError: with torch's messages.
        TypeError: if ``lr`` is a schedule.
    """
    return inject_hyperparams(_build_asgd)(
        lr=lr,
        lambd=lambd,
        alpha=alpha,
        t0=t0,
        weight_decay=weight_decay,
        foreach=foreach,
        maximize=maximize,
        differentiable=differentiable,
        capturable=capturable,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.ASGD.
ASGD = Algorithm(
    name="asgd",
    torch_name="ASGD",
    elementwise=True,
    alias=asgd,
    transform=scale_by_asgd,
    state_type=ScaleByAsgdState,
    state_names={ScaleByAsgdState: {"count": "step", "eta": "eta", "mu": "mu", "ax": "ax"}},
    kernel=kernels.asgd,
    kernel_args=(
        PARAMS, GRADS, state("ax"), state("mu", shape="scalar"),
        state("eta", shape="scalar"), state("count"),
        "lambd", LR, "t0", "alpha", "weight_decay", "maximize", IMPL,
    ),
    functional=FunctionalASGD,
    promotes=True,
)  # fmt: skip
