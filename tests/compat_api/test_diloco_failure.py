"""DiLoCo when a peer dies mid-sync: the error names it, the averager can still be saved, and
the retry over a re-formed group (3 ranks -> 2) goes on as a clean resume would.

One 3-rank world for the module. Each check trains over the default group, then (all ranks
aligned) moves the averager to a fresh group with a short timeout; at the failing sync rank 2
"dies" (stops calling it, then only joins the collective creation of the re-formed group), so
the survivors' all-reduce times out and rank 2 does not check in. The retry is compared with a
fresh averager over the re-formed group loaded from the state the failed call left
(``state_dict()`` after the failure): bitwise the same parameters and averager state, at the
retried step and at the syncs after it.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from compat_api.algorithms.model_averaging import DiLoCoAverager
from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer
from dist_runtime.collective_failure import CollectiveFailedError
from tests._world import World

pytestmark = pytest.mark.distributed

DEAD = 2
TIMEOUT = timedelta(seconds=3)
SHAPES = [(6, 5), (5,), (4, 3), (7,)]
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"period": 2},
    "streaming": {
        "period": 4,
        "fragments": 2,
        "overlap": True,
        "overlap_delay": 1,
        "compression": "int8",
    },
}
#: The step at which rank 2 stops: plain DiLoCo syncs (and fails) at once; Streaming DiLoCo
#: sends fragment 0 then (its all-reduce never completes) and fails one step later, waiting.
DIES_AT = {"plain": 4, "streaming": 4}
FAILS_AT = {"plain": 4, "streaming": 5}


def _params(rank: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(100 + rank)  # the replicas differ at first
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _short_group(world_size: int) -> Any:
    """A group whose collectives give up after ``TIMEOUT``, every rank past its creation."""
    dist.barrier()  # new_group's own barrier has the short timeout: arrive together
    group = dist.new_group(list(range(world_size)), timeout=TIMEOUT)
    dist.barrier()
    return group


def _survivors(world_size: int) -> Any:
    return dist.new_group([r for r in range(world_size) if r != DEAD])


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Averager state dicts equal (bitwise), the byte count aside."""
    a, b = dict(a), dict(b)
    a.pop("bytes_communicated")
    b.pop("bytes_communicated")
    return _equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _check_bare_averager(rank: int, world_size: int) -> str | None:
    """Plain DiLoCo without a wrapper: CollectiveFailedError naming rank 2, nothing applied,
    ``state_dict()`` works; after ``averager.process_group = survivors`` the same call goes
    through, as on a fresh averager loaded from the state before the failed call."""
    params = _params(rank)
    _grads(params, rank, 0)  # the averager takes the parameters that have a gradient
    averager = DiLoCoAverager(period=2)
    for step in range(4):  # syncs at steps 0 (initial average) and 2
        with torch.no_grad():
            for p in params:
                p.add_(0.01 * (rank + 1) * (step + 1))
        averager.average_parameters(params)
    averager.process_group = _short_group(world_size)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * (rank + 1))
    if rank == DEAD:
        _survivors(world_size)
        return None
    before = averager.state_dict()
    values = [p.detach().clone() for p in params]
    with pytest.raises(CollectiveFailedError) as info:
        averager.average_parameters(params)  # step 4: a sync
    assert info.value.failed_ranks == [DEAD], str(info.value)
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))
    assert averager.step == 4
    assert _same_state(averager.state_dict(), before), "state_dict() after the failure"
    survivors = _survivors(world_size)
    averager.process_group = survivors
    averager.average_parameters(params)
    fresh = DiLoCoAverager(period=2, process_group=survivors)
    fresh.load_state_dict(before)
    theirs = [torch.nn.Parameter(v.clone()) for v in values]
    _grads(theirs, rank, 0)
    fresh.average_parameters(theirs)
    assert all(torch.equal(p, q) for p, q in zip(params, theirs, strict=True))
    assert _same_state(averager.state_dict(), fresh.state_dict())
    return str(info.value)


def test_bare_averager_failure_names_rank_and_can_be_retried(world3: World) -> None:
    results = world3.run(_check_bare_averager)
    assert results[DEAD] is None
    for text in results[:DEAD]:
        assert text.startswith("DiLoCoAverager.average_parameters failed: rank 2 did not answer")
        assert "state_dict() works" in text


class _Run:
    """A model (its parameters), an SGD inner optimizer and DiLoCo in PostLocalSGDOptimizer."""

    def __init__(self, params: list[torch.nn.Parameter], variant: str, group: Any) -> None:
        self.params = params
        self.averager = DiLoCoAverager(process_group=group, **VARIANTS[variant])
        self.opt = PostLocalSGDOptimizer(
            torch.optim.SGD(params, lr=0.05, momentum=0.9), self.averager
        )

    def step(self, rank: int, step: int) -> None:
        _grads(self.params, rank, step)
        self.opt.step()

    def clone(self, variant: str, group: Any) -> _Run:
        """A fresh run over ``group`` resumed from this one's state (a checkpoint)."""
        params = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        other = _Run(params, variant, group)
        other.opt.optim.load_state_dict(copy.deepcopy(self.opt.optim.state_dict()))
        other.averager.load_state_dict(copy.deepcopy(self.averager.state_dict()))
        return other


def _check_retry(rank: int, world_size: int, variant: str) -> str | None:
    run = _Run(_params(rank), variant, None)
    for step in range(DIES_AT[variant]):
        run.step(rank, step)
    assert run.averager.state_dict()["sync"] is not None  # nothing in flight: free to move
    run.averager.process_group = _short_group(world_size)
    if rank == DEAD:
        _survivors(world_size)
        return None
    for step in range(DIES_AT[variant], FAILS_AT[variant]):
        run.step(rank, step)  # Streaming: fragment 0's all-reduce starts and never completes
    values = [p.detach().clone() for p in run.params]
    momenta = [run.opt.optim.state[p]["momentum_buffer"].clone() for p in run.params]
    with pytest.raises(CollectiveFailedError) as info:
        run.step(rank, FAILS_AT[variant])
    text = str(info.value)
    assert info.value.failed_ranks == [DEAD], text
    assert "as they were before the call" in text, text
    assert run.averager.step == FAILS_AT[variant]
    assert all(torch.equal(p, v) for p, v in zip(run.params, values, strict=True))
    assert all(
        torch.equal(run.opt.optim.state[p]["momentum_buffer"], m)
        for p, m in zip(run.params, momenta, strict=True)
    )
    survivors = _survivors(world_size)
    resumed = run.clone(variant, survivors)  # state_dict() works after the failure
    run.averager.process_group = survivors
    for step in range(FAILS_AT[variant], FAILS_AT[variant] + 6):  # the retry, then 2 more syncs
        run.step(rank, step)
        resumed.step(rank, step)
        assert all(torch.equal(p, q) for p, q in zip(run.params, resumed.params, strict=True))
        assert _same_state(run.averager.state_dict(), resumed.averager.state_dict())
    # The survivors stay in sync: their synced copies are equal.
    synced = torch.cat([f["synced"] for f in run.averager.state_dict()["sync"]])
    gathered = [torch.empty_like(synced) for _ in range(world_size - 1)]
    dist.all_gather(gathered, synced, group=survivors)
    assert torch.equal(gathered[0], gathered[1])
    return text


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_post_local_sgd_retry_over_the_reformed_group(world3: World, variant: str) -> None:
    results = world3.run(_check_retry, variant)
    assert results[DEAD] is None
    for text in results[:DEAD]:
        assert text.startswith("PostLocalSGDOptimizer.step (DiLoCoAverager"), text
        assert "rank 2 did not answer" in text, text
