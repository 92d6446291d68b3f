"""``adafactor``: torch.optim.Adafactor as a transform chain with a fused step."""

from __future__ import annotations

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import kernel_path, maximize_tx
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._aliases._kernel_step import with_kernel
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._sharded_adafactor import shards_adafactor
from functional_optim._transforms._leaf import is_traced
from functional_optim._transforms.adafactor import (
    ScaleByAdafactorState,
    check_real,
    col_var_shape,
    row_var_shape,
    scale_by_adafactor,
    variance_shape,
)
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim.functional import (
    FunctionalAdafactor,
)

__all__ = ["ADAFACTOR", "adafactor"]


def _check(lr: float | Tensor, beta2_decay: float, eps: tuple[float | None, float], d: float,
           weight_decay: float) -> None:  # fmt: skip
    """torch.optim.Adafactor's checks and messages, in its order."""
    if callable(lr):
        raise TypeError("adafactor's lr caps its relative step size; pass a float, not a schedule")
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not is_traced(lr) and not lr >= 0.0:  # a vmapped lr (a sweep) has no readable value
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not beta2_decay <= 0.0:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    if eps[0] is not None and not eps[0] >= 0.0:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]}")
    if not eps[1] >= 0.0:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]}")
    if not d >= 1.0:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")


def _build_adafactor(
    lr: float | Tensor,
    beta2_decay: float,
    eps: tuple[float | None, float],
    d: float,
    weight_decay: float,
    foreach: bool | None,
    maximize: bool,
) -> GradientTransformation:
    _check(lr, beta2_decay, eps, d, weight_decay)
    if isinstance(lr, Tensor):  # kept a tensor: differentiable and vmappable
        rate: float | Tensor = lr.reshape(())
        decay: float | Tensor = -rate * weight_decay if weight_decay != 0 else 0.0
    else:
        rate = float(lr)
        decay = -rate * weight_decay if weight_decay != 0 else 0.0  # not inf * 0 = nan
    tx = chain(
        maximize_tx(maximize),
        scale_by_adafactor(rate, beta2_decay, eps, d),
        add_decayed_weights(decay),  # decoupled: param *= 1 - lr * wd
    )
    # the registered kernel, wrapped to step FSDP2 row shards with sharded statistics
    spec = ADAFACTOR.kernel_spec
    assert spec is not None
    return with_kernel(
        tx,
        shards_adafactor(spec),
        {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "eps1": eps[0],
            "eps2": eps[1],
            "d": d,
            "weight_decay": weight_decay,
            "maximize": maximize,
        },
        kernel_path("adafactor", foreach=foreach),
    )


@transform_factory
def adafactor(
    lr: float | Tensor = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    foreach: bool | None = None,
    maximize: bool = False,
) -> GradientTransformation:
    """Adafactor (``torch.optim.Adafactor``): ``chain(maximize, scale_by_adafactor,
    add_decayed_weights(-lr * weight_decay))`` with a fused ``step`` (``kernels.adafactor``).

    Args:
        lr: caps the relative step size ``1 / sqrt(t)`` (a float or 0-d tensor). The pure
            ``update`` keeps a tensor ``lr`` a tensor (differentiable, vmappable); the fused
            ``step`` reads it as a float, as torch does.
        beta2_decay: exponent of the second-moment decay (<= 0).
        eps: ``(eps1, eps2)``: second-moment floor (None: the dtype's machine epsilon) and
            param-RMS floor.
        d: clipping threshold of the update's RMS (>= 1).
        weight_decay: decoupled weight decay.
        foreach: torch's multi-tensor path (``True``) or its for-loop (``False``); None: the
            fastest path for the tensors.
        maximize: maximize the objective.

    Returns:
        An injected ``GradientTransformation``.

    Raises:
        ValueError: with torch's messages, e.g. ``beta2_decay should be <= 0 but is: 0.5``.
        TypeError: if ``lr`` is a schedule.
    """
    return inject_hyperparams(_build_adafactor)(
        lr=lr,
        beta2_decay=beta2_decay,
        eps=eps,
        d=d,
        weight_decay=weight_decay,
        foreach=foreach,
        maximize=maximize,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.Adafactor.
ADAFACTOR = Algorithm(
    name="adafactor",
    torch_name="Adafactor",
    alias=adafactor,
    transform=scale_by_adafactor,
    state_type=ScaleByAdafactorState,
    state_names={
        ScaleByAdafactorState: {
            "count": "step",
            "row_var": "row_var",
            "col_var": "col_var",
            "variance": "variance",
        }
    },
    kernel=kernels.adafactor,
    kernel_args=(
        PARAMS, GRADS, state("row_var", shape=row_var_shape),
        state("col_var", shape=col_var_shape), state("variance", shape=variance_shape),
        state("count"), "d", LR, "beta2_decay", "weight_decay", "eps1", "eps2", "maximize",
        IMPL,
    ),
    check_inputs=check_real,
    functional=FunctionalAdafactor,
)  # fmt: skip
