"""ZeroRedundancyOptimizer and the model averagers with CUDA tensors: 2 processes, gloo.

One GPU serves both ranks (NCCL refuses two ranks on one device; gloo moves CUDA tensors).
Every check runs on each rank and compares with torch on the same device and inputs:

* ``ZeroRedundancyOptimizer`` in every partition mode (torch's sorted-greedy, ``cost_balanced``,
  ``flat``) and with ``parameters_as_bucket_view``, for Adam and SGD-momentum: after each step
  the params equal a plain ``torch.optim`` optimizer stepped on the all-reduced gradients;
  ``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict`` round-trip on the device;
* ``PeriodicModelAverager``: equal to torch's averager on the same CUDA params;
* ``DiLoCoAverager``: the CUDA run equals the same run on CPU tensors.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import functional_optim as fo
from compat_api.algorithms.model_averaging import DiLoCoAverager
from compat_api.algorithms.model_averaging.averagers import PeriodicModelAverager
from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tests._world import World

from ._device import DEVICE, MARKS

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers

pytestmark = [*MARKS, pytest.mark.distributed]

MODES: dict[str, dict[str, Any]] = {
    "sorted_greedy": {},
    "cost_balanced": {"partition": "cost_balanced"},
    "flat": {"partition": "flat"},
    "bucket_view": {"parameters_as_bucket_view": True},
}
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
STEPS = 3
TOL = {"rtol": 1e-6, "atol": 1e-7}


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Linear(8, 3)).to(device)


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=gen).to(device), torch.randn(5, 3, generator=gen).to(device)


def _backward(model: nn.Module, rank: int, step: int, device: torch.device) -> None:
    x, y = _batch(rank, step, device)
    model.zero_grad()
    (model(x) - y).pow(2).mean().backward()


def _zero_check(rank: int, world_size: int, mode: str, optimizer: str) -> float:
    """Max abs difference between ZeRO's params and the reference's, over the steps."""
    cls, hyper = OPTIMIZERS[optimizer]
    model = _model(DEVICE)
    reference = copy.deepcopy(model)
    ref_opt = cls(reference.parameters(), **hyper)
    zero = ZeroRedundancyOptimizer(model.parameters(), cls, **MODES[mode], **hyper)
    worst = 0.0
    for step in range(STEPS):
        _backward(model, rank, step, DEVICE)
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None
            assert p.grad.device.type == DEVICE.type
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
            r.grad = p.grad.clone()
        zero.step()
        ref_opt.step()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.device.type == DEVICE.type
            torch.testing.assert_close(p, r, **TOL)
            worst = max(worst, (p - r).abs().max().item())
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        saved = zero.state_dict()
        tensors = [v for s in saved["state"].values() for v in s.values() if torch.is_tensor(v)]
        assert tensors, "the consolidated state holds no tensors"
        zero.load_state_dict(saved)
    return worst


def _periodic_check(rank: int, world_size: int) -> float:
    ours, theirs = _model(DEVICE), _model(DEVICE)
    ours_avg = PeriodicModelAverager(period=2, warmup_steps=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch_avg = torch_averagers.PeriodicModelAverager(period=2, warmup_steps=1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(5):
        for model, opt in zip((ours, theirs), opts, strict=True):
            _backward(model, rank, step, DEVICE)
            opt.step()
        ours_avg.average_parameters(ours.parameters())
        torch_avg.average_parameters(theirs.parameters())
        for p, r in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert p.device.type == DEVICE.type
            torch.testing.assert_close(p, r, rtol=0, atol=0)
    return max((p - r).abs().max().item() for p, r in zip(ours.parameters(), theirs.parameters()))


def _diloco_run(rank: int, device: torch.device) -> list[torch.Tensor]:
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    averager = DiLoCoAverager(fo.sgd(lr=0.7, momentum=0.9, nesterov=True), period=2)
    for step in range(6):
        _backward(model, rank, step, device)
        opt.step()
        averager.average_parameters(model.parameters())
    return [p.detach().cpu() for p in model.parameters()]


def _diloco_check(rank: int, world_size: int) -> float:
    on_device = _diloco_run(rank, DEVICE)
    on_cpu = _diloco_run(rank, torch.device("cpu"))
    worst = max((a - b).abs().max().item() for a, b in zip(on_device, on_cpu, strict=True))
    for a, b in zip(on_device, on_cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return worst


@pytest.fixture(scope="module")
def world() -> Any:
    with World(2) as w:
        yield w


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", list(MODES))
def test_zero_on_device_matches_torch_optim(world: World, mode: str, optimizer: str) -> None:
    worst = world.run(_zero_check, mode, optimizer)
    assert len(worst) == 2


def test_periodic_averager_on_device_equals_torch(world: World) -> None:
    assert world.run(_periodic_check) == [0.0, 0.0]


def test_diloco_on_device_equals_cpu(world: World) -> None:
    worst = world.run(_diloco_check)
    assert len(worst) == 2
