"""The built-in entries of the Adam family: Adam, AdamW, Adamax, NAdam, RAdam, SparseAdam."""

from __future__ import annotations

from collections.abc import Mapping

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, KernelArg, state
from functional_optim._aliases.adam import adam, adamw
from functional_optim._aliases.adam_variants import nadam, radam
from functional_optim._aliases.adaptive import adamax
from functional_optim._aliases.sparse_adam import sparse_adam
from functional_optim._transforms.adam import (
    ScaleByAdamaxState,
    ScaleByAdamState,
    scale_by_adam,
    scale_by_adamax,
)
from functional_optim._transforms.adam_variants import (
    ScaleByNadamState,
    ScaleByRadamState,
    scale_by_nadam,
    scale_by_radam,
)
from functional_optim._transforms.sparse_adam import (
    DENSE_GRAD_MESSAGE,
    ScaleBySparseAdamState,
    scale_by_sparse_adam,
)
from functional_optim.functional import (
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalNAdam,
    FunctionalRAdam,
)

__all__ = ["ADAM", "ADAMAX", "ADAMW", "NADAM", "RADAM", "SPARSE_ADAM"]

_ADAM_NAMES: Mapping[str, str] = {
    "count": "step",
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
}
#: torch.optim.Adam's message, which AdamW (its subclass) shares.
_ADAM_SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"
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
    sparse_message=_ADAM_SPARSE,
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
    sparse_message=_ADAM_SPARSE,
)  # fmt: skip

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

#: The entry mirroring torch.optim.NAdam.
NADAM = Algorithm(
    name="nadam",
    torch_name="NAdam",
    elementwise=True,
    alias=nadam,
    transform=scale_by_nadam,
    state_type=ScaleByNadamState,
    state_names={
        ScaleByNadamState: {
            "count": "step",
            "mu_product": "mu_product",
            "mu": "exp_avg",
            "nu": "exp_avg_sq",
        }
    },
    kernel=kernels.nadam,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("mu_product", shape="scalar"),
        state("count"),
        "b1", "b2", LR, "weight_decay", "momentum_decay", "eps", "decoupled", "maximize",
        IMPL,
    ),
    functional=FunctionalNAdam,
)  # fmt: skip

#: The entry mirroring torch.optim.RAdam.
RADAM = Algorithm(
    name="radam",
    torch_name="RAdam",
    elementwise=True,
    alias=radam,
    transform=scale_by_radam,
    state_type=ScaleByRadamState,
    state_names={ScaleByRadamState: {"count": "step", "mu": "exp_avg", "nu": "exp_avg_sq"}},
    kernel=kernels.radam,
    kernel_args=(
        PARAMS, GRADS, state("mu"), state("nu"), state("count"),
        "b1", "b2", LR, "weight_decay", "eps", "decoupled", "maximize", IMPL,
    ),
    functional=FunctionalRAdam,
)  # fmt: skip

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
