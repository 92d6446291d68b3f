"""The built-in entries of the per-coordinate adaptive family: Adagrad, Adadelta, RMSprop,
Rprop and Adafactor."""

from __future__ import annotations

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._aliases.adafactor import adafactor
from functional_optim._aliases.adaptive import adadelta, adagrad
from functional_optim._aliases.rms import rmsprop, rprop
from functional_optim._builtin_algorithms.sgd import TRACE_NAMES
from functional_optim._transforms.adafactor import (
    ScaleByAdafactorState,
    check_real,
    col_var_shape,
    row_var_shape,
    scale_by_adafactor,
    variance_shape,
)
from functional_optim._transforms.momentum import TraceState
from functional_optim._transforms.rms import (
    ScaleByAdadeltaState,
    ScaleByAdagradState,
    ScaleByRmsState,
    scale_by_adadelta,
    scale_by_adagrad,
    scale_by_rms,
)
from functional_optim._transforms.rprop import ScaleByRpropState, scale_by_rprop
from functional_optim.functional import (
    FunctionalAdadelta,
    FunctionalAdafactor,
    FunctionalAdagrad,
    FunctionalRMSprop,
    FunctionalRprop,
)

__all__ = ["ADADELTA", "ADAFACTOR", "ADAGRAD", "RMSPROP", "RPROP"]

#: The entry mirroring torch.optim.Adagrad.
ADAGRAD = Algorithm(
    name="adagrad",
    torch_name="Adagrad",
    elementwise=True,
    alias=adagrad,
    transform=scale_by_adagrad,
    state_type=ScaleByAdagradState,
    state_names={ScaleByAdagradState: {"count": "step", "sum_of_squares": "sum"}},
    kernel=kernels.adagrad,
    kernel_args=(
        PARAMS, GRADS, state("sum_of_squares"), state("count"),
        LR, "weight_decay", "lr_decay", "eps", "maximize", IMPL,
    ),
    functional=FunctionalAdagrad,
    has_fused=True,
    takes_sparse=True,
    promotes=True,
)  # fmt: skip

#: The entry mirroring torch.optim.Adadelta.
ADADELTA = Algorithm(
    name="adadelta",
    torch_name="Adadelta",
    elementwise=True,
    alias=adadelta,
    transform=scale_by_adadelta,
    state_type=ScaleByAdadeltaState,
    state_names={
        ScaleByAdadeltaState: {"count": "step", "nu": "square_avg", "acc_delta": "acc_delta"}
    },
    kernel=kernels.adadelta,
    kernel_args=(
        PARAMS, GRADS, state("nu"), state("acc_delta"), state("count"),
        LR, "rho", "eps", "weight_decay", "maximize", IMPL,
    ),
    functional=FunctionalAdadelta,
    promotes=True,
)  # fmt: skip

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
