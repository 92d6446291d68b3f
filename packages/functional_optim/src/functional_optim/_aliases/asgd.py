"""``asgd``: torch.optim.ASGD as a transform chain with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim._aliases._common import (
    check_lr,
    check_nonneg,
    maximize_tx,
)
from functional_optim._aliases._kernel_step import fused
from functional_optim._base import GradientTransformation, chain
from functional_optim._transforms.asgd import scale_by_asgd
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights

__all__ = ["asgd"]


def _build_asgd(
    lr: float | Tensor,
    lambd: float,
    alpha: float,
    t0: float,
    weight_decay: float,
    maximize: bool,
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
    return fused(
        tx,
        "asgd",
        lr=lr,
        lambd=lambd,
        alpha=alpha,
        t0=t0,
        weight_decay=weight_decay,
        maximize=maximize,
    )


def asgd(
    lr: float | Tensor = 1e-2,
    lambd: float = 1e-4,
    alpha: float = 0.75,
    t0: float = 1e6,
    weight_decay: float = 0,
    *,
    maximize: bool = False,
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
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``; ``step`` runs ``kernels.asgd``.

    Raises:
        ValueError: with torch's messages.
        TypeError: if ``lr`` is a schedule.
    """
    return inject_hyperparams(_build_asgd)(
        lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay, maximize=maximize
    )
