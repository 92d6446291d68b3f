"""dist_runtime.partition: torch ZeRO's sorted-greedy plan as a pure function."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.partition import argmin_rank, assign_ranks, rank_loads, sorted_greedy_partition

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO


def torch_plan(group_sizes: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """torch's own ``_partition_parameters`` on tensors of the given sizes (no process group)."""
    zero = object.__new__(TorchZeRO)  # only the partitioning state, no __init__
    groups = [{"params": [torch.empty(size) for size in sizes]} for sizes in group_sizes]
    zero.param_groups = groups
    zero.world_size = world_size
    zero._partition_parameters_cache = []
    partition = zero._partition_parameters()
    plan: list[list[list[int]]] = []
    for g, group in enumerate(groups):
        position = {id(p): i for i, p in enumerate(group["params"])}
        plan.append(
            [[position[id(p)] for p in partition[r][g]["params"]] for r in range(world_size)]
        )
    return plan


group_sizes_strategy = st.lists(
    st.lists(st.integers(min_value=0, max_value=64), max_size=12), min_size=1, max_size=4
)


def test_docstring_example() -> None:
    assert sorted_greedy_partition([[9, 7, 5, 3]], 2) == [[[0, 3], [1, 2]]]


def test_torch_sharding_example() -> None:
    """torch's test_sharding: sizes [9, 7, 5, 3] * world_size give each rank sum(sizes)."""
    for world_size in (2, 3, 4):
        sizes = [9, 7, 5, 3] * world_size
        plan = sorted_greedy_partition([sizes], world_size)
        assert rank_loads([sizes], plan) == [sum([9, 7, 5, 3])] * world_size


@settings(max_examples=150)
@given(group_sizes=group_sizes_strategy, world_size=st.integers(min_value=1, max_value=5))
def test_equals_torch_assignment(group_sizes: list[list[int]], world_size: int) -> None:
    assert sorted_greedy_partition(group_sizes, world_size) == torch_plan(group_sizes, world_size)


@settings(max_examples=150)
@given(group_sizes=group_sizes_strategy, world_size=st.integers(min_value=1, max_value=5))
def test_invariants(group_sizes: list[list[int]], world_size: int) -> None:
    plan = sorted_greedy_partition(group_sizes, world_size)
    assert len(plan) == len(group_sizes)
    owners = assign_ranks(plan)  # raises if an index is missing or repeated
    for sizes, per_rank, group_owners in zip(group_sizes, plan, owners):
        assert len(per_rank) == world_size
        assert len(group_owners) == len(sizes)
        for rank, indices in enumerate(per_rank):
            # Largest first; equal sizes keep registration order (stable sort).
            keys = [(-sizes[i], i) for i in indices]
            assert keys == sorted(keys)
            assert all(group_owners[i] == rank for i in indices)
    # Greedy bound: the spread of the loads never exceeds the largest parameter.
    loads = rank_loads(group_sizes, plan)
    largest = max((s for sizes in group_sizes for s in sizes), default=0)
    assert max(loads) - min(loads) <= largest
    assert sum(loads) == sum(map(sum, group_sizes))


@settings(max_examples=50)
@given(group_sizes=group_sizes_strategy, world_size=st.integers(min_value=1, max_value=4))
def test_appending_a_group_keeps_earlier_groups(
    group_sizes: list[list[int]], world_size: int
) -> None:
    """What add_param_group relies on: earlier groups keep their ranks."""
    full = sorted_greedy_partition(group_sizes, world_size)
    assert full[:-1] == sorted_greedy_partition(group_sizes[:-1], world_size)
    # Incremental planning from the loads so far gives the same last group.
    loads = rank_loads(group_sizes[:-1], full[:-1]) if len(group_sizes) > 1 else None
    assert sorted_greedy_partition(group_sizes[-1:], world_size, loads) == full[-1:]


def test_ties_go_to_the_lowest_rank() -> None:
    assert sorted_greedy_partition([[1, 1, 1, 1, 1]], 3) == [[[0, 3], [1, 4], [2]]]
    assert sorted_greedy_partition([[0, 0]], 2) == [[[0, 1], []]]  # loads stay equal
    assert sorted_greedy_partition([[]], 2) == [[[], []]]


def test_argmin_rank() -> None:
    assert argmin_rank([3, 1, 1]) == 1
    assert argmin_rank([3, 1, 1], disallowed={1}) == 2
    assert argmin_rank([5]) == 0
    with pytest.raises(ValueError, match="every rank is disallowed"):
        argmin_rank([1, 2], disallowed={0, 1})
    with pytest.raises(ValueError, match="every rank is disallowed"):
        argmin_rank([])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        sorted_greedy_partition([[1]], 0)
    with pytest.raises(ValueError, match="non-negative"):
        sorted_greedy_partition([[1, -1]], 2)
    with pytest.raises(ValueError, match="initial_loads has 1 entries"):
        sorted_greedy_partition([[1]], 2, [0])
    with pytest.raises(ValueError, match="assigned twice"):
        assign_ranks([[[0], [0]]])
