"""JAX-style functional optimizers for PyTorch.

Layers: pure kernels (:mod:`functional_optim.kernels`); an optax-like ``GradientTransformation``
API over optree pytrees (transforms, schedules and the eight torch.optim algorithms as aliases);
TorchScript functional optimizers; and :class:`Optimizer`, which runs any transform as a
``torch.optim.Optimizer``.

Example::

    >>> import functional_optim as fo
    >>> tx = fo.adam(lr=1e-3)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)   # pure, differentiable
    >>> params = fo.apply_updates(params, updates)
    >>> state = tx.step(params, grads, state)              # fused kernel, in place

Every public name is imported below, explicitly, so type checkers and IDEs see the whole
surface (``__all__``). The one dynamic path is the module ``__getattr__`` at the end: the parts
of an algorithm added at run time by :func:`register_algorithm` (a plugin) are reachable as
``fo.<name>`` through it (see :mod:`functional_optim._registration`).
"""

from typing import TYPE_CHECKING

from functional_optim import _registration, kernels
from functional_optim._aliases.adafactor import adafactor
from functional_optim._aliases.adam import adam, adamw
from functional_optim._aliases.adam_variants import nadam, radam
from functional_optim._aliases.adaptive import adadelta, adagrad, adamax
from functional_optim._aliases.asgd import asgd
from functional_optim._aliases.lbfgs import lbfgs, scale_by_lbfgs
from functional_optim._aliases.lowbit import adam8bit, adamw4bit, adamw8bit, adamw_fp8, lion8bit
from functional_optim._aliases.muon import muon
from functional_optim._aliases.optax_adaptive import (
    adabelief,
    adan,
    amsgrad,
    lamb,
    nadamw,
    novograd,
    yogi,
)
from functional_optim._aliases.optax_schedule_free import schedule_free_adamw, schedule_free_sgd
from functional_optim._aliases.optax_sgd import fromage, lars, lion, noisy_sgd, sign_sgd, sm3
from functional_optim._aliases.rms import rmsprop, rprop
from functional_optim._aliases.sgd import sgd
from functional_optim._aliases.sparse_adam import sparse_adam
from functional_optim._base import (
    EmptyState,
    GradientTransformation,
    InitFn,
    OptState,
    StepFn,
    UpdateFn,
    apply_updates,
    chain,
    identity,
)
from functional_optim._lists import LeafView, ListTransform
from functional_optim._lowbit.transform import quantized_state
from functional_optim._optimizer import Optimizer
from functional_optim._pure_step import PureStepFn, pure_step
from functional_optim._recipes import transform_factory
from functional_optim._registration import (
    on_algorithm_registered,
    register_algorithm,
    unregister_algorithm,
)
from functional_optim._registry import ALGORITHMS, Algorithm, AlgorithmTable, Hyperparam
from functional_optim._schedules import (
    constant_schedule,
    cosine_decay_schedule,
    cosine_onecycle_schedule,
    exponential_decay,
    join_schedules,
    linear_onecycle_schedule,
    linear_schedule,
    piecewise_constant_schedule,
    piecewise_interpolate_schedule,
    polynomial_schedule,
    sgdr_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from functional_optim._torch_state import from_torch_state, to_torch_state
from functional_optim._transforms.adafactor import ScaleByAdafactorState, scale_by_adafactor
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
from functional_optim._transforms.apply_if_finite import ApplyIfFiniteState, apply_if_finite
from functional_optim._transforms.asgd import ScaleByAsgdState, scale_by_asgd
from functional_optim._transforms.clip import clip, clip_by_block_rms, clip_by_global_norm
from functional_optim._transforms.hyperparams import InjectHyperparamsState, inject_hyperparams
from functional_optim._transforms.lbfgs import LbfgsState
from functional_optim._transforms.lion import ScaleByLionState, scale_by_lion
from functional_optim._transforms.lookahead import LookaheadParams, LookaheadState, lookahead
from functional_optim._transforms.masking import (
    MaskedState,
    MultiTransformState,
    freeze,
    masked,
    multi_transform,
)
from functional_optim._transforms.momentum import TraceState, trace
from functional_optim._transforms.multi_steps import MultiSteps, MultiStepsState, skip_not_finite
from functional_optim._transforms.muon import ScaleByMuonState, scale_by_muon
from functional_optim._transforms.optax_adam import (
    ScaleByAmsgradState,
    scale_by_amsgrad,
    scale_by_optax_adam,
)
from functional_optim._transforms.optax_adaptive import (
    ScaleByAdanState,
    ScaleByBeliefState,
    ScaleByYogiState,
    scale_by_adan,
    scale_by_belief,
    scale_by_yogi,
)
from functional_optim._transforms.optax_layerwise import (
    ScaleByNovogradState,
    ScaleBySM3State,
    scale_by_novograd,
    scale_by_sm3,
)
from functional_optim._transforms.optax_misc import (
    AddNoiseState,
    EmaState,
    ZeroNansState,
    add_noise,
    centralize,
    ema,
    keep_params_nonnegative,
    scale_by_sign,
    scale_by_trust_ratio,
    set_to_zero,
    zero_nans,
)
from functional_optim._transforms.per_matrix import PerMatrixState, per_matrix
from functional_optim._transforms.rms import (
    ScaleByAdadeltaState,
    ScaleByAdagradState,
    ScaleByRmsState,
    scale_by_adadelta,
    scale_by_adagrad,
    scale_by_rms,
)
from functional_optim._transforms.rprop import ScaleByRpropState, scale_by_rprop
from functional_optim._transforms.scale import (
    ScaleByScheduleState,
    Schedule,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
)
from functional_optim._transforms.schedule_free import (
    ScaleByRmsWithCountState,
    ScheduleFreeState,
    scale_by_rms_debiased,
    schedule_free,
    schedule_free_eval_params,
)
from functional_optim._transforms.sparse_adam import ScaleBySparseAdamState, scale_by_sparse_adam
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim._tree import (
    tree_add,
    tree_global_norm,
    tree_map,
    tree_scale,
    tree_sub,
    tree_zeros_like,
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
    "AddNoiseState",
    "Algorithm",
    "AlgorithmTable",
    "ApplyIfFiniteState",
    "EmaState",
    "EmptyState",
    "FunctionalASGD",
    "FunctionalAdadelta",
    "FunctionalAdafactor",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdamax",
    "FunctionalMuon",
    "FunctionalNAdam",
    "FunctionalRAdam",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
    "GradientTransformation",
    "Hyperparam",
    "InitFn",
    "InjectHyperparamsState",
    "LbfgsState",
    "LeafView",
    "ListTransform",
    "LookaheadParams",
    "LookaheadState",
    "MaskedState",
    "MultiSteps",
    "MultiStepsState",
    "MultiTransformState",
    "OptState",
    "Optimizer",
    "PerMatrixState",
    "PureStepFn",
    "ScaleByAdadeltaState",
    "ScaleByAdafactorState",
    "ScaleByAdagradState",
    "ScaleByAdamState",
    "ScaleByAdamaxState",
    "ScaleByAdanState",
    "ScaleByAmsgradState",
    "ScaleByAsgdState",
    "ScaleByBeliefState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScaleByNadamState",
    "ScaleByNovogradState",
    "ScaleByRadamState",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "ScaleByRpropState",
    "ScaleBySM3State",
    "ScaleByScheduleState",
    "ScaleBySparseAdamState",
    "ScaleByYogiState",
    "Schedule",
    "ScheduleFreeState",
    "StepFn",
    "TraceState",
    "UpdateFn",
    "ZeroNansState",
    "adabelief",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adam8bit",
    "adamax",
    "adamw",
    "adamw4bit",
    "adamw8bit",
    "adamw_fp8",
    "adan",
    "add_decayed_weights",
    "add_noise",
    "amsgrad",
    "apply_if_finite",
    "apply_updates",
    "asgd",
    "centralize",
    "chain",
    "clip",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "cosine_onecycle_schedule",
    "ema",
    "exponential_decay",
    "freeze",
    "from_torch_state",
    "fromage",
    "identity",
    "inject_hyperparams",
    "join_schedules",
    "keep_params_nonnegative",
    "kernels",
    "lamb",
    "lars",
    "lbfgs",
    "linear_onecycle_schedule",
    "linear_schedule",
    "lion",
    "lion8bit",
    "lookahead",
    "masked",
    "multi_transform",
    "muon",
    "nadam",
    "nadamw",
    "noisy_sgd",
    "novograd",
    "on_algorithm_registered",
    "per_matrix",
    "piecewise_constant_schedule",
    "piecewise_interpolate_schedule",
    "polynomial_schedule",
    "pure_step",
    "quantized_state",
    "radam",
    "register_algorithm",
    "rmsprop",
    "rprop",
    "scale",
    "scale_by_adadelta",
    "scale_by_adafactor",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_adamax",
    "scale_by_adan",
    "scale_by_amsgrad",
    "scale_by_asgd",
    "scale_by_belief",
    "scale_by_lbfgs",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_muon",
    "scale_by_nadam",
    "scale_by_novograd",
    "scale_by_optax_adam",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_rms_debiased",
    "scale_by_rprop",
    "scale_by_schedule",
    "scale_by_sign",
    "scale_by_sm3",
    "scale_by_sparse_adam",
    "scale_by_trust_ratio",
    "scale_by_yogi",
    "schedule_free",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "set_to_zero",
    "sgd",
    "sgdr_schedule",
    "sign_sgd",
    "skip_not_finite",
    "sm3",
    "sparse_adam",
    "to_torch_state",
    "trace",
    "transform_factory",
    "tree_add",
    "tree_global_norm",
    "tree_map",
    "tree_scale",
    "tree_sub",
    "tree_zeros_like",
    "unregister_algorithm",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "yogi",
    "zero_nans",
]

if not TYPE_CHECKING:  # run time only: static tools keep flagging unknown names

    def __getattr__(name: str) -> object:
        """The alias, transform, state type or ``FunctionalX`` class of an algorithm added at
        run time by :func:`register_algorithm` (they are not in ``__all__``)."""
        return _registration.runtime_export(name)

    def __dir__() -> list[str]:
        return sorted({*globals(), *_registration.runtime_export_names()})
