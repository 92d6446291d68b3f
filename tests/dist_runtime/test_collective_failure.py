"""A dead or hung peer: named in the error, and nothing changed by the failed call.

One 3-rank world for the module. Each check makes a fresh group with a short timeout in which
rank 2 "dies" (skips the collective, so the others time out and find it did not check in); the
default group stays healthy for the next check, and the survivors retry over a re-formed group.
The last test kills rank 2 for real (SIGKILL: connection reset instead of a timeout).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging import utils as torch_utils

from dist_runtime.averaging import FlatParameterCache, average_parameters
from dist_runtime.collective_failure import (
    CollectiveFailedError,
    collective_guard,
    is_collective_failure,
    name_failed,
)
from dist_runtime.param_sync import ShardBroadcaster
from dist_runtime.sharded_checkpoint import latest_checkpoint, save_optimizer_shards
from dist_runtime.state_consolidation import gather_local_state_dicts
from dist_runtime.step_rollback import OptimizerSnapshot, rollback_on_failure
from dist_runtime.streaming_consolidation import consolidate_piece_states
from tests._world import World

pytestmark = pytest.mark.distributed

DEAD = 2
TIMEOUT = timedelta(seconds=2)


def _short_group(world_size: int) -> Any:
    """A fresh group over every rank whose collectives give up after ``TIMEOUT``."""
    return dist.new_group(list(range(world_size)), timeout=TIMEOUT)


def _aligned_short_group(world_size: int) -> Any:
    """A short-timeout group, after a barrier so that no rank is late for its collectives.

    Successful set-up work runs over the default group (60 s timeout): on a busy machine a
    rank can lag by more than the short timeout.
    """
    group = _short_group(world_size)
    dist.barrier()
    return group


def _survivors(world_size: int) -> Any:
    """The re-formed group (every rank calls new_group; the dead one is not a member)."""
    return dist.new_group([r for r in range(world_size) if r != DEAD])


def _snapshot(tensors: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    return [(t.data_ptr(), t.detach().clone()) for t in tensors]


def _unchanged(tensors: list[torch.Tensor], saved: list[tuple[int, torch.Tensor]]) -> bool:
    return all(
        t.data_ptr() == ptr and torch.equal(t, value) for t, (ptr, value) in zip(tensors, saved)
    )


def _state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _check_named(err: CollectiveFailedError, operation: str) -> str:
    text = str(err)
    assert err.failed_ranks == [DEAD], text
    assert text.startswith(operation), text
    for words in ("rank 2 did not answer", "re-form the process group", "torchrun", "sharded"):
        assert words in text, text
    return text


# -- no world: the guard's classification and the snapshot's restore ----------------------------


def test_guard_converts_only_collective_failures() -> None:
    assert is_collective_failure(RuntimeError("[gloo] Connection reset by peer"))
    assert is_collective_failure(RuntimeError("Timed out waiting 1500ms for recv operation"))
    assert is_collective_failure(dist.DistBackendError("anything"))
    assert not is_collective_failure(RuntimeError("shape mismatch: [3] vs [4]"))
    assert not is_collective_failure(ValueError("timed out"))
    with pytest.raises(ValueError, match="bad input"), collective_guard("op"):
        raise ValueError("bad input")
    with pytest.raises(RuntimeError, match="shape mismatch"), collective_guard("op"):
        raise RuntimeError("shape mismatch")
    # Without a store to check in on, the message cannot name the rank and says so.
    with (
        pytest.raises(CollectiveFailedError, match="could not tell which") as info,
        collective_guard("op", kept="Nothing changed."),
    ):
        raise RuntimeError("Connection reset by peer")
    assert info.value.failed_ranks is None
    assert "Nothing changed." in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_naming_after_a_check_in() -> None:
    ranks = [0, 1, 2, 3]
    # Only rank 1 is missing: named.
    assert name_failed(ranks, {0: "", 2: "", 3: ""}) == [1]
    # An early survivor: ranks 1 and 2 are missing, but rank 2 beats (alive, still blocked).
    assert name_failed(ranks, {0: "", 3: ""}, beating=[2]) == [1]
    # Every missing rank beats: a hung rank, not a dead one; all of them are suspects.
    assert name_failed(ranks, {0: "", 3: ""}, beating=[1, 2]) == [1, 2]
    # A receiver saw rank 2 fail; a sender that finished (rank 1) neither checked in nor
    # beats: the direct report names rank 2 only.
    assert name_failed(ranks, {0: "2", 3: ""}) == [2]
    # A report about a rank that did check in (it came back) does not narrow.
    assert name_failed(ranks, {0: "3", 3: ""}) == [1, 2]
    # Everyone checked in: nobody to name (the message says it could not tell).
    assert name_failed(ranks, dict.fromkeys(ranks, "")) == []


def test_rollback_restores_params_state_and_groups_in_place() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    optim = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()
    params[1].grad = None  # params[1] has state; a new param without state joins
    extra = torch.nn.Parameter(torch.randn(2))
    optim.add_param_group({"params": [extra], "lr": 0.5})
    for p in (params[0], extra):
        p.grad = torch.randn_like(p)
    saved_params = _snapshot([*params, extra])
    saved_state = _snapshot(_state_tensors(optim))
    state_ids = [id(t) for t in _state_tensors(optim)]

    def failing_step() -> None:
        with rollback_on_failure("step", optim, [*params, extra]):
            optim.step()  # changes params[0], its state, and creates extra's state
            optim.param_groups[0]["lr"] = 7.0
            raise RuntimeError("Timed out waiting 1500ms for send operation to complete")

    with pytest.raises(CollectiveFailedError, match="as they were before the call"):
        failing_step()
    assert _unchanged([*params, extra], saved_params)
    assert extra not in optim.state, "state the failed step created must go"
    assert [id(t) for t in _state_tensors(optim)] == state_ids, "state tensors keep identity"
    assert _unchanged(_state_tensors(optim), saved_state)
    assert optim.param_groups[0]["lr"] == 0.1
    # Any other error is not a collective failure: nothing is restored, the error propagates.

    def buggy_step() -> None:
        with rollback_on_failure("step", optim, params):
            optim.step()
            _ = 1 / 0

    with pytest.raises(ZeroDivisionError):
        buggy_step()
    assert not torch.equal(params[0], saved_params[0][1])
    # A snapshot restores by hand too (parameters only).
    snap = OptimizerSnapshot(None, params)
    value = params[0].detach().clone()
    with torch.no_grad():
        params[0].add_(1.0)
    snap.restore()
    assert torch.equal(params[0], value)
    # capture() reuses the buffers: the copy follows the parameter.
    with torch.no_grad():
        params[0].add_(2.0)
    snap.capture()
    with torch.no_grad():
        params[0].zero_()
    snap.restore()
    assert torch.equal(params[0], value + 2.0)


# -- a peer that does not answer ----------------------------------------------------------------


def _check_average(rank: int, world_size: int) -> str | None:
    gen = torch.Generator().manual_seed(rank)
    params = [
        torch.nn.Parameter(torch.randn(6, 4, generator=gen)),
        torch.nn.Parameter(torch.randn(4, generator=gen, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(3, generator=gen).half()),  # copied, not bound
    ]
    cache = FlatParameterCache()
    average_parameters(params, None, cache)  # binds the parameters to the cached buffer
    with torch.no_grad():
        for p in params:
            p.mul_(rank + 2)
    group = _aligned_short_group(world_size)
    if rank == DEAD:
        _survivors(world_size)
        return None
    saved = _snapshot(params)
    with pytest.raises(CollectiveFailedError) as info:
        average_parameters(params, group, cache)
    text = _check_named(info.value, "average_parameters")
    assert "Every parameter is unchanged." in text
    assert _unchanged(params, saved), "a failed average must leave the parameters as they were"
    # In-process retry over the re-formed group: bitwise torch's average of the survivors.
    survivors = _survivors(world_size)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_utils.average_parameters(iter(theirs), survivors)
    average_parameters(params, survivors, cache)
    assert all(torch.equal(t, o) for t, o in zip(theirs, params))
    return text


def test_average_failure_names_rank_and_leaves_params(world3: World) -> None:
    results = world3.run(_check_average)
    assert results[DEAD] is None
    assert all("rank 2" in str(text) for text in results[:DEAD])


def _check_rollback_zero_like_step(rank: int, world_size: int) -> bool:
    """A ZeRO-style step (local step on the owned shard, then broadcast) under rollback."""
    torch.manual_seed(0)  # same parameters everywhere
    shapes = [(300, 1000), (7, 3), (11,), (5, 5), (260_000,), (2,)]  # two broadcast in place
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    owned = [params[r::world_size] for r in range(world_size)]
    optim = torch.optim.Adam(owned[rank], lr=0.1)

    def step(sync: ShardBroadcaster) -> None:
        for p in owned[rank]:
            p.grad = torch.randn_like(p)
        optim.step()
        sync.sync()

    with rollback_on_failure("zero step", optim, params):
        step(ShardBroadcaster(owned))  # succeeds everywhere
    group = _aligned_short_group(world_size)
    if rank == DEAD:
        _survivors(world_size)
        return True
    saved_params, saved_state = _snapshot(params), _snapshot(_state_tensors(optim))

    def failing_step() -> None:
        with rollback_on_failure("zero step", optim, params, group):
            step(ShardBroadcaster(owned, group))

    with pytest.raises(CollectiveFailedError) as info:
        failing_step()
    text = _check_named(info.value, "zero step")
    assert "Parameters and optimizer state are as they were before the call." in text
    assert _unchanged(params, saved_params)
    assert _unchanged(_state_tensors(optim), saved_state)
    assert all(int(s["step"]) == 1 for s in optim.state.values())
    _survivors(world_size)
    return True


def test_rollback_of_a_sharded_step(world3: World) -> None:
    assert world3.run(_check_rollback_zero_like_step) == [True] * 3


def _optimizer_with_state(rank: int) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=gen)) for _ in range(2)]
    optim = torch.optim.Adam(params, lr=0.1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    optim.step()
    return optim, params


def _check_consolidation(rank: int, world_size: int, streaming: bool) -> bool:
    from dist_runtime.piece_state import Piece

    optim, params = _optimizer_with_state(rank)
    pieces = {p: Piece(2 * rank + i, 0, p.numel(), tuple(p.shape)) for i, p in enumerate(params)}
    group = _aligned_short_group(world_size)

    def consolidate() -> Any:
        if streaming:
            return consolidate_piece_states(optim, pieces, 0, group)
        return gather_local_state_dicts(optim.state_dict(), 0, group)

    if rank == DEAD:
        _survivors(world_size)
        return True
    saved_state = _snapshot(_state_tensors(optim))
    if rank == 0:  # the receiver waits on rank 2 and names it
        with pytest.raises(CollectiveFailedError) as info:
            consolidate()
        _check_named(info.value, "streaming" if streaming else "state-dict consolidation")
    else:  # rank 1's sends complete (rank 0 receives from it before waiting on rank 2)
        assert consolidate() is None
    assert _unchanged(_state_tensors(optim), saved_state)
    _survivors(world_size)
    return True


@pytest.mark.parametrize("streaming", [False, True])
def test_consolidation_failure(world3: World, streaming: bool) -> None:
    assert world3.run(_check_consolidation, streaming) == [True] * 3


def _check_sharded_save(rank: int, world_size: int, root: str) -> bool:
    from dist_runtime.dcp_state import shard_state_dict
    from dist_runtime.sharded_checkpoint import new_checkpoint_folder, whole_param_pieces

    optim, _ = _optimizer_with_state(rank)
    # Every rank owns two of the 2 * world_size parameters (same shapes everywhere).
    all_params = [torch.zeros(4, 3) for _ in range(2 * world_size)]
    pieces = {
        p: piece._replace(param_index=2 * rank + i)
        for i, (p, piece) in enumerate(whole_param_pieces(optim.param_groups).items())
    }
    groups = [{"params": all_params, "lr": 0.1}]
    first = save_optimizer_shards(root, optim, pieces, all_params, groups)
    group = _aligned_short_group(world_size)
    if rank == DEAD:  # agrees on the folder and the plan, then dies before writing
        new_checkpoint_folder(root, group)
        shard_state_dict(optim, pieces, all_params, groups, group, init_empty=False)
        _survivors(world_size)
        return True
    saved_state = _snapshot(_state_tensors(optim))
    with pytest.raises(CollectiveFailedError) as info:
        save_optimizer_shards(root, optim, pieces, all_params, groups, group)
    _check_named(info.value, "save_optimizer_shards")
    assert latest_checkpoint(root) == first, "a failed save must not be committed"
    assert _unchanged(_state_tensors(optim), saved_state)
    _survivors(world_size)
    return True


def test_failed_sharded_save_is_not_committed(world3: World, tmp_path: Any) -> None:
    assert world3.run(_check_sharded_save, str(tmp_path)) == [True] * 3
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "ckpt-000000", "ckpt-000001"]
    assert not os.path.exists(tmp_path / "ckpt-000001" / ".metadata")


def _heartbeat_counts(rank: int, world_size: int) -> list[int] | None:
    """Rank 1 sits in a guarded block (as in a collective), then outside one; rank 0 reads its
    heartbeat counter at the start and end of each phase (the barriers order the reads)."""
    import time

    from dist_runtime.collective_failure import HEARTBEAT_S

    store = dist.distributed_c10d._get_default_store()
    key = "distopt/heartbeat/1"
    seconds = 6 * HEARTBEAT_S
    dist.barrier()
    if rank == 1:
        with collective_guard("blocked"):
            time.sleep(seconds)
            dist.barrier()  # rank 0 reads while this rank is still in the block
        dist.barrier()
        time.sleep(seconds)
        dist.barrier()
        return None
    if rank != 0:
        for _ in range(3):
            dist.barrier()
        return None
    counts = [int(store.add(key, 0))]
    dist.barrier()
    counts.append(int(store.add(key, 0)))
    dist.barrier()
    counts.append(int(store.add(key, 0)))
    time.sleep(seconds)
    counts.append(int(store.add(key, 0)))
    dist.barrier()
    return counts


def test_heartbeat_only_inside_a_guarded_block(world3: World) -> None:
    counts = world3.run(_heartbeat_counts)[0]
    assert counts is not None
    in_block, outside = counts[1] - counts[0], counts[3] - counts[2]
    assert in_block >= 2, counts  # alive and blocked: beating
    assert outside <= 1, counts  # idle: no store traffic (but a beat sent as the block ended)


# -- a peer that is really dead (keep last: the world loses rank 2) -----------------------------


def _check_killed_peer(rank: int, world_size: int) -> str:
    params = [torch.nn.Parameter(torch.full((5,), float(rank)))]
    saved = params[0].detach().clone()
    with pytest.raises(CollectiveFailedError) as info:
        average_parameters(params, None, FlatParameterCache())
    # A first call moves the parameters into the new buffer (as torch does); values stay.
    assert torch.equal(params[0], saved)
    return _check_named(info.value, "average_parameters")


def test_killed_peer_is_named(world3: World) -> None:
    world3.kill(DEAD)
    texts = world3.run_on([0, 1], _check_killed_peer, timeout_s=60)
    assert all("Connection reset" in text or "closed" in text for text in texts), texts
