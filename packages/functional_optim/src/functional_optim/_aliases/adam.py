"""``adam`` and ``adamw``: torch.optim.Adam / AdamW as transform chains with a fused step."""

from __future__ import annotations

from typing import Any

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
from functional_optim._transforms.adam import scale_by_adam
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights

__all__ = ["adam", "adamw"]


def _build(
    lr: LearningRate,
    betas: tuple[float | Tensor, float | Tensor],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
) -> GradientTransformation:
    lr = check_lr(lr)
    check_nonneg(eps, "epsilon value")
    check_betas(betas)
    check_nonneg(weight_decay, "weight_decay value")
    if not (
        (isinstance(betas[0], float) and isinstance(betas[1], float))
        or (isinstance(betas[0], Tensor) and isinstance(betas[1], Tensor))
    ):
        raise ValueError("betas must be either both floats or both Tensors")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    tx = torch_chain(
        maximize,
        0.0 if decoupled else weight_decay,
        lr,
        scale_by_adam(b1, b2, eps, amsgrad),
        add_decayed_weights(weight_decay if decoupled else 0.0),
    )
    return fused(
        tx,
        "adamw" if decoupled else "adam",  # the decoupled kernel, same arguments
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )


def _build_adam(decoupled_weight_decay: bool, **kwargs: Any) -> GradientTransformation:
    return _build(decoupled=decoupled_weight_decay, **kwargs)


def _build_adamw(**kwargs: Any) -> GradientTransformation:
    return _build(decoupled=True, **kwargs)


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
) -> GradientTransformation:
    """Adam (``torch.optim.Adam``): ``chain(maximize, add_decayed_weights, scale_by_adam,
    add_decayed_weights(0), scale_by_learning_rate)`` with a fused ``step``.

    Args:
        lr: learning rate: a float, a 0-d tensor (differentiable in the pure path) or a schedule.
        betas: moment decay rates (both floats or both 1-element tensors).
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        amsgrad: use the running maximum of the second moment.
        maximize: maximize the objective.
        decoupled_weight_decay: decay the weights directly (AdamW) instead of adding an L2
            penalty to the gradient.

    Returns:
        An injected ``GradientTransformation`` (hyperparameters in
        ``state.hyperparams``); ``step`` runs ``functional_optim.kernels.adam(impl="auto")``.

    Raises:
        ValueError: with torch's messages, e.g. ``Invalid learning rate: -1``.

    Example::

        >>> tx = fo.adam(lr=1e-3)
        >>> state = tx.init(params)
        >>> updates, state = tx.update(grads, state, params)   # pure
        >>> params = fo.apply_updates(params, updates)
        >>> state = tx.step(params, grads, state)              # fused, in place
    """
    return inject_hyperparams(_build_adam)(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay,
    )


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> GradientTransformation:
    """AdamW (``torch.optim.AdamW``): Adam with decoupled weight decay, applied after
    ``scale_by_adam`` and scaled by the learning rate; fused ``step`` via ``kernels.adamw``.

    Args: as :func:`adam` (``weight_decay`` defaults to ``1e-2``).

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_adamw)(
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )
