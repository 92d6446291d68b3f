"""The multi-process harness itself: results by rank, errors surface, collectives time out."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._world import World, WorldError


def _all_reduce_rank(rank: int, world_size: int, scale: float) -> float:
    tensor = torch.tensor([float(rank) * scale])
    dist.all_reduce(tensor)
    return float(tensor.item())


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.distributed
def test_world_runs_collectives_and_reports_errors() -> None:
    with World(2, collective_timeout_s=20) as world:
        assert world.run(_all_reduce_rank, 2.0) == [2.0, 2.0]
        with pytest.raises(WorldError, match="boom on rank 1"):
            world.run(_fail_on_rank_one)
        # The world survives a Python error on one rank.
        assert world.run_on([0], _fail_on_rank_one) == [0]
