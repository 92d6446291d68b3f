"""Drop-in replacements for :mod:`torch.distributed.optim` (torch 2.13).

Swap ``torch.distributed.optim`` for ``compat_api`` (and ``torch.distributed.algorithms`` for
``compat_api.algorithms``); constructors, methods, exceptions and numerics are torch's.
"""

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
