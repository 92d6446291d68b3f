"""Pure optimizer kernels over flat ``List[Tensor]`` arguments, scriptable by TorchScript.

Each kernel updates the params and state lists it is given in place and touches nothing else.
``impl`` picks the per-tensor (``single``), multi-tensor (``foreach``) or ``fused`` path;
``auto`` (the default) picks the fastest for the device.
"""

from functional_optim.kernels._dispatch import resolve_impl
from functional_optim.kernels.adadelta import adadelta, adadelta_foreach, adadelta_single
from functional_optim.kernels.adagrad import (
    adagrad,
    adagrad_foreach,
    adagrad_fused,
    adagrad_single,
)
from functional_optim.kernels.adam import adam
from functional_optim.kernels.adamax import adamax
from functional_optim.kernels.adamw import adamw
from functional_optim.kernels.rmsprop import rmsprop, rmsprop_foreach, rmsprop_single
from functional_optim.kernels.rprop import rprop, rprop_foreach, rprop_single
from functional_optim.kernels.sgd import sgd

__all__ = [
    "adadelta",
    "adadelta_foreach",
    "adadelta_single",
    "adagrad",
    "adagrad_foreach",
    "adagrad_fused",
    "adagrad_single",
    "adam",
    "adamax",
    "adamw",
    "resolve_impl",
    "rmsprop",
    "rmsprop_foreach",
    "rmsprop_single",
    "rprop",
    "rprop_foreach",
    "rprop_single",
    "sgd",
]
