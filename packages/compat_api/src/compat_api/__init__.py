"""Drop-in replacements for :mod:`torch.distributed.optim` (torch 2.13).

Swap ``torch.distributed.optim`` for ``compat_api`` (and ``torch.distributed.algorithms`` for
``compat_api.algorithms``); constructors, methods, exceptions and numerics are torch's.
The private ``_FunctionalX`` names torch exports (and its ``functional_x`` modules) are here too.
"""

from compat_api.functional_adadelta import _FunctionalAdadelta as _FunctionalAdadelta
from compat_api.functional_adagrad import _FunctionalAdagrad as _FunctionalAdagrad
from compat_api.functional_adam import _FunctionalAdam as _FunctionalAdam
from compat_api.functional_adamax import _FunctionalAdamax as _FunctionalAdamax
from compat_api.functional_adamw import _FunctionalAdamW as _FunctionalAdamW
from compat_api.functional_rmsprop import _FunctionalRMSprop as _FunctionalRMSprop
from compat_api.functional_rprop import _FunctionalRprop as _FunctionalRprop
from compat_api.functional_sgd import _FunctionalSGD as _FunctionalSGD
from compat_api.optimizer import DistributedOptimizer
from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer
from compat_api.utils import as_functional_optim, functional_optim_map, register_functional_optim
from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer

__all__ = [
    "DistributedOptimizer",
    "PostLocalSGDOptimizer",
    "ZeroRedundancyOptimizer",
    "as_functional_optim",
    "functional_optim_map",
    "register_functional_optim",
]
