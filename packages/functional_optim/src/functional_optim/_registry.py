"""One entry per torch.optim algorithm: the single place a new algorithm is declared.

Each :class:`Algorithm` names the torch class it mirrors and every layer that implements it:
the kernel and its argument order, the state transform and its state type (with torch's
per-param state keys), the alias (hand-written, or generated from its declared hyperparameters,
:class:`Hyperparam`, and a ``chain`` builder) and, when its update is TorchScript-able, the
``FunctionalX`` class. From :data:`ALGORITHMS`:

* every alias's fused ``step`` runs the declared kernel arguments
  (:mod:`functional_optim._aliases._kernel_step`; the aliases name their entry in ``fused``);
* ``functional_optim._torch_state`` takes torch's state names (``state_names``);
* ``compat_api.utils.functional_optim_map`` maps ``torch.optim.<torch_name>`` to ``functional``
  (``on_algorithm_registered``);
* the parity tests (tests/functional_optim/_alias_registry.py) run every entry against torch
  and draw every hyperparameter of ``alias`` with Hypothesis.

Adding an algorithm: write the kernel (``kernels/x.py``) and, if none fits, the transform
(``_transforms``); add one entry to :data:`BUILTIN_ALGORITHMS`; then import its parts in the
package ``__init__`` (and the kernel in ``kernels/__init__``, the ``FunctionalX`` class in
``functional/__init__``): the exports are static, and tests/functional_optim/test_registry.py
fails for a part that is not exported. ``register_algorithm`` adds one at run time
(:mod:`functional_optim._registration`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import overload

from functional_optim import kernels
from functional_optim._algorithm import Algorithm, Hyperparam
from functional_optim._aliases._kernel_step import (
    GRADS,
    IMPL,
    LR,
    PARAMS,
    SPECS,
    KernelArg,
    state,
)
from functional_optim._aliases.adafactor import adafactor
from functional_optim._aliases.adam import adam, adamw
from functional_optim._aliases.adam_variants import nadam, radam
from functional_optim._aliases.adaptive import adadelta, adagrad, adamax
from functional_optim._aliases.asgd import asgd
from functional_optim._aliases.lbfgs import lbfgs, scale_by_lbfgs
from functional_optim._aliases.muon import muon
from functional_optim._aliases.rms import rmsprop, rprop
from functional_optim._aliases.sgd import sgd
from functional_optim._aliases.sparse_adam import sparse_adam
from functional_optim._transforms.adafactor import (
    ScaleByAdafactorState,
    check_real,
    col_var_shape,
    row_var_shape,
    scale_by_adafactor,
    variance_shape,
)
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
from functional_optim._transforms.asgd import ScaleByAsgdState, scale_by_asgd
from functional_optim._transforms.lbfgs import LbfgsState
from functional_optim._transforms.momentum import TraceState, trace
from functional_optim._transforms.muon import ScaleByMuonState, check_muon_inputs, scale_by_muon
from functional_optim._transforms.rms import (
    ScaleByAdadeltaState,
    ScaleByAdagradState,
    ScaleByRmsState,
    scale_by_adadelta,
    scale_by_adagrad,
    scale_by_rms,
)
from functional_optim._transforms.rprop import ScaleByRpropState, scale_by_rprop
from functional_optim._transforms.sparse_adam import (
    DENSE_GRAD_MESSAGE,
    ScaleBySparseAdamState,
    scale_by_sparse_adam,
)
from functional_optim.functional import (
    FunctionalAdadelta,
    FunctionalAdafactor,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalASGD,
    FunctionalMuon,
    FunctionalNAdam,
    FunctionalRAdam,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
)

__all__ = [
    "ALGORITHMS",
    "BUILTIN_ALGORITHMS",
    "BY_NAME",
    "TORCH_STATE_NAMES",
    "Algorithm",
    "AlgorithmTable",
    "Hyperparam",
    "add",
    "by_torch_name",
    "merged_state_names",
    "remove",
    "torch_state_names",
]

_ADAM_NAMES: Mapping[str, str] = {
    "count": "step",
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "nu_max": "max_exp_avg_sq",
}
_TRACE_NAMES: dict[type, Mapping[str, str]] = {TraceState: {"momentum_buffer": "momentum_buffer"}}
#: torch.optim.Adam's message, which AdamW (its subclass) shares.
_ADAM_SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"
_ADAM_ARGS: tuple[KernelArg, ...] = (
    PARAMS, GRADS, state("mu"), state("nu"), state("nu_max", when="amsgrad"), state("count"),
    "amsgrad", "b1", "b2", LR, "weight_decay", "eps", "maximize", IMPL,
)  # fmt: skip


#: The algorithms the package ships; torch's eight first, in the order of torch's
#: ``functional_optim_map``.
BUILTIN_ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm(
        name="adagrad",
        torch_name="Adagrad",
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
    ),
    Algorithm(
        name="adam",
        torch_name="Adam",
        alias=adam,
        transform=scale_by_adam,
        state_type=ScaleByAdamState,
        state_names={ScaleByAdamState: _ADAM_NAMES},
        kernel=kernels.adam,
        kernel_args=_ADAM_ARGS,
        functional=FunctionalAdam,
        has_fused=True,
        sparse_message=_ADAM_SPARSE,
    ),
    Algorithm(
        name="adamw",
        torch_name="AdamW",
        alias=adamw,
        transform=scale_by_adam,
        state_type=ScaleByAdamState,
        state_names={ScaleByAdamState: _ADAM_NAMES},
        kernel=kernels.adamw,
        kernel_args=_ADAM_ARGS,
        functional=FunctionalAdamW,
        has_fused=True,
        sparse_message=_ADAM_SPARSE,
    ),
    Algorithm(
        name="sgd",
        torch_name="SGD",
        alias=sgd,
        transform=trace,
        state_type=TraceState,
        state_names=_TRACE_NAMES,
        kernel=kernels.sgd,
        kernel_args=(
            PARAMS, GRADS, state("momentum_buffer", when="momentum", fill="kernel"),
            LR, "momentum", "dampening", "weight_decay", "nesterov", "maximize", IMPL,
        ),
        functional=FunctionalSGD,
        has_fused=True,
        takes_sparse=True,
        promotes=True,
    ),
    Algorithm(
        name="adadelta",
        torch_name="Adadelta",
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
    ),
    Algorithm(
        name="rmsprop",
        torch_name="RMSprop",
        alias=rmsprop,
        transform=scale_by_rms,
        state_type=ScaleByRmsState,
        state_names={
            ScaleByRmsState: {"count": "step", "nu": "square_avg", "mu": "grad_avg"},
            **_TRACE_NAMES,
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
    ),
    Algorithm(
        name="rprop",
        torch_name="Rprop",
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
    ),
    Algorithm(
        name="adamax",
        torch_name="Adamax",
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
    ),
    Algorithm(
        name="nadam",
        torch_name="NAdam",
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
    ),
    Algorithm(
        name="radam",
        torch_name="RAdam",
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
    ),
    Algorithm(
        name="asgd",
        torch_name="ASGD",
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
    ),
    Algorithm(
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
    ),
    Algorithm(
        name="muon",
        torch_name="Muon",
        alias=muon,
        transform=scale_by_muon,
        state_type=ScaleByMuonState,
        state_names={ScaleByMuonState: {"momentum_buffer": "momentum_buffer"}},
        kernel=kernels.muon,
        kernel_args=(
            PARAMS, GRADS, state("momentum_buffer"), LR, "weight_decay", "momentum",
            "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn", IMPL,
        ),
        check_inputs=check_muon_inputs,
        functional=FunctionalMuon,
    ),
    Algorithm(
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
    ),
    Algorithm(
        name="lbfgs",
        torch_name="LBFGS",
        alias=lbfgs,
        transform=scale_by_lbfgs,
        state_type=LbfgsState,
        state_names={LbfgsState: {"memory": "memory"}},
        needs_closure=True,
    ),
)  # fmt: skip


class AlgorithmTable(Sequence[Algorithm]):
    """The registered algorithms in order: the built-in ones, then those added at run time.

    A read-only, live view: there is one table for the whole run, so ``fo.ALGORITHMS`` is bound
    once (statically, in the package ``__init__``) and still lists an algorithm added later by
    ``register_algorithm``. Only :func:`add` and :func:`remove` change it. Take ``tuple(table)``
    for a snapshot.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Iterable[Algorithm]) -> None:
        self._entries: list[Algorithm] = list(entries)

    @overload
    def __getitem__(self, index: int) -> Algorithm: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Algorithm, ...]: ...

    def __getitem__(self, index: int | slice) -> Algorithm | tuple[Algorithm, ...]:
        if isinstance(index, slice):
            return tuple(self._entries[index])
        return self._entries[index]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Algorithm]:
        return iter(tuple(self._entries))

    def __repr__(self) -> str:
        return f"AlgorithmTable({[a.name for a in self._entries]})"


#: Every registered algorithm (:data:`BUILTIN_ALGORITHMS`, then the run-time ones).
ALGORITHMS: AlgorithmTable = AlgorithmTable(BUILTIN_ALGORITHMS)

#: The entries by alias name.
BY_NAME: dict[str, Algorithm] = {a.name: a for a in ALGORITHMS}


def by_torch_name(torch_name: str) -> Algorithm:
    """Return the entry for ``torch.optim.<torch_name>``.

    Raises:
        KeyError: if no entry mirrors that class.
    """
    for algorithm in ALGORITHMS:
        if algorithm.torch_name == torch_name:
            return algorithm
    raise KeyError(f"no functional_optim algorithm mirrors torch.optim.{torch_name}")


def merged_state_names(algorithms: Iterable[Algorithm]) -> dict[type, dict[str, str]]:
    """State type -> (field -> torch's per-param state key), merged over ``algorithms``.

    Raises:
        ValueError: if two entries give one state type different names.
    """
    merged: dict[type, dict[str, str]] = {}
    for algorithm in algorithms:
        for state_type, names in algorithm.state_names.items():
            known = merged.setdefault(state_type, dict(names))
            if known != dict(names):
                raise ValueError(
                    f"{algorithm.name}: torch state names of {state_type.__name__} conflict "
                    f"with another entry ({names} vs {known})"
                )
    return merged


def torch_state_names() -> dict[type, dict[str, str]]:
    """:func:`merged_state_names` over every registered entry."""
    return merged_state_names(ALGORITHMS)


#: The merged state names of the registered entries, kept current by :func:`add` and
#: :func:`remove`; ``_torch_state`` reads it.
TORCH_STATE_NAMES: dict[type, dict[str, str]] = torch_state_names()
for _algorithm in ALGORITHMS:
    if _algorithm.kernel_spec is not None:
        SPECS[_algorithm.name] = _algorithm.kernel_spec


def _refresh_state_names() -> None:
    TORCH_STATE_NAMES.clear()
    TORCH_STATE_NAMES.update(torch_state_names())


def add(algorithm: Algorithm) -> None:
    """Append ``algorithm`` to every table built from the registry (no checks: see
    ``_registration.register_algorithm``, which checks first)."""
    ALGORITHMS._entries.append(algorithm)
    BY_NAME[algorithm.name] = algorithm
    spec = algorithm.kernel_spec
    if spec is not None:
        SPECS[algorithm.name] = spec
    _refresh_state_names()


def remove(algorithm: Algorithm) -> None:
    """Undo :func:`add`."""
    ALGORITHMS._entries.remove(algorithm)
    BY_NAME.pop(algorithm.name, None)
    SPECS.pop(algorithm.name, None)
    _refresh_state_names()
