"""Which classes the examples call "ours" and "torch".

Each example runs the same training twice, once with torch's ``torch.distributed.optim`` classes
and once with ours (``compat_api``), so the two can be compared step by step; every table the
examples print names the module each side's classes come from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as torch_pls_hook
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.optim as torch_optim

import compat_api.algorithms.ddp_comm_hooks.post_localSGD_hook as ours_pls_hook
import compat_api.algorithms.model_averaging.averagers as ours_averagers
import compat_api.optimizer as ours_rpc_optim
import compat_api.post_localSGD_optimizer as ours_pls_optimizer
import compat_api.zero_redundancy_optimizer as ours_zero


@dataclass(frozen=True)
class Implementation:
    """The distributed-optimizer classes one side of a comparison uses."""

    name: str
    ZeroRedundancyOptimizer: type[Any]
    PostLocalSGDState: type[Any]
    post_localSGD_hook: Callable[..., Any]  # noqa: N815 (torch's name)
    PostLocalSGDOptimizer: type[Any]
    PeriodicModelAverager: type[Any]
    DistributedOptimizer: type[Any]

    def source(self, attribute: str) -> str:
        """Return the module that provides ``attribute``."""
        return str(getattr(self, attribute).__module__)


TORCH = Implementation(
    name="torch",
    ZeroRedundancyOptimizer=torch_optim.ZeroRedundancyOptimizer,
    PostLocalSGDState=torch_pls_hook.PostLocalSGDState,
    post_localSGD_hook=torch_pls_hook.post_localSGD_hook,
    PostLocalSGDOptimizer=torch_optim.PostLocalSGDOptimizer,
    PeriodicModelAverager=torch_averagers.PeriodicModelAverager,
    DistributedOptimizer=torch_optim.DistributedOptimizer,
)

OURS = Implementation(
    name="ours",
    ZeroRedundancyOptimizer=ours_zero.ZeroRedundancyOptimizer,
    PostLocalSGDState=ours_pls_hook.PostLocalSGDState,
    post_localSGD_hook=ours_pls_hook.post_localSGD_hook,
    PostLocalSGDOptimizer=ours_pls_optimizer.PostLocalSGDOptimizer,
    PeriodicModelAverager=ours_averagers.PeriodicModelAverager,
    DistributedOptimizer=ours_rpc_optim.DistributedOptimizer,
)

IMPLEMENTATIONS = {"torch": TORCH, "ours": OURS}
