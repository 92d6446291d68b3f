"""``adam`` and ``adamw``: torch.optim.Adam / AdamW as transform chains with a fused step."""

from __future__ import annotations

from collections.abc import Mapping

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
    check_tensor_for_foreach,
    kernel_path,
    scalar_betas,
    torch_chain,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, KernelArg, state
from functional_optim._base import GradientTransformation
from functional_optim._recipes import transform_factory
from functional_optim._tail_kernels import ADAM_SPARSE
from functional_optim._transforms.adam import (
    ScaleByAdamState,
    scale_by_adam,
)
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim.functional import (
    FunctionalAdam,
    FunctionalAdamW,
)

__all__ = ["ADAM", "ADAMW", "adam", "adamw"]

Betas = tuple[float | Tensor, float | Tensor]


def _check(
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
    fused: bool | None,
) -> LearningRate:
    """torch.optim.Adam's constructor checks, in its order; returns the chain's ``lr``."""
    check_tensor_for_foreach("lr", lr, foreach, capturable)
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
        check_tensor_for_foreach(f"betas[{i}]", b, foreach, capturable)
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
    check_fused(fused, foreach, differentiable)
    return lr


def _build(
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
    fused: bool | None,
    decoupled_weight_decay: bool,
) -> GradientTransformation:
    lr = _check(lr, betas, eps, weight_decay, foreach, capturable, differentiable, fused)
    decoupled = decoupled_weight_decay
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    tx = torch_chain(
        maximize,
        0.0 if decoupled else weight_decay,
        lr,
        scale_by_adam(b1, b2, eps, amsgrad),
        add_decayed_weights(weight_decay if decoupled else 0.0),
    )
    name = "adamw" if decoupled else "adam"  # the decoupled kernel, same arguments
    return (ADAMW if decoupled else ADAM).fused(
        tx,
        path=kernel_path(
            name,
            foreach=foreach,
            fused=fused,
            capturable=capturable,
            differentiable=differentiable,
        ),
        lr=lr,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )


@transform_factory
def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    amsgrad: bool = False,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
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
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None:
            this package's fastest path for the tensors (``impl="auto"``).
        maximize: maximize the objective.
        capturable: stored as torch stores it; a step on params off CUDA/XPU/HPU raises
            torch's ``AssertionError`` (see :func:`~functional_optim._aliases._common.kernel_path`).
        differentiable: stored; runs the for-loop path (the fused ``step`` itself is not
            differentiable: use the pure ``update`` for that).
        fused: torch's fused kernel (``torch._fused_adam_``); its device/dtype error at step.
        decoupled_weight_decay: decay the weights directly (AdamW) instead of adding an L2
            penalty to the gradient.

    Returns:
        An injected ``GradientTransformation`` (hyperparameters in
        ``state.hyperparams``, torch's param-group keys); ``step`` runs
        ``functional_optim.kernels.adam`` on the path the flags choose.

    Raises:
        ValueError: with torch's messages, e.g. ``Invalid learning rate: -1``.
        RuntimeError: ``fused`` with ``foreach`` or ``differentiable`` (torch's messages).

    Example::

        >>> tx = fo.adam(lr=1e-3)
        >>> state = tx.init(params)
        >>> updates, state = tx.update(grads, state, params)   # pure
        >>> params = fo.apply_updates(params, updates)
        >>> state = tx.step(params, grads, state)              # fused, in place
    """
    return inject_hyperparams(_build)(
        lr=lr,
        betas=scalar_betas(betas),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
        fused=fused,
        decoupled_weight_decay=decoupled_weight_decay,
    )


@transform_factory
def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
) -> GradientTransformation:
    """AdamW (``torch.optim.AdamW``): Adam with decoupled weight decay, applied after
    ``scale_by_adam`` and scaled by the learning rate; fused ``step`` via ``kernels.adamw``.

    Args: as :func:`adam` (``weight_decay`` defaults to ``1e-2``). As torch's AdamW, the
    hyperparameters (param groups) also hold ``decoupled_weight_decay=True``.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages.
        RuntimeError: ``fused`` with ``foreach`` or ``differentiable`` (torch's messages).
    """
    return inject_hyperparams(_build)(
        lr=lr,
        betas=scalar_betas(betas),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
        fused=fused,
        decoupled_weight_decay=True,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

_ADAM_NAMES: Mapping[str, str] = {
    "count": "step",
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
}

_ADAM_ARGS: tuple[KernelArg, ...] = (
    PARAMS, GRADS, state("mu"), state("nu"), state("nu_max", when="amsgrad"), state("count"),
    "amsgrad", "b1", "b2", LR, "weight_decay", "eps", "maximize", IMPL,
)  # fmt: skip

#: The entry mirroring torch.optim.Adam.
ADAM = Algorithm(
    name="adam",
    torch_name="Adam",
    elementwise=True,
    alias=adam,
    transform=scale_by_adam,
    state_type=ScaleByAdamState,
    state_names={ScaleByAdamState: _ADAM_NAMES},
    kernel=kernels.adam,
    kernel_args=_ADAM_ARGS,
    functional=FunctionalAdam,
    has_fused=True,
    sparse_message=ADAM_SPARSE,
)  # fmt: skip

#: The entry mirroring torch.optim.AdamW.
ADAMW = Algorithm(
    name="adamw",
    torch_name="AdamW",
    elementwise=True,
    alias=adamw,
    transform=scale_by_adam,
    state_type=ScaleByAdamState,
    state_names={ScaleByAdamState: _ADAM_NAMES},
    kernel=kernels.adamw,
    kernel_args=_ADAM_ARGS,
    functional=FunctionalAdamW,
    has_fused=True,
    sparse_message=ADAM_SPARSE,
)  # fmt: skip
