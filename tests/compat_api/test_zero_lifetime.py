"""A ZeroRedundancyOptimizer is freed as soon as its last reference goes, like torch's.

A reference cycle would leave it (and its process-group work) to a later GC pass, which at
interpreter exit may run after the process group is gone and abort the process.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from compat_api import ZeroRedundancyOptimizer
from tests._world import World


def _freed_on_del(rank: int, world_size: int, kwargs: dict[str, Any]) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, **kwargs)
    model(torch.randn(3, 4)).sum().backward()
    zero.step()
    zero.consolidate_state_dict(0)
    ref = weakref.ref(zero)
    gc.disable()
    try:
        del zero
        return ref() is None
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"parameters_as_bucket_view": True}, {"partition": "flat"}],
    ids=["default", "bucket_view", "flat"],
)
def test_optimizer_is_freed_without_gc(world2: World, kwargs: dict[str, Any]) -> None:
    assert world2.run(_freed_on_del, kwargs) == [True, True]
