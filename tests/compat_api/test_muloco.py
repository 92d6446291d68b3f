"""MuLoCo: MuonAdamW against torch.optim.Muon + torch.optim.AdamW, and muloco() (that inner
optimizer under DiLoCo) against a single-process reference written by hand."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import functional_optim as fo
from compat_api.algorithms.model_averaging import MuonAdamW, muloco
from tests._world import World

SHAPES = [(6, 4), (4,), (5, 6), (5,), (3, 5)]
STEPS = 11
PERIOD = 3
INNER = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "betas": (0.9, 0.95), "eps": 1e-8}


def _init() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _grad(x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    return torch.sin(x * (1.0 + 0.3 * rank) + 0.1 * step)


def _factor(step: int) -> float:
    return 1.0 if step < 5 else 0.5


def _torch_inner(params: list[torch.nn.Parameter]) -> list[torch.optim.Optimizer]:
    lr, wd = INNER["lr"], INNER["weight_decay"]
    muon = torch.optim.Muon(
        [p for p in params if p.ndim == 2],
        lr=lr,
        weight_decay=wd,
        momentum=INNER["momentum"],
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(
        [p for p in params if p.ndim != 2],
        lr=lr,
        betas=INNER["betas"],
        eps=INNER["eps"],
        weight_decay=wd,
    )
    return [muon, adamw]


def _local_steps(
    params: list[torch.nn.Parameter],
    optimizers: list[torch.optim.Optimizer],
    rank: int,
    step: int,
) -> None:
    for p in params:
        p.grad = _grad(p.detach(), rank, step)
    for opt in optimizers:
        opt.step()


def test_muon_adamw_equals_torch_muon_and_adamw() -> None:
    ours = [torch.nn.Parameter(t.clone()) for t in _init()]
    theirs = [torch.nn.Parameter(t.clone()) for t in _init()]
    opt = MuonAdamW(ours, **INNER)  # type: ignore[arg-type]
    ref = _torch_inner(theirs)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _factor) for o in [opt, *ref]]
    for step in range(8):
        _local_steps(ours, [opt], 0, step)
        _local_steps(theirs, ref, 0, step)
        for sched in scheds:
            sched.step()
        for a, b in zip(ours, theirs, strict=True):
            if a.ndim == 2:  # fo.muon is torch.optim.Muon op for op
                assert torch.equal(a, b)
            else:  # fo.adamw rounds like torch's fused kernel, not its foreach default
                torch.testing.assert_close(a, b)
    assert [g["lr"] for g in opt.param_groups] == [INNER["lr"] * 0.5] * 2
    # Not trivial: Muon moved the matrices differently from AdamW.
    plain = [torch.nn.Parameter(t.clone()) for t in _init()]
    adamw = torch.optim.AdamW(plain, lr=INNER["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(8):
        _local_steps(plain, [adamw], 0, step)
    assert not torch.allclose(plain[0], ours[0], atol=1e-3)
    # The state dict round trip resumes bitwise.
    again = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt2 = MuonAdamW(again, **INNER)  # type: ignore[arg-type]
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load shares tensors
    _local_steps(ours, [opt], 0, 9)
    _local_steps(again, [opt2], 0, 9)
    for a, b in zip(ours, again, strict=True):
        assert torch.equal(a, b)


def _run(rank: int, world_size: int, nesterov: bool) -> list[list[torch.Tensor]]:
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    outer = fo.sgd(lr=0.7, momentum=0.9, nesterov=True) if nesterov else fo.sgd(lr=1.0)
    inner, averager = muloco(params, period=PERIOD, outer=outer, **INNER)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, _factor)
    history = []
    for step in range(STEPS):
        _local_steps(params, [inner], rank, step)
        sched.step()
        averager.average_parameters(params)
        history.append([p.detach().clone() for p in params])
    return history


def _reference(world_size: int, nesterov: bool) -> list[list[list[torch.Tensor]]]:
    """Each rank's inner steps with torch's optimizers, the outer step by hand (float32)."""
    ranks = [[torch.nn.Parameter(t.clone()) for t in _init()] for _ in range(world_size)]
    optimizers = [_torch_inner(params) for params in ranks]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, _factor) for opts in optimizers for o in opts]
    synced = [t.clone() for t in _init()]
    bufs: list[torch.Tensor | None] = [None] * len(SHAPES)
    history = []
    for step in range(STEPS):
        for rank, params in enumerate(ranks):
            _local_steps(params, optimizers[rank], rank, step)
        for sched in scheds:
            sched.step()
        if step > 0 and step % PERIOD == 0:
            for i in range(len(SHAPES)):
                mean = (synced[i] - ranks[0][i].detach()) / world_size
                for params in ranks[1:]:
                    mean = mean + (synced[i] - params[i].detach()) / world_size
                if nesterov:
                    b = bufs[i]
                    bufs[i] = mean.clone() if b is None else 0.9 * b + mean
                    synced[i] = synced[i] - 0.7 * (mean + 0.9 * bufs[i])
                else:
                    synced[i] = synced[i] - mean
                with torch.no_grad():
                    for params in ranks:
                        params[i].copy_(synced[i])
        history.append([[p.detach().clone() for p in params] for params in ranks])
    return history


@pytest.mark.distributed
@pytest.mark.parametrize("nesterov", [False, True])
def test_muloco_matches_reference(world2: World, nesterov: bool) -> None:
    ours = world2.run(_run, nesterov)
    expected = _reference(2, nesterov)
    # Plain SGD outer (lr 1): the same ops in the same order, so equal; Nesterov's outer step
    # rounds differently in the fused kernel, and Muon's bf16 Newton-Schulz amplifies that.
    tol: dict[str, Any] = {"rtol": 1e-3, "atol": 1e-3} if nesterov else {}
    for step in range(STEPS):
        for rank in range(2):
            for got, want in zip(ours[rank][step], expected[step][rank], strict=True):
                torch.testing.assert_close(got, want, **tol)
    assert not torch.equal(ours[0][1][0], ours[1][1][0])


def test_bad_input() -> None:
    params = [torch.nn.Parameter(t.clone()) for t in _init()]
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW(params, use_muon=lambda p: True)
    with pytest.raises(ValueError, match="empty"):
        MuonAdamW([])
