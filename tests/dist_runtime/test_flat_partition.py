"""dist_runtime.flat_partition: balance and coverage invariants of the flat layout (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.flat_partition import (
    FlatSlice,
    group_by_key,
    plan_flat_layout,
    shard_numels,
)

numels_strategy = st.lists(
    st.one_of(st.integers(0, 40), st.integers(1000, 100_000)), min_size=0, max_size=40
)


@settings(max_examples=200)
@given(numels=numels_strategy, world_size=st.integers(1, 9))
def test_balance_and_coverage(numels: list[int], world_size: int) -> None:
    layout = plan_flat_layout(numels, world_size)
    total = sum(numels)
    # Balance: every shard has shard_size slots, within one element of total / world_size.
    assert abs(layout.shard_size - total / world_size) < 1
    assert layout.padded_size - total < world_size
    per_rank = shard_numels(layout)
    assert sum(per_rank) == total
    assert all(n <= layout.shard_size for n in per_rank)
    # Only the tail carries padding: full shards first, then the remainder, then empties.
    assert per_rank == sorted(per_rank, reverse=True)
    assert sum(1 for n in per_rank if 0 < n < layout.shard_size) <= 1
    # Coverage: every element of every parameter is in exactly one slice, at the right offset.
    seen: dict[int, list[tuple[int, int]]] = {}
    for rank, slices in enumerate(layout.slices):
        begin, end = layout.shard_range(rank)
        for s in slices:
            assert s.numel > 0
            assert begin <= s.offset
            assert s.offset + s.numel <= end
            assert s.offset == layout.offsets[s.param_index] + s.start
            seen.setdefault(s.param_index, []).append((s.start, s.stop))
    for index, n in enumerate(numels):
        ranges = sorted(seen.get(index, []))
        position = 0
        for start, stop in ranges:
            assert start == position
            position = stop
        assert position == n
    # A parameter straddles at most ceil(n / shard_size) + 1 shards.
    for index, ranges in seen.items():
        assert len(ranges) <= -(-numels[index] // layout.shard_size) + 1


def test_example_straddles() -> None:
    layout = plan_flat_layout([5, 2], 2)
    assert layout.shard_size == 4
    assert layout.slices == (
        (FlatSlice(0, 0, 4, 0),),
        (FlatSlice(0, 4, 5, 4), FlatSlice(1, 0, 2, 5)),
    )
    assert shard_numels(layout) == [4, 3]


def test_empty_and_errors() -> None:
    layout = plan_flat_layout([], 3)
    assert layout.shard_size == 0
    assert layout.slices == ((), (), ())
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        plan_flat_layout([1], 0)
    with pytest.raises(ValueError, match="non-negative"):
        plan_flat_layout([1, -1], 2)


def test_group_by_key_keeps_first_appearance_order() -> None:
    assert group_by_key(["b", "a", "b", "c", "a"]) == {"b": [0, 2], "a": [1, 4], "c": [3]}
