"""Pure optimizer kernels over flat ``List[Tensor]`` arguments, scriptable by TorchScript.

Each kernel updates the params and state lists it is given in place and touches nothing else.
``impl`` picks the per-tensor (``single``), multi-tensor (``foreach``) or ``fused`` path;
``auto`` (the default) picks the fastest for the device.
"""

from functional_optim.kernels._dispatch import resolve_impl
from functional_optim.kernels.adadelta import adadelta
from functional_optim.kernels.adagrad import adagrad
from functional_optim.kernels.adam import adam
from functional_optim.kernels.adamax import adamax
from functional_optim.kernels.adamw import adamw
from functional_optim.kernels.rmsprop import rmsprop
from functional_optim.kernels.rprop import rprop
from functional_optim.kernels.sgd import sgd

__all__ = [
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "resolve_impl",
    "rmsprop",
    "rprop",
    "sgd",
]
