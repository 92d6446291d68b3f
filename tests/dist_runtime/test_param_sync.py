"""dist_runtime.param_sync: chunk planning (pure) and shard broadcasts in a 3-rank gloo world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_runtime.param_sync import ShardBroadcaster, broadcast_buckets, plan_chunks
from tests._world import World

# -- planning (pure) ------------------------------------------------------------------------------


def test_plan_chunks_examples() -> None:
    # Big contiguous tensors go alone; small ones are packed in order (across the big ones).
    chunks = plan_chunks([10, 1, 1, 10, 1], [True] * 5, direct_min_bytes=8, bucket_cap_bytes=4)
    assert chunks == [[0], [3], [1, 2, 4]]
    # A big non-contiguous tensor is packed (it cannot be sent in place).
    assert plan_chunks([10, 1], [False, True], direct_min_bytes=8, bucket_cap_bytes=64) == [[0, 1]]
    # Packs close when the cap would be exceeded; an oversized small tensor gets its own pack.
    assert plan_chunks([3, 3, 3, 9], [False] * 4, direct_min_bytes=100, bucket_cap_bytes=6) == [
        [0, 1],
        [2],
        [3],
    ]
    assert plan_chunks([], []) == []


@settings(max_examples=100)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=30),
    direct=st.integers(1, 40),
    cap=st.integers(1, 60),
)
def test_plan_chunks_invariants(sizes: list[tuple[int, bool]], direct: int, cap: int) -> None:
    nbytes = [s for s, _ in sizes]
    contiguous = [c for _, c in sizes]
    chunks = plan_chunks(nbytes, contiguous, direct, cap)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(len(sizes)))
    for chunk in chunks:
        assert chunk == sorted(chunk)
        direct_members = [i for i in chunk if contiguous[i] and nbytes[i] >= direct]
        if direct_members:
            assert chunk == direct_members  # in-place sends travel alone
        elif len(chunk) > 1:
            assert sum(nbytes[i] for i in chunk) <= cap


# -- broadcasting (3 ranks) -----------------------------------------------------------------------


def _shapes() -> list[list[tuple[int, ...]]]:
    """Per owner rank: a mix of big (direct) and small (packed) tensors."""
    return [[(64, 64), (3,), (2, 5)], [(7,), (1,), (4, 4)], [(80, 40)]]


def _params(rank: int, transposed: bool) -> list[list[torch.Tensor]]:
    """Owned tensors hold ``owner * 1000 + position``; the others hold garbage."""
    per_rank = []
    for owner, shapes in enumerate(_shapes()):
        params = []
        for shape in shapes:
            fill = owner * 1000.0 + len(params) if owner == rank else -1.0 - rank
            tensor = torch.full(shape, fill)
            if transposed and len(shape) == 2:
                tensor = tensor.t().contiguous().t()  # same values, non-contiguous layout
            params.append(torch.nn.Parameter(tensor))
        per_rank.append(params)
    return per_rank


def _check(per_rank: list[list[torch.Tensor]]) -> None:
    for owner, params in enumerate(per_rank):
        for position, param in enumerate(params):
            assert torch.equal(param, torch.full(param.shape, owner * 1000.0 + position))


def _sync_worker(rank: int, world_size: int, transposed: bool) -> int:
    per_rank = _params(rank, transposed)
    sync = ShardBroadcaster(per_rank, direct_min_bytes=4096, bucket_cap_bytes=1 << 20)
    sync.sync()
    _check(per_rank)
    # Again, after the owners change their values: the cached pack buffers are refreshed.
    for param in per_rank[rank]:
        with torch.no_grad():
            param.add_(0.5)
    sync.sync()
    for owner, params in enumerate(per_rank):
        for position, param in enumerate(params):
            assert torch.equal(param, torch.full(param.shape, owner * 1000.0 + position + 0.5))
    # And after ``param.data`` is re-pointed at new storage: in-place sends follow it.
    for owner, params in enumerate(per_rank):
        for position, param in enumerate(params):
            fill = owner * 1000.0 + position + 0.25 if owner == rank else -7.0
            param.data = torch.full(param.shape, fill)
    sync.sync()
    for owner, params in enumerate(per_rank):
        for position, param in enumerate(params):
            assert torch.equal(param, torch.full(param.shape, owner * 1000.0 + position + 0.25))
    return sync.num_collectives


def test_shard_broadcaster(world3: World) -> None:
    # rank 0: one direct (64x64) + one pack; rank 1: one pack; rank 2: one direct.
    assert world3.run(_sync_worker, False) == [4, 4, 4]
    # Non-contiguous tensors cannot be sent in place: the big ones get packed too.
    assert world3.run(_sync_worker, True) == [3, 3, 3]


def _start_worker(rank: int, world_size: int) -> bool:
    per_rank = _params(rank, False)
    sync = ShardBroadcaster(per_rank)
    handles = [h for src in range(world_size) for h in sync.start(src)]
    for handle in handles:
        handle.wait()
    _check(per_rank)
    return True


def test_start_handles_complete_the_sync(world3: World) -> None:
    assert world3.run(_start_worker) == [True, True, True]


def _subgroup_worker(rank: int, world_size: int) -> bool:
    group = dist.new_group([0, 2])
    if rank == 1:
        return True
    group_rank = dist.get_rank(group)
    per_rank = _params(group_rank, False)[:2]
    ShardBroadcaster(per_rank, group).sync()
    _check(per_rank)
    buckets = [[torch.full((3,), float(r == group_rank) * (r + 1)) for r in range(2)]]
    for handle in broadcast_buckets(buckets, group):
        handle.wait()
    assert [b.tolist() for b in buckets[0]] == [[1.0] * 3, [2.0] * 3]
    return True


def test_subgroup_uses_group_ranks(world3: World) -> None:
    """On a subgroup, sources are group ranks (global rank 2 is group rank 1)."""
    assert world3.run(_subgroup_worker) == [True, True, True]


def _bucket_worker(rank: int, world_size: int) -> list[list[float]]:
    buckets = [
        [torch.full((2,), float(10 * d + r)) if r == rank else torch.zeros(2) for r in range(3)]
        for d in range(2)
    ]
    for handle in broadcast_buckets(buckets):
        handle.wait()
    only = [[torch.full((1,), float(r == rank)) for r in range(3)]]
    for handle in broadcast_buckets(only, src=2):
        handle.wait()
    assert only[0][2].item() == 1.0
    return [b.tolist() for per_device in buckets for b in per_device]


def test_broadcast_buckets(world3: World) -> None:
    expected = [[float(10 * d + r)] * 2 for d in range(2) for r in range(3)]
    assert world3.run(_bucket_worker) == [expected] * 3


def _mismatch_worker(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match="params_per_rank has 2 entries") as info:
        ShardBroadcaster([[], []])
    return str(info.value)


def test_wrong_number_of_ranks(world3: World) -> None:
    assert len(set(world3.run(_mismatch_worker))) == 1
