"""WarmStartDiLoCoAverager: data-parallel steps, then DiLoCo, against a float64 reference written
by hand; bytes; bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_optim as fo
from compat_api.algorithms.model_averaging import WarmStartDiLoCoAverager
from tests._world import World
from tests.compat_api._diloco_reference import init_params

STEPS = 14
LR = 0.05
PERIOD = 3
NUMEL = sum(t.numel() for t in init_params())


def _grad(x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return torch.sin(x * (1.0 + 0.3 * rank) + 0.1 * step)


def _run(rank: int, world_size: int, warm: int) -> dict[str, Any]:
    params = [torch.nn.Parameter(t.clone()) for t in init_params()]
    averager = WarmStartDiLoCoAverager(
        fo.sgd(lr=0.7, momentum=0.9, nesterov=True), period=PERIOD, warm_start_steps=warm
    )
    history, in_warm = [], []
    for step in range(STEPS):
        for p in params:
            p.grad = _grad(p.detach(), rank, step)
        in_warm.append(averager.in_warm_start)
        averager.average_gradients(params)
        with torch.no_grad():
            for p in params:
                p.sub_(LR * p.grad)
        averager.average_parameters(params)
        history.append([p.detach().clone() for p in params])
    return {"history": history, "bytes": averager.bytes_communicated, "in_warm": in_warm}


def _reference(warm: int, world_size: int) -> tuple[list[list[list[torch.Tensor]]], int]:
    """Float64: mean gradients for ``warm`` steps, then DiLoCo from the last warm step."""
    init = init_params(torch.float64)
    xs = [[t.clone() for t in init] for _ in range(world_size)]
    start = warm - 1 if warm > 0 else 0  # the step whose call takes the synced copy
    synced: list[torch.Tensor] | None = None
    bufs: list[torch.Tensor | None] = [None] * len(init)
    history, syncs = [], 0
    for step in range(STEPS):
        grads = [[_grad(t, rank, step) for t in x] for rank, x in enumerate(xs)]
        if step < warm:
            mean = [sum(g[i] for g in grads) / world_size for i in range(len(init))]
            grads = [mean for _ in xs]
        xs = [[t - LR * g for t, g in zip(x, gs, strict=True)] for x, gs in zip(xs, grads)]
        if step == start:
            synced = [sum(x[i] for x in xs) / world_size for i in range(len(init))]
            xs = [[s.clone() for s in synced] for _ in xs]
        elif step > start and (step - start) % PERIOD == 0:
            assert synced is not None
            syncs += 1
            for i in range(len(init)):
                delta = sum(synced[i] - x[i] for x in xs) / world_size
                b = bufs[i]
                bufs[i] = delta.clone() if b is None else 0.9 * b + delta
                synced[i] = synced[i] - 0.7 * (delta + 0.9 * bufs[i])
            xs = [[s.clone() for s in synced] for _ in xs]
        history.append([[t.clone() for t in x] for x in xs])
    return history, syncs


@pytest.mark.distributed
@pytest.mark.parametrize("warm", [0, 1, 4])
def test_matches_float64_reference(world2: World, warm: int) -> None:
    ours = world2.run(_run, warm)
    expected, syncs = _reference(warm, 2)
    for step in range(STEPS):
        for rank in range(2):
            for got, want in zip(ours[rank]["history"][step], expected[step][rank], strict=True):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    # The warm phase keeps the replicas bitwise equal; the local phase lets them drift.
    for step in range(warm):
        for a, b in zip(ours[0]["history"][step], ours[1]["history"][step], strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(ours[0]["history"][warm + 1][0], ours[1]["history"][warm + 1][0])
    assert ours[0]["in_warm"] == [step < warm for step in range(STEPS)]
    # Bytes: the gradients of the warm steps and the outer syncs; at the start a checksum
    # (replicas agree after a warm start) or, without one, a full average.
    start = ours[0]["bytes"] - (warm + syncs) * NUMEL * 4
    if warm:
        assert 0 < start < NUMEL * 4
    else:
        assert start == NUMEL * 4


@pytest.mark.parametrize("bad", [-1, -10, 1.5, True, "3"])
def test_bad_warm_start_steps_raise_before_anything_is_built(bad: Any) -> None:
    # No process group in this process: the check comes before the averager needs one.
    with pytest.raises(ValueError, match="warm_start_steps"):
        WarmStartDiLoCoAverager(period=3, warm_start_steps=bad)


@pytest.mark.parametrize("extra", [{"warmup_steps": 2}, {"params": []}])
def test_rejects_warmup_and_params(extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(extra))):
        WarmStartDiLoCoAverager(period=3, warm_start_steps=2, **extra)
