"""``muon``: torch.optim.Muon as a transform chain with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim._aliases._common import (
    LearningRate,
    scalar_lr,
)
from functional_optim._aliases._kernel_step import fused
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms._leaf import is_traced
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.muon import (
    DEFAULT_NS_COEFFICIENTS,
    scale_by_muon,
)
from functional_optim._transforms.scale import scale_by_learning_rate
from functional_optim._transforms.weight_decay import add_decayed_weights

__all__ = ["muon"]


def _check(
    lr: LearningRate, weight_decay: float, momentum: float, adjust_lr_fn: str | None
) -> None:
    """torch.optim.Muon's checks and messages, in its order."""
    if callable(lr):
        return
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not is_traced(lr) and not lr >= 0.0:  # a vmapped lr (a sweep) has no readable value
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def _build_muon(
    lr: LearningRate,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    eps: float,
    ns_steps: int,
    adjust_lr_fn: str | None,
) -> GradientTransformation:
    _check(lr, weight_decay, momentum, adjust_lr_fn)
    lr = scalar_lr(lr)
    tx = chain(
        scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    return fused(
        tx,
        "muon",
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=tuple(ns_coefficients),
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )


@transform_factory
def muon(
    lr: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon (``torch.optim.Muon``, 2-D params only): ``chain(scale_by_muon,
    add_decayed_weights, scale_by_learning_rate)`` with a fused ``step`` (``kernels.muon``).

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        weight_decay: decoupled weight decay (scaled by ``lr``).
        momentum: momentum factor.
        nesterov: orthogonalise the Nesterov look-ahead.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz iteration.
        eps: floor of the normalising norm.
        ns_steps: Newton-Schulz iterations (< 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.

    Returns:
        An injected ``GradientTransformation``; ``init`` rejects params that are not 2-D.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_muon)(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
