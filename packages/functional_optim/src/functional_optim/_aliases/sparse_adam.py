"""``sparse_adam``: torch.optim.SparseAdam as a transform chain with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    LearningRate,
    as_float,
    check_betas,
    maximize_tx,
    scalar_lr,
)
from functional_optim._aliases._kernel_spec import GRADS, LR, PARAMS, state
from functional_optim._aliases.muon import fused_tensor_lr
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.scale import scale_by_learning_rate
from functional_optim._transforms.sparse_adam import (
    DENSE_GRAD_MESSAGE,
    ScaleBySparseAdamState,
    scale_by_sparse_adam,
)

__all__ = ["SPARSE_ADAM", "sparse_adam"]


def _build_sparse_adam(
    lr: LearningRate, betas: tuple[float | Tensor, float | Tensor], eps: float, maximize: bool
) -> GradientTransformation:
    if not callable(lr):
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr > 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
    if not eps > 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    check_betas(betas)
    b1, b2 = as_float(betas[0]), as_float(betas[1])
    lr = scalar_lr(lr)  # torch's _to_scalar: a 1-element tensor as a 0-d one
    tx = chain(maximize_tx(maximize), scale_by_sparse_adam(b1, b2, eps), scale_by_learning_rate(lr))
    return fused_tensor_lr(tx, SPARSE_ADAM, lr=lr, b1=b1, b2=b2, eps=eps, maximize=maximize)


@transform_factory
def sparse_adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
    eps: float = 1e-8,
    maximize: bool = False,
) -> GradientTransformation:
    """SparseAdam (``torch.optim.SparseAdam``): dense params, sparse COO gradients;
    ``chain(maximize, scale_by_sparse_adam, scale_by_learning_rate)`` with a fused ``step``
    (``kernels.sparse_adam``). Updates are sparse; ``apply_updates`` adds them densely.

    Args:
        lr: learning rate (> 0): a float, a 0-d tensor or a schedule.
        betas: moment decay rates.
        eps: added to the denominator (> 0).
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages (also at ``init`` for sparse or complex params).
        RuntimeError: torch's message for a dense gradient, before anything changes.
    """
    return inject_hyperparams(_build_sparse_adam)(lr=lr, betas=betas, eps=eps, maximize=maximize)


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.SparseAdam.
SPARSE_ADAM = Algorithm(
    name="sparse_adam",
    torch_name="SparseAdam",
    alias=sparse_adam,
    transform=scale_by_sparse_adam,
    state_type=ScaleBySparseAdamState,
    state_names={
        ScaleBySparseAdamState: {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}
    },
    kernel=kernels.sparse_adam,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("count"),
        "eps", "b1", "b2", LR, "maximize",
    ),
    sparse_grads=True,
    sparse_message=DENSE_GRAD_MESSAGE,
)  # fmt: skip
