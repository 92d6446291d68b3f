"""ZeroRedundancyOptimizer.step when a peer dies: the error names it, and the opt-in undo.

One 3-rank world for the module. Each check builds a ZeroRedundancyOptimizer over a fresh group
with a short timeout, takes one healthy step (so the local optimizers have state), then a second
step in which rank 2 "dies" (skips it): the survivors' parameter sync times out. With
``undo_step_on_failure`` the survivors' parameters and optimizer state must be bitwise as they
were before the failed step (same storage, so bucket and flat views stay valid); without it the
error must say that they may be partially updated and how to resume. After the rollback, a
ZeroRedundancyOptimizer rebuilt over a re-formed group (the hung rank back) redoes the step to
the uninterrupted result. The last check SIGKILLs rank 1: in a consolidation and in a step,
every survivor must name rank 1 and only rank 1, however late its own collective fails.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from compat_api import ZeroRedundancyOptimizer
from compat_api._zero.overlap import OverlapStatus
from compat_api.algorithms.ddp_comm_hooks import ddp_zero_hook
from dist_runtime.collective_failure import CollectiveFailedError
from tests._world import World
from tests.compat_api.test_ddp_zero_hook import make_model, train_step

pytestmark = pytest.mark.distributed

DEAD = 2
TIMEOUT = timedelta(seconds=3)
SHAPES = [(40, 30), (7, 3), (11,), (5, 5), (2000,), (2,)]
MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "bucket_view": {"parameters_as_bucket_view": True},
    "flat": {"partition": "flat"},
}


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _saved(tensors: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    return [(t.data_ptr(), t.detach().clone()) for t in tensors]


def _unchanged(tensors: list[torch.Tensor], saved: list[tuple[int, torch.Tensor]]) -> bool:
    return len(tensors) == len(saved) and all(
        t.data_ptr() == ptr and torch.equal(t, value) for t, (ptr, value) in zip(tensors, saved)
    )


def _state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for group in optim.param_groups
        for p in group["params"]
        for value in optim.state.get(p, {}).values()
        if isinstance(value, torch.Tensor)
    ]


def _check_failed_step(rank: int, world_size: int, mode: str, undo: bool) -> str | None:
    torch.manual_seed(0)  # the same parameters on every rank
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    group = dist.new_group(list(range(world_size)), timeout=TIMEOUT)
    zero = ZeroRedundancyOptimizer(
        params, torch.optim.Adam, process_group=group, lr=0.1, **MODES[mode]
    )
    zero.undo_step_on_failure = undo
    # A healthy step, identical to a plain Adam over every parameter (undo or not).
    plain = torch.optim.Adam(reference, lr=0.1)
    _set_grads(params, 1)
    _set_grads(reference, 1)
    plain.step()
    dist.barrier()  # successful work runs aligned: a busy rank may lag by the short timeout
    zero.step()
    for mine, theirs in zip(params, reference):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    if undo:  # the snapshot is kept and refilled by the next steps (no new buffers)
        kept = zero._step_guard._cached
        assert kept is not None
        _set_grads(params, 3)
        _set_grads(reference, 3)
        zero.step()
        plain.step()
        assert zero._step_guard._cached is not None
        assert zero._step_guard._cached[1] is kept[1]
    dist.barrier()
    _set_grads(params, 2)
    if rank == DEAD:  # skips the step (hung): the survivors' sync times out; then it is back
        if undo:
            _retry_in_fresh_group(zero, params, reference, plain, mode)
        return None
    saved_params = _saved(list(params))
    saved_state = _saved(_state_tensors(zero.optim))
    steps = [int(s["step"]) for s in zero.optim.state.values()]
    assert saved_state, "the local optimizer must hold state before the failed step"
    with pytest.raises(CollectiveFailedError) as info:
        zero.step()
    text = str(info.value)
    assert info.value.failed_ranks == [DEAD], text
    assert text.startswith("ZeroRedundancyOptimizer.step failed: rank 2 did not answer"), text
    assert "re-form the process group" in text, text
    if not undo:
        assert "may be partially updated" in text, text
        assert "load_sharded" in text, text
        assert "undo_step_on_failure = True" in text, text
        # The local update ran before the sync failed: this is what the undo is for.
        assert not _unchanged(list(params), saved_params)
        return text
    assert "Parameters and optimizer state are as they were before the call." in text, text
    assert _unchanged(list(params), saved_params), "the failed step must leave the parameters"
    assert _unchanged(_state_tensors(zero.optim), saved_state), "... and the optimizer state"
    assert [int(s["step"]) for s in zero.optim.state.values()] == steps
    _retry_in_fresh_group(zero, params, reference, plain, mode)
    return text


def _retry_in_fresh_group(
    zero: ZeroRedundancyOptimizer,
    params: list[torch.nn.Parameter],
    reference: list[torch.nn.Parameter],
    plain: torch.optim.Optimizer,
    mode: str,
) -> None:
    """Re-form the group, rebuild ZeRO from the rolled-back state, redo the step.

    The result must be the uninterrupted step's (a plain Adam over every parameter).
    """
    world_size = dist.get_world_size()
    fresh = dist.new_group(list(range(world_size)))  # every rank, the hung one is back
    retry = ZeroRedundancyOptimizer(
        params, torch.optim.Adam, process_group=fresh, lr=0.1, **MODES[mode]
    )
    retry.optim.load_state_dict(zero.optim.state_dict())  # same partition: same local order
    retry.step()
    _set_grads(reference, 2)
    plain.step()
    for mine, theirs in zip(params, reference):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", list(MODES))
def test_failed_step_is_undone(world3: World, mode: str) -> None:
    results = world3.run(_check_failed_step, mode, True)
    assert results[DEAD] is None
    assert all("rank 2 did not answer" in str(text) for text in results[:DEAD])


def test_failed_step_without_undo_names_rank_and_how_to_resume(world3: World) -> None:
    assert ZeroRedundancyOptimizer.undo_step_on_failure is False, "the undo must be opt-in"
    results = world3.run(_check_failed_step, "default", False)
    assert all("may be partially updated" in str(text) for text in results[:DEAD])


# -- overlap_with_ddp=True: the step runs in DDP's comm hook, bucket by bucket ---------------------

HOOKS = {
    "step": ddp_zero_hook.hook_with_zero_step,
    "interleaved": ddp_zero_hook.hook_with_zero_step_interleaved,
}
#: ~262-byte DDP buckets: three buckets for the test MLP, updated by ranks 0, 1 and 2.
OVERLAP_BUCKET_MB = 2.5e-4
WARMUP = 2  # iterations before the hooks update (torch's count without static_graph)
FAILED = WARMUP + 2  # the iteration the dead rank leaves: two healthy updates before it
OVERLAP_STEP = "ZeroRedundancyOptimizer.step (overlap_with_ddp, in the DDP comm hook)"


class _DiedError(Exception):
    """The dead rank's way out of its backward pass (not a collective failure)."""


class _HookState:
    """The wrapped comm hook's state: its group, and the bucket at which this rank dies."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.die_at: int | None = None


def _allreduce_or_die(state: _HookState, bucket: Any) -> Any:
    """DDP's all-reduce, except that the dying rank stops before bucket ``die_at``."""
    if state.die_at == bucket.index():
        raise _DiedError
    return default_hooks.allreduce_hook(state.group, bucket)


def _overlapped(group: Any, hook: str) -> tuple[DDP, ZeroRedundancyOptimizer, _HookState]:
    ddp = DDP(make_model(), bucket_cap_mb=OVERLAP_BUCKET_MB, process_group=group)
    zero = ZeroRedundancyOptimizer(
        list(ddp.parameters()), torch.optim.Adam, process_group=group, overlap_with_ddp=True
    )
    state = _HookState(group)
    ddp.register_comm_hook(state, HOOKS[hook](_allreduce_or_die, ddp, zero))
    return ddp, zero, state


def _local_state(zero: ZeroRedundancyOptimizer) -> list[dict[str, torch.Tensor]]:
    return [zero.optim.state[p] for p in zero.optim.param_groups[0]["params"]]


def _check_overlap_failure(rank: int, world_size: int, hook: str, undo: bool) -> str | None:
    """Rank 2 does the all-reduces of buckets 0 and 1, then dies before bucket 2's.

    The survivors have stepped (and started broadcasting) buckets 0 and 1 when bucket 2's
    all-reduce times out. With ``undo`` their parameters and local Adam state must be bitwise
    as before the iteration; then every rank rebuilds DDP and ZeRO over a re-formed group, from
    the rolled-back state (the dead rank from its own copy), and redoes the iteration: the
    result must equal the uninterrupted run's bitwise.
    """
    uninterrupted, _, _ = _overlapped(None, hook)
    for step in range(FAILED + 1):
        train_step(uninterrupted, rank, step)
    expected = [p.detach().clone() for p in uninterrupted.parameters()]

    group = dist.new_group(list(range(world_size)))
    ddp, zero, state = _overlapped(group, hook)
    zero.undo_step_on_failure = undo
    for step in range(FAILED - 1):
        train_step(ddp, rank, step)
    kept = zero._step_guard._cached
    train_step(ddp, rank, FAILED - 1)
    if undo:  # one snapshot, refilled every iteration (no new buffers)
        assert kept is not None
        assert zero._step_guard._cached is kept
    info = zero._overlap_info
    assert info.status == OverlapStatus.INITIALIZED
    assert len(info.params_per_bucket) == 3
    assert sorted(info.bucket_assignments_per_rank[rank]) == [rank]
    params = list(ddp.parameters())
    copies = [p.detach().clone() for p in params]
    state_copies = [{k: v.clone() for k, v in s.items()} for s in _local_state(zero)]
    saved_params = _saved(params)
    saved_state = _saved(_state_tensors(zero.optim))
    assert saved_state, "the local optimizer must hold state before the failed iteration"
    bucket_steps = []
    original_step = zero.optim.step

    def counted_step(gradients: list[torch.Tensor | None]) -> None:
        bucket_steps.append(sum(g is not None for g in gradients))
        original_step(gradients)

    zero.optim.step = counted_step
    dist.barrier()  # the healthy work ran with the group's long timeout; now a short one
    dist.distributed_c10d._set_pg_timeout(TIMEOUT, group)
    if rank == DEAD:
        state.die_at = 2
        with pytest.raises(_DiedError):
            train_step(ddp, rank, FAILED)
        if undo:
            result = _retry_overlap(rank, world_size, hook, copies, state_copies)
            assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
        return None
    try:
        text = _check_survivor(ddp, zero, rank, undo, saved_params, saved_state, bucket_steps)
    finally:  # even when a check failed: the dead rank waits in the re-formed group
        if undo:
            result = _retry_overlap(rank, world_size, hook, params, _local_state(zero))
    if undo:
        assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
    return text


def _check_survivor(
    ddp: DDP,
    zero: ZeroRedundancyOptimizer,
    rank: int,
    undo: bool,
    saved_params: list[tuple[int, torch.Tensor]],
    saved_state: list[tuple[int, torch.Tensor]],
    bucket_steps: list[int],
) -> str:
    """The failed iteration on a survivor: the named error, and what it left."""
    params = list(ddp.parameters())
    with pytest.raises(CollectiveFailedError) as failure:
        train_step(ddp, rank, FAILED)
    text = str(failure.value)
    assert failure.value.failed_ranks == [DEAD], text
    assert text.startswith(f"{OVERLAP_STEP} failed: rank 2 did not answer"), text
    assert "re-form the process group" in text, text
    assert bucket_steps, "this rank's bucket must have stepped before the failure"
    info = zero._overlap_info
    assert not info.bucket_indices_seen, "the failed iteration is forgotten"
    assert not info.broadcast_handles
    if not undo:
        assert "may be partially updated" in text, text
        assert "rebuild it and the ZeroRedundancyOptimizer" in text, text
        assert not _unchanged(params, saved_params)
        return text
    assert "Parameters and optimizer state are as they were before the call." in text, text
    assert _unchanged(params, saved_params), "the failed iteration must leave the parameters"
    assert _unchanged(_state_tensors(zero.optim), saved_state), "... and the optimizer state"
    return text


def _retry_overlap(
    rank: int,
    world_size: int,
    hook: str,
    params: list[torch.Tensor],
    local_state: list[dict[str, torch.Tensor]],
) -> list[torch.Tensor]:
    """Rebuild DDP and ZeRO over a re-formed group from ``params`` and ``local_state``.

    Redoes the failed iteration and returns the parameters it ends with.
    """
    fresh = dist.new_group(list(range(world_size)))  # every rank, the dead one is back
    ddp, zero, _ = _overlapped(fresh, hook)
    with torch.no_grad():
        for mine, value in zip(ddp.parameters(), params):
            mine.copy_(value)
    for step in range(WARMUP):  # DDP's bucketing settles; the parameters stay as loaded
        train_step(ddp, rank, step)
    zero._init_zero_for_overlap()
    for p, entry in zip(zero.optim.param_groups[0]["params"], local_state, strict=True):
        zero.optim.state[p] = {k: v.clone() for k, v in entry.items()}
    train_step(ddp, rank, FAILED)
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.parametrize("hook", list(HOOKS))
def test_overlap_failed_iteration_is_undone(world3: World, hook: str) -> None:
    results = world3.run(_check_overlap_failure, hook, True)
    assert results[DEAD] is None
    assert all("rank 2 did not answer" in str(text) for text in results[:DEAD])


def test_overlap_failure_without_undo_names_rank(world3: World) -> None:
    results = world3.run(_check_overlap_failure, "interleaved", False)
    assert all("may be partially updated" in str(text) for text in results[:DEAD])


# -- a rank SIGKILLed: every survivor names it (keep last: the world loses rank 1) ----------------

KILLED = 1
#: The ZeroRedundancyOptimizers of the killed-rank checks, one per check, each over its own group
#: (a failed group is not used again), built while every rank is alive.
_BEFORE_KILL: dict[str, ZeroRedundancyOptimizer] = {}
KILL_CHECKS: dict[str, dict[str, Any]] = {
    "consolidate": {},
    "consolidate_flat": {"partition": "flat"},
    "step": {},
    "step_flat": {"partition": "flat"},
}


def _build_before_kill(rank: int, world_size: int) -> bool:
    torch.manual_seed(0)
    for name, options in KILL_CHECKS.items():
        params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
        dist.barrier()  # new_group's own barrier has the short timeout: arrive together
        group = dist.new_group(list(range(world_size)), timeout=TIMEOUT)
        zero = ZeroRedundancyOptimizer(
            params, torch.optim.Adam, process_group=group, lr=0.1, **options
        )
        _set_grads(params, 1)
        dist.barrier()
        zero.step()  # the local optimizers hold state to consolidate
        _set_grads(params, 2)
        _BEFORE_KILL[name] = zero
    dist.barrier()
    return True


def _survivor_report(rank: int, world_size: int, name: str) -> tuple[list[int] | None, str]:
    zero = _BEFORE_KILL.pop(name)
    call = (lambda: zero.consolidate_state_dict(to=0)) if "consolidate" in name else zero.step
    with pytest.raises(CollectiveFailedError) as info:
        call()
    return info.value.failed_ranks, str(info.value)


def test_killed_rank_is_named_by_every_survivor(world3: World) -> None:
    """Rank 1 is SIGKILLed. Consolidating on rank 0: rank 0 fails on receiving from rank 1;
    rank 2, whose send to rank 0 is never received, times out later and must still name rank
    1 (not its receiver, rank 0). In a step, rank 0 fails at once (rank 1's socket closed) while
    rank 2 waits on rank 0 until its timeout: rank 0 must name rank 1 only (rank 2 is alive: it
    keeps beating while it waits), rank 2 too (rank 0 checked in before it)."""
    assert world3.run(_build_before_kill) == [True] * 3
    time.sleep(1.0)  # let rank 1 finish handing its result over before it dies
    world3.kill(KILLED)
    for name in KILL_CHECKS:
        reports = world3.run_on([0, 2], _survivor_report, name, timeout_s=60)
        for failed, text in reports:
            assert failed == [KILLED], (name, text)
            assert "rank 1 did not answer" in text, (name, text)
