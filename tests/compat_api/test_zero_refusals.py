"""ZeroRedundancyOptimizer refuses bad input cleanly: the error says what is wrong, nothing changes.

One 2-rank gloo world for the module:

- ``load_state_dict`` with another optimizer's state dict (SGD's into Adam, Adam's into SGD,
  Adagrad's into Adam) is refused before the local state, the local param groups or the
  wrapper's param groups change, in every mode; the next ``step()`` is the one the optimizer
  would have taken without the attempt.
- sparse gradients: the rank whose local optimizer refuses them raises that optimizer's own
  error (torch's ``Adam does not support sparse gradients, ...``) in every mode; optimizers
  that take them (SGD) step as a plain one does over whole parameters, and are refused in the
  bucket-view and flat modes (their parameters are views into flat buffers, where torch's
  in-place sparse add writes out of bounds); a peer left waiting sees
  ``CollectiveFailedError``. The ``functional_optim`` case needs the core to refuse sparse
  gradients with torch's message before it writes anything.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import functional_optim as fo
from compat_api import ZeroRedundancyOptimizer
from dist_runtime.collective_failure import CollectiveFailedError
from tests._world import World

pytestmark = pytest.mark.distributed

SHAPES = [(6, 5), (7,), (3, 4), (9,)]
MODES: dict[str, dict[str, Any]] = {
    "sorted_greedy": {},
    "cost_balanced": {"partition": "cost_balanced"},
    "bucket_view": {"parameters_as_bucket_view": True},
    "flat": {"partition": "flat"},
}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], seed: int, sparse: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=gen)
        if sparse:  # about half the rows (elements of 1-D parameters) have a gradient
            keep = torch.rand(p.shape[0], generator=gen) < 0.5
            grad[~keep] = 0.0
            grad = grad.to_sparse(1)
        p.grad = grad


def _snapshot(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """Everything a refused load must leave alone (values and tensor identities)."""
    return {
        "local": {
            id(p): {
                k: (id(v), v.clone()) if isinstance(v, torch.Tensor) else v for k, v in s.items()
            }
            for p, s in zero.optim.state.items()
        },
        "local_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in zero.optim.param_groups
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups],
        "params": [p.detach().clone() for g in zero.param_groups for p in g["params"]],
    }


def _same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    if before["local_groups"] != after["local_groups"] or before["groups"] != after["groups"]:
        return False
    if before["local"].keys() != after["local"].keys():
        return False
    for key, state in before["local"].items():
        now = after["local"][key]
        if state.keys() != now.keys():
            return False
        for name, value in state.items():
            if isinstance(value, tuple):
                if now[name][0] != value[0] or not torch.equal(now[name][1], value[1]):
                    return False
            elif now[name] != value:
                return False
    return all(torch.equal(a, b) for a, b in zip(before["params"], after["params"], strict=True))


def _foreign_state_dict(name: str) -> dict[str, Any]:
    """A plain ``name`` optimizer's state dict over parameters shaped like ours."""
    params = _params(seed=5)
    kwargs = {"SGD": {"lr": 0.1, "momentum": 0.9}, "Adam": {"lr": 0.01}, "Adagrad": {"lr": 0.1}}
    optim = getattr(torch.optim, name)(params, **kwargs[name])
    _set_grads(params, 9)
    optim.step()
    return optim.state_dict()


# (the ZeRO's local optimizer, the optimizer whose state dict is loaded into it)
FOREIGN = [("Adam", "SGD"), ("SGD", "Adam"), ("Adam", "Adagrad")]


def _check_foreign_load(rank: int, world_size: int, mode: str) -> list[str]:
    messages = []
    for ours, theirs in FOREIGN:
        kwargs = {"lr": 0.01} if ours == "Adam" else {"lr": 0.1, "momentum": 0.9}
        params, twin_params = _params(), _params()
        optim_class = getattr(torch.optim, ours)
        zero = ZeroRedundancyOptimizer(params, optim_class, **MODES[mode], **kwargs)
        twin = ZeroRedundancyOptimizer(twin_params, optim_class, **MODES[mode], **kwargs)
        for model, optim in ((params, zero), (twin_params, twin)):
            _set_grads(model, 1)
            optim.step()
        before = _snapshot(zero)
        with pytest.raises(ValueError, match="another optimizer") as info:
            zero.load_state_dict(_foreign_state_dict(theirs))
        assert _same(before, _snapshot(zero)), f"{theirs} into {ours}: the refused load changed"
        # The next step is the one the optimizer takes without the attempt (no KeyError).
        for model, optim in ((params, zero), (twin_params, twin)):
            _set_grads(model, 2)
            optim.step()
        assert all(torch.equal(a, b) for a, b in zip(params, twin_params, strict=True))
        messages.append(str(info.value))
    return messages


@pytest.mark.parametrize("mode", list(MODES))
def test_load_state_dict_of_another_optimizer_is_refused_before_loading(
    world2: World, mode: str
) -> None:
    for messages in world2.run(_check_foreign_load, mode):
        sgd_into_adam, adam_into_sgd, adagrad_into_adam = messages
        assert "this ZeroRedundancyOptimizer's Adam" in sgd_into_adam, sgd_into_adam
        assert "'betas'" in sgd_into_adam, sgd_into_adam
        assert "'momentum'" in adam_into_sgd, adam_into_sgd
        assert "'betas'" in adagrad_into_adam, adagrad_into_adam


def _own_state_dict_still_loads(rank: int, world_size: int, mode: str) -> bool:
    """The check refuses other optimizers only: a state dict of the same one still loads,
    also one saved before the newer boolean flags existed (torch fills those in)."""
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01, **MODES[mode])
    _set_grads(params, 1)
    zero.step()
    plain_params = _params()
    plain = torch.optim.Adam(plain_params, lr=0.01)
    _set_grads(plain_params, 1)
    plain.step()
    saved = copy.deepcopy(plain.state_dict())  # loading would share the state tensors
    for group in saved["param_groups"]:
        for flag in ("decoupled_weight_decay", "fused", "capturable", "differentiable"):
            group.pop(flag)
    zero.load_state_dict(saved)
    _set_grads(params, 2)
    _set_grads(plain_params, 2)
    zero.step()
    plain.step()
    return all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


@pytest.mark.parametrize("mode", ["sorted_greedy", "flat"])
def test_same_optimizer_state_dict_still_loads(world2: World, mode: str) -> None:
    assert world2.run(_own_state_dict_still_loads, mode) == [True, True]


def _check_failed_local_load(rank: int, world_size: int, mode: str) -> bool:
    """Adam's groups with SGD's per-parameter state: the local Adam's load fails half-way
    (``KeyError: 'step'``); its state and param groups are put back as they were."""
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01, **MODES[mode])
    _set_grads(params, 1)
    zero.step()
    adam, sgd = _foreign_state_dict("Adam"), _foreign_state_dict("SGD")
    crossed = {"state": sgd["state"], "param_groups": adam["param_groups"]}
    before = _snapshot(zero)
    with pytest.raises(KeyError, match="step"):
        zero.load_state_dict(crossed)
    assert _same(before, _snapshot(zero))
    _set_grads(params, 2)
    zero.step()  # no KeyError: 'exp_avg'
    return True


@pytest.mark.parametrize("mode", ["sorted_greedy", "bucket_view"])
def test_failed_local_load_leaves_the_local_optimizer_as_it_was(world2: World, mode: str) -> None:
    assert world2.run(_check_failed_local_load, mode) == [True, True]


# -- sparse gradients ---------------------------------------------------------------------------


def _torch_message(optim_class: type[torch.optim.Optimizer]) -> str:
    params = _params()
    _set_grads(params, 1, sparse=True)
    with pytest.raises(RuntimeError) as info:
        optim_class(params, lr=0.01).step()
    return str(info.value)


def _check_sparse_refused(rank: int, world_size: int, mode: str) -> str:
    """Both ranks' gradients are sparse: each raises Adam's own error (with or without the
    step undo), and no parameter changes."""
    expected = _torch_message(torch.optim.Adam)
    for undo in (False, True):
        params = _params()
        zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01, **MODES[mode])
        zero.undo_step_on_failure = undo
        _set_grads(params, 1, sparse=True)
        saved = [p.detach().clone() for p in params]
        with pytest.raises(RuntimeError) as info:
            zero.step()
        assert type(info.value) is RuntimeError, type(info.value)
        assert str(info.value) == expected
        assert all(torch.equal(p, s) for p, s in zip(params, saved, strict=True))
    return str(info.value)


@pytest.mark.parametrize("mode", list(MODES))
def test_sparse_gradients_raise_the_local_optimizers_error(world2: World, mode: str) -> None:
    for message in world2.run(_check_sparse_refused, mode):
        assert message.startswith("Adam does not support sparse gradients"), message


def _check_sparse_sgd(rank: int, world_size: int, mode: str) -> bool:
    """SGD takes sparse gradients: ZeRO steps them as a plain SGD does (whole parameters)."""
    params, plain_params = _params(), _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9, **MODES[mode])
    plain = torch.optim.SGD(plain_params, lr=0.1, momentum=0.9)
    for step in range(3):
        for model, optim in ((params, zero), (plain_params, plain)):
            _set_grads(model, step, sparse=True)
            optim.step()
    return all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


@pytest.mark.parametrize("mode", ["sorted_greedy", "cost_balanced"])
def test_sparse_gradients_step_like_plain_sgd(world2: World, mode: str) -> None:
    assert world2.run(_check_sparse_sgd, mode) == [True, True]


def _check_sparse_sgd_refused(rank: int, world_size: int, mode: str) -> str:
    """Bucket views and flat pieces start at an offset of a flat buffer, where torch's
    ``dense.add_(sparse)`` writes out of bounds: SGD's sparse step is refused, nothing changes,
    and the next (dense) step is a plain SGD's."""
    params, plain_params = _params(), _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9, **MODES[mode])
    plain = torch.optim.SGD(plain_params, lr=0.1, momentum=0.9)
    for model, optim in ((params, zero), (plain_params, plain)):
        _set_grads(model, 0)
        optim.step()
    before = _snapshot(zero)
    _set_grads(params, 1, sparse=True)
    with pytest.raises(RuntimeError, match="does not support sparse gradients") as info:
        zero.step()
    assert _same(before, _snapshot(zero)), "the refused step changed something"
    for model, optim in ((params, zero), (plain_params, plain)):
        _set_grads(model, 2)
        optim.step()
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))
    return str(info.value)


@pytest.mark.parametrize("mode", ["bucket_view", "flat"])
def test_sparse_gradients_refused_where_parameters_are_buffer_views(
    world2: World, mode: str
) -> None:
    option = {"bucket_view": "parameters_as_bucket_view", "flat": "partition"}[mode]
    for message in world2.run(_check_sparse_sgd_refused, mode):
        assert message.startswith("ZeroRedundancyOptimizer with " + option), message
        assert "please consider" in message, message


def _check_sparse_on_one_rank(rank: int, world_size: int) -> str:
    """Only rank 0's gradients are sparse: it raises torch's error, rank 1 waits in the sync."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, process_group=group, lr=0.01)
    _set_grads(params, 1, sparse=rank == 0)
    dist.barrier()
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"^Adam does not support sparse gradients"):
            zero.step()
        return "raised"
    with pytest.raises(CollectiveFailedError) as info:
        zero.step()
    assert info.value.failed_ranks == [0], str(info.value)
    return str(info.value)


def test_sparse_gradients_on_one_rank(world2: World) -> None:
    raised, waited = world2.run(_check_sparse_on_one_rank)
    assert raised == "raised"
    assert waited.startswith("ZeroRedundancyOptimizer.step failed: rank 0 did not answer"), waited


class FoAdam(fo.Optimizer):
    """A functional_optim Adam with a torch-like constructor (ZeRO's local optimizer)."""

    elementwise_update = True  # Adam is: partition="flat" may split its parameters

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, fo.adam(lr=lr))


def _check_sparse_functional(rank: int, world_size: int, mode: str) -> str:
    expected = _torch_message(torch.optim.Adam)
    params = _params()
    zero = ZeroRedundancyOptimizer(params, FoAdam, lr=0.01, **MODES[mode])
    _set_grads(params, 1, sparse=True)
    saved = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError) as info:
        zero.step()
    assert str(info.value) == expected, str(info.value)
    assert all(torch.equal(p, s) for p, s in zip(params, saved, strict=True))
    return str(info.value)


# Keep last: before functional_optim refused sparse gradients, this corrupted the heap.
@pytest.mark.parametrize("mode", ["sorted_greedy", "flat"])
def test_sparse_gradients_with_a_functional_optim_optimizer(world2: World, mode: str) -> None:
    """Depends on functional_optim raising torch's message before it touches anything."""
    for message in world2.run(_check_sparse_functional, mode):
        assert message.startswith("Adam does not support sparse gradients"), message
