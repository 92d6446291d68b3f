"""dist_runtime.process_group: group resolution, rank mapping and object collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_runtime.process_group import (
    all_gather_objects,
    broadcast_object,
    global_rank,
    group_rank,
    group_size,
    recv_object,
    require_initialized,
    resolve_group,
    send_object,
)
from tests._world import World


def test_uninitialised_default_group_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group\(\.\.\.\) first"):
        require_initialized("ZeroRedundancyOptimizer")
    with pytest.raises(RuntimeError, match="needs the default process group"):
        resolve_group(None)
    with pytest.raises(RuntimeError, match="needs the default process group"):
        group_size()


def _world_worker(rank: int, world_size: int) -> dict[str, Any]:
    assert resolve_group(None) is dist.group.WORLD
    assert group_rank() == rank
    assert group_size() == world_size
    assert [global_rank(None, r) for r in range(world_size)] == list(range(world_size))
    with pytest.raises(ValueError, match="rank 3 is not in a process group of size 3"):
        global_rank(None, 3)
    payload = {"rank": rank, "tensor": torch.arange(3) * rank}
    from_one = broadcast_object(payload if rank == 1 else None, 1)
    gathered = all_gather_objects(rank * 10)
    return {"bcast": from_one["rank"], "tensor": from_one["tensor"].tolist(), "gathered": gathered}


def test_world_group(world3: World) -> None:
    results = world3.run(_world_worker)
    assert results == [{"bcast": 1, "tensor": [0, 1, 2], "gathered": [0, 10, 20]}] * 3


def _subgroup_worker(rank: int, world_size: int) -> list[Any]:
    group = dist.new_group([0, 2])
    if rank == 1:
        assert group_rank(group) == -1  # not a member
        return []
    assert group_size(group) == 2
    assert group_rank(group) == {0: 0, 2: 1}[rank]
    assert [global_rank(group, r) for r in range(2)] == [0, 2]
    with pytest.raises(ValueError, match="not in a process group of size 2"):
        global_rank(group, 2)
    # Sources are group ranks: group rank 1 is global rank 2.
    value = broadcast_object(f"from {rank}", 1, group)
    gathered = all_gather_objects(rank, group)
    return [value, gathered]


def test_subgroup_ranks_are_group_ranks(world3: World) -> None:
    results = world3.run(_subgroup_worker)
    assert results == [["from 2", [0, 2]], [], ["from 2", [0, 2]]]


def _p2p_worker(rank: int, world_size: int) -> Any:
    # Every rank sends its object to rank 0, which receives them in rank order.
    if rank == 0:
        return [recv_object(src) for src in range(1, world_size)]
    send_object({"rank": rank, "t": torch.full((2,), float(rank))}, 0)
    return None


def test_send_recv_object(world3: World) -> None:
    results = world3.run(_p2p_worker)
    received = results[0]
    assert [r["rank"] for r in received] == [1, 2]
    assert [r["t"].tolist() for r in received] == [[1.0, 1.0], [2.0, 2.0]]
    assert results[1:] == [None, None]
