"""examples/qhm_optimizer.py: the custom-optimizer recipe runs scripted and equals eager QHM."""

from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from examples.qhm_optimizer import QHM, FunctionalQHM, register
from torch import Tensor
from torch.distributed import rpc

from compat_api.optimizer import DistributedOptimizer
from compat_api.utils import functional_optim_map
from dist_runtime import rpc_optim
from dist_runtime._script_local_optimizer import ScriptLocalOptimizerModule
from tests._world import World

HYPER = {"lr": 0.1, "momentum": 0.9, "nu": 0.7}


def _eager_qhm(params: list[Tensor], grads: list[list[Tensor | None]]) -> None:
    opt = QHM(params, **HYPER)
    for row in grads:
        for param, grad in zip(params, row, strict=True):
            param.grad = grad
        opt.step()


def test_qhm_follows_the_quasi_hyperbolic_update() -> None:
    param = torch.tensor([1.0], requires_grad=True)
    grads: list[list[Tensor | None]] = [[torch.tensor([2.0])], [torch.tensor([-1.0])]]
    _eager_qhm([param], grads)
    buf1 = 0.1 * 2.0
    p1 = 1.0 - 0.1 * (0.7 * buf1 + 0.3 * 2.0)
    buf2 = 0.9 * buf1 + 0.1 * -1.0
    p2 = p1 - 0.1 * (0.7 * buf2 + 0.3 * -1.0)
    torch.testing.assert_close(param.detach(), torch.tensor([p2]))


def test_scripted_functional_qhm_is_bitwise_equal_to_eager_qhm() -> None:
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    grads: list[list[Tensor | None]] = [
        [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)] for _ in range(4)
    ]
    grads[2][1] = None
    scripted_params = [p.clone() for p in start]
    module = rpc_optim.script_quietly(
        ScriptLocalOptimizerModule(FunctionalQHM, scripted_params, (), dict(HYPER))
    )
    assert isinstance(module, torch.jit.ScriptModule)
    for row in grads:
        module.step_with_gradients(row)
    eager_params = [p.clone().requires_grad_() for p in start]
    _eager_qhm(eager_params, grads)
    for ours, theirs in zip(scripted_params, eager_params, strict=True):
        assert torch.equal(ours, theirs.detach())


@pytest.mark.parametrize("cls", [QHM, FunctionalQHM])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "Invalid learning rate: -1.0"),
        ({"momentum": 1.0}, "Invalid momentum value: 1.0"),
        ({"nu": 1.5}, "Invalid nu value: 1.5"),
    ],
)
def test_qhm_validates_hyperparameters(cls: Any, kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls([torch.zeros(1)], **kwargs)


def test_functional_qhm_rejects_an_empty_parameter_list_unless_allowed() -> None:
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        FunctionalQHM([])
    assert FunctionalQHM([], _allow_empty_param_list=True).param_group["params"] == []


def test_register_adds_qhm_to_the_shared_map() -> None:
    try:
        register()
        assert functional_optim_map[QHM] is FunctionalQHM
        assert DistributedOptimizer.functional_optim_map[QHM] is FunctionalQHM
    finally:
        functional_optim_map.pop(QHM, None)


# -- over RPC -------------------------------------------------------------------------------------


def _make_weight() -> Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _forward(weight: rpc.RRef[Tensor], x: Tensor) -> Tensor:
    return torch.tanh(x @ weight.local_value())


def _is_scripted(local: rpc.RRef[Any]) -> bool:
    module = getattr(local.local_value(), "module", None)
    return isinstance(module, torch.jit.ScriptModule)


def _train_qhm(rank: int, world_size: int) -> dict[str, Any]:
    register()
    weight = rpc.remote("worker1", _make_weight)
    opt = DistributedOptimizer(QHM, [weight], **HYPER)
    local_weight = _make_weight()
    local_opt = QHM([local_weight], **HYPER)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        with dist_autograd.context() as context_id:
            loss = (rpc.rpc_sync("worker1", _forward, args=(weight, x)) - y).pow(2).mean()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        local_opt.zero_grad()
        (torch.tanh(x @ local_weight) - y).pow(2).mean().backward()
        local_opt.step()
    owner_scripted = rpc.rpc_sync("worker1", _is_scripted, args=(opt.remote_optimizers[0],))
    return {
        "is_functional_optim": opt.is_functional_optim,
        "owner_scripted": owner_scripted,
        "remote": weight.to_here().detach(),
        "local": local_weight.detach(),
        "start": _make_weight().detach(),
    }


@pytest.mark.distributed
def test_distributed_qhm_runs_scripted_and_equals_eager_qhm() -> None:
    with World(2, init_pg=False, init_rpc=True) as world:
        res = world.run_on([0], _train_qhm)[0]
    assert res["is_functional_optim"]
    assert res["owner_scripted"]
    assert not torch.equal(res["remote"], res["start"])
    assert torch.equal(res["remote"], res["local"])
