"""ZeroRedundancyOptimizer(partition="flat") and the shared extensions (clip_grad_norm_,
save_sharded/load_sharded), against torch.optim and the sorted-greedy partition (gloo, 2 and 3
ranks). Gradients are the same on every rank, as after DDP, so comparisons are bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tests._world import World

pytestmark = pytest.mark.distributed

SHAPES = [(7, 5), (13,), (3, 4, 2), (), (33,), (2, 9), (40,)]
OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("AdamW", {"lr": 0.01}),
    ("Adamax", {"lr": 0.02}),
    ("Adagrad", {"lr": 0.1}),
    ("Adadelta", {"lr": 1.0}),
    ("RMSprop", {"lr": 0.01, "centered": True}),
    ("Rprop", {"lr": 0.01}),
]


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:3]}, {"params": params[3:], "lr": 0.003}]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(100 * step + i)
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)


def _train(
    rank: int, world_size: int, name: str, kwargs: dict[str, Any], partition: str, steps: int
) -> dict[str, Any]:
    params = _params()
    zero = ZeroRedundancyOptimizer(
        _groups(params), getattr(torch.optim, name), partition=partition, **kwargs
    )
    for step in range(steps):
        _set_grads(params, step)
        zero.step()
    zero.consolidate_state_dict(to=0)
    state = zero.state_dict() if rank == 0 else None
    numel = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    return {"params": [p.detach().clone() for p in params], "state": state, "numel": numel}


def _reference(name: str, kwargs: dict[str, Any], steps: int) -> tuple[list[torch.Tensor], Any]:
    params = _params()
    opt = getattr(torch.optim, name)(_groups(params), **kwargs)
    for step in range(steps):
        _set_grads(params, step)
        opt.step()
    return [p.detach() for p in params], opt.state_dict()


def _assert_state_dicts_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for index, state in want["state"].items():
        assert list(got["state"][index]) == list(state)
        for key, value in state.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Iterator[World]:
    with World(3) as world:
        yield world


def test_flat_parity_and_state_dict_equals_sorted_greedy(world3: World) -> None:
    for name, kwargs in OPTIMIZERS:
        flat = world3.run(_train, name, kwargs, "flat", 3)
        greedy = world3.run(_train, name, kwargs, "sorted_greedy", 3)
        want_params, want_state = _reference(name, kwargs, 3)
        for result in flat:
            for got, want in zip(result["params"], want_params):
                assert torch.equal(got, want), name
        _assert_state_dicts_equal(flat[0]["state"], greedy[0]["state"])
        _assert_state_dicts_equal(flat[0]["state"], want_state)
        numels = [r["numel"] for r in flat]
        total = sum(math.prod(s) for s in SHAPES)
        assert sum(numels) == total
        assert max(numels) == -(-total // 3)  # balanced: every full shard holds ceil(total / 3)


def _clip(rank: int, world_size: int, partition: str, norm_type: float) -> list[Any]:
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, partition=partition, lr=1.0)
    _set_grads(params, 0)
    total = zero.clip_grad_norm_(0.5, norm_type)
    zero.step()
    return [total, [p.detach().clone() for p in params]]


@pytest.mark.parametrize("partition", ["flat", "sorted_greedy"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm(world2: World, partition: str, norm_type: float) -> None:
    params = _params()
    _set_grads(params, 0)
    want = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
    torch.optim.SGD(params, lr=1.0).step()
    for total, got in world2.run(_clip, partition, norm_type):
        torch.testing.assert_close(total, want, rtol=1e-12, atol=0)
        for g, w in zip(got, params):
            torch.testing.assert_close(g, w.detach(), rtol=1e-12, atol=1e-15)


def _sharded(
    rank: int, world_size: int, root: str, partition: str, load: bool, steps: range
) -> list[torch.Tensor]:
    params = _params(seed=5 if load else 0)
    zero = ZeroRedundancyOptimizer(
        _groups(params), torch.optim.Adam, partition=partition, lr=0.01, amsgrad=True
    )
    extra = {f"p{i}": p.data for i, p in enumerate(params)}
    if load:
        zero.load_sharded(root, extra=extra)
    for step in steps:
        _set_grads(params, step)
        zero.step()
        if step == 1:
            zero.save_sharded(root, extra=extra)
    return [p.detach().clone() for p in params]


def test_sharded_checkpoint_across_partitions_and_world_sizes(
    world2: World, world3: World, tmp_path: Any
) -> None:
    flat_root, greedy_root = str(tmp_path / "flat"), str(tmp_path / "greedy")
    full = world2.run(_sharded, flat_root, "flat", False, range(4))[0]
    world3.run(_sharded, greedy_root, "sorted_greedy", False, range(2))
    for root, partition in [(flat_root, "sorted_greedy"), (greedy_root, "flat")]:
        for got in world3.run(_sharded, root, partition, True, range(2, 4)):
            for g, w in zip(got, full):
                assert torch.equal(g, w), (root, partition)


class _WholeTensorSGD(torch.optim.SGD):
    elementwise_update = False


def _bad(rank: int, world_size: int) -> list[str]:
    errors = []
    for kwargs in (
        {"optimizer_class": _WholeTensorSGD, "partition": "flat"},
        {"optimizer_class": torch.optim.SGD, "partition": "round_robin"},
    ):
        try:
            ZeroRedundancyOptimizer(_params(), lr=0.1, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    zero = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, partition="flat", lr=0.1)
    try:
        zero.add_param_group({"params": [torch.zeros(2, dtype=torch.float64)]})
    except NotImplementedError as e:
        errors.append(str(e))
    return errors


def test_errors(world2: World) -> None:
    errors = world2.run(_bad)[0]
    assert len(errors) == 3
    assert "declares elementwise_update = False" in errors[0]
    assert "partition must be one of" in errors[1]
    assert "at construction" in errors[2]
