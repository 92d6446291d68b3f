"""compat_api.zero_redundancy_optimizer against torch's ZeroRedundancyOptimizer and torch.optim.

Distributed checks run in one gloo world of 2 and one of 3 ranks (workers live in
``tests/compat_api/_zero_workers.py``); argument errors that torch raises before touching the
process group are compared with torch's in this process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.join import Joinable

from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer as OurZeRO
from tests._world import World
from tests.compat_api import _zero_workers as workers

TorchZeRO = workers.TorchZeRO


def test_class_hierarchy() -> None:
    assert issubclass(OurZeRO, torch.optim.Optimizer)
    assert issubclass(OurZeRO, Joinable)


@pytest.mark.parametrize(
    "name",
    [
        "__init__",
        "add_param_group",
        "consolidate_state_dict",
        "step",
        "zero_grad",
        "state_dict",
        "load_state_dict",
        "join_hook",
        "_partition_parameters",
        "_local_step",
    ],
)
def test_signatures_match_torch(name: str) -> None:
    def shape(fn: Any) -> list[tuple[str, Any, Any]]:
        sig = inspect.signature(fn)
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    assert shape(getattr(OurZeRO, name)) == shape(getattr(TorchZeRO, name))


def test_properties_match_torch() -> None:
    for name in (
        "join_device",
        "join_process_group",
        "_param_to_rank",
        "_param_to_index",
        "_index_to_param",
        "_device_to_params_per_rank",
    ):
        assert isinstance(getattr(OurZeRO, name), property), name
        assert isinstance(getattr(TorchZeRO, name), property), name


def _error(fn: Callable[[], object]) -> tuple[type[BaseException], str]:
    with pytest.raises(Exception) as info:
        fn()
    return info.type, str(info.value)


def _bad_params() -> list[Any]:
    model = torch.nn.Linear(3, 2)
    return [
        [],
        torch.randn(2),
        1.2,
        [*model.parameters(), 42],
        [{"params": [model.weight]}, {"lr": 0.1}],
        [torch.sparse_coo_tensor(size=(2, 3), check_invariants=True)],
        [torch.zeros(1), torch.zeros(1, dtype=torch.float64)],
        [
            torch.zeros(1),
            torch.zeros(1),
            torch.sparse_coo_tensor(size=(2, 3), check_invariants=True),
        ],
        [{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1, dtype=torch.float64)]}],
    ]


@pytest.mark.parametrize("index", range(9))
def test_bad_params_match_torch(index: int) -> None:
    """Without a process group: same exception type and message as torch, nothing built."""
    ours = _error(lambda: OurZeRO(_bad_params()[index], torch.optim.SGD, lr=0.1))
    theirs = _error(lambda: TorchZeRO(_bad_params()[index], torch.optim.SGD, lr=0.1))
    assert ours == theirs


def test_missing_default_group_matches_torch() -> None:
    params = [torch.zeros(2, requires_grad=True)]
    ours = _error(lambda: OurZeRO(params, torch.optim.SGD, lr=0.1))
    theirs = _error(lambda: TorchZeRO(params, torch.optim.SGD, lr=0.1))
    assert ours == theirs
    assert ours[0] is ValueError


def test_bad_params_leave_groups_alone() -> None:
    group = {"params": [torch.zeros(2)], "lr": 0.5}
    groups = [group, {"params": [torch.zeros(2, dtype=torch.float64)]}]
    with pytest.raises(ValueError, match="same dense type"):
        OurZeRO(groups, torch.optim.SGD, lr=0.1)
    assert set(group) == {"params", "lr"}


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_parity_world2(world2: World, name: str, bucket_view: bool) -> None:
    results = world2.run(workers.run_parity, name, bucket_view, 5)
    assert results[0] == results[1]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
def test_parity_world3(world3: World, bucket_view: bool) -> None:
    results = world3.run(workers.run_parity, "Adam", bucket_view, 4)
    assert results[0] == results[1] == results[2]


@pytest.mark.distributed
def test_partition_matches_torch(world3: World) -> None:
    owners = world3.run(workers.run_partition, list(range(12)))
    assert owners[0] == owners[1] == owners[2]
    # Every rank owns something somewhere: the plans are not degenerate.
    assert {r for model in owners[0] for r in model} == {0, 1, 2}


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
def test_state_dict_world2(world2: World, bucket_view: bool) -> None:
    results = world2.run(workers.run_state_dict, "Adam", bucket_view)
    assert results[0] == results[1]


@pytest.mark.distributed
def test_state_dict_world3_sgd(world3: World) -> None:
    results = world3.run(workers.run_state_dict, "SGD", False)
    assert results[0] == results[1] == results[2]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
def test_join_uneven_inputs(world3: World, bucket_view: bool) -> None:
    results = world3.run(workers.run_join, bucket_view, timeout_s=120)
    assert results[0] == results[1] == results[2]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
def test_add_param_group_and_trainability(world2: World, bucket_view: bool) -> None:
    assert world2.run(workers.run_add_param_group_and_trainability, bucket_view) == [True, True]


@pytest.mark.distributed
@pytest.mark.parametrize("bucket_view", [False, True])
def test_functional_optim_local_optimizer(world2: World, bucket_view: bool) -> None:
    results = world2.run(workers.run_functional_optim, bucket_view)
    assert results[0] == results[1]


@pytest.mark.distributed
def test_bad_input_in_world(world2: World) -> None:
    messages = world2.run(workers.run_bad_input)
    assert messages[0] == messages[1]
    text = "\n".join(messages[0])
    assert "optimizer_class" in text
    assert "doesn't match the size of optimizer's group" in text
    assert "different number of parameter groups" in text
