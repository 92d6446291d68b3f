"""fo.adafactor (and Novograd, SM3) on FSDP2 shards (``Shard(0)``, 2 ranks, uneven shards).

Reference: the same ``fo.Optimizer`` transform run unsharded in one process on the same params
and gradients (fo.adafactor's unsharded run is itself bitwise torch.optim.Adafactor, see
test_optim_db). Tolerance rtol 1e-5, atol 1e-7 (measured: at most 1.2e-7 absolute on params of
order 1; SM3 is bitwise): the sharded column sums, row_var means, RMS terms and Novograd norms
add the shards' squares in float64 in another order than the unsharded float32 norms. The model
has matrices split by rows with unequal shards (5 and 6 rows on 2 ranks), a (3, 6, 4) param
split along its leading dim, vectors (biases) and a (1, 4) matrix whose second shard is empty.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import functional_optim as fo
from tests._world import World
from tests.functional_optim._dtensor_blocks import from_full

RTOL, ATOL = 1e-5, 1e-7
STEPS = 3

CASES: dict[str, Callable[[], Any]] = {
    "default": lambda: fo.adafactor(),
    "weight_decay": lambda: fo.adafactor(lr=0.05, weight_decay=0.1),
    "eps_maximize": lambda: fo.adafactor(lr=0.2, eps=(1e-4, 1e-2), d=1.5, maximize=True),
    "transform_chain": lambda: fo.chain(
        fo.scale_by_adafactor(lr=0.05), fo.add_decayed_weights(-0.005)
    ),
    # Novograd: per-param gradient norms (partial sums of squares, one all-reduce)
    "novograd": lambda: fo.novograd(learning_rate=1e-2, weight_decay=0.1),
    # SM3: per-dimension max accumulators (the dims over the rows: one all-reduce, max)
    "sm3": lambda: fo.sm3(learning_rate=0.1),
}


class _Net(torch.nn.Module):
    """Linear(8, 5), Linear(5, 6), a (3, 6, 4) mixing tensor and a (1, 4) gain."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 5)
        self.fc2 = torch.nn.Linear(5, 6)
        self.mix = torch.nn.Parameter(torch.randn(3, 6, 4) * 0.3)
        self.gain = torch.nn.Parameter(torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.tanh(self.fc1(x)))
        return torch.einsum("bi,kij->bkj", h, self.mix) * self.gain


def _plain_net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _fsdp_net() -> _Net:
    from torch.distributed.fsdp import fully_shard

    net = _plain_net()
    fully_shard(net.fc1)
    fully_shard(net.fc2)
    fully_shard(net)
    return net


def _grads(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) * (0.1 + i) for i, shape in enumerate(shapes)]


def _set_sharded_grads(params: list[Any], step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for p, g in zip(params, _grads(step, [p.shape for p in params]), strict=True):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)


def _set_plain_grads(params: list[torch.Tensor], step: int) -> None:
    for p, g in zip(params, _grads(step, [p.shape for p in params]), strict=True):
        p.grad = g


def _run_unsharded(make: Callable[[], Any]) -> tuple[list[torch.Tensor], dict[int, Any]]:
    params = list(_plain_net().parameters())
    opt = fo.Optimizer(params, make())
    for step in range(STEPS):
        _set_plain_grads(params, step)
        opt.step()
    return [p.detach() for p in params], opt.state_dict()["state"]


def _check_vs_unsharded(rank: int, world_size: int, case: str) -> float:
    """3 sharded steps == 3 unsharded steps (params and every state buffer); the state
    layouts: row_var split like its param, col_var of a matrix replicated and whole."""
    make = CASES[case]
    net = _fsdp_net()
    params = list(net.parameters())
    plain = list(_plain_net().parameters())
    for p, q in zip(params, plain, strict=True):  # FSDP2 splits as torch.chunk does
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=0)
    assert net.gain._local_tensor.shape[0] == 1 - rank  # type: ignore[attr-defined]  # no row on rank 1
    opt = fo.Optimizer(params, make())
    for step in range(STEPS):
        _set_sharded_grads(params, step)
        opt.step()
    want, want_state = _run_unsharded(make)
    worst = 0.0
    for got, ref in zip(params, want, strict=True):
        torch.testing.assert_close(got.full_tensor(), ref, rtol=RTOL, atol=ATOL)
        worst = max(worst, float((got.full_tensor() - ref).abs().max().detach()))
    state = opt.state_dict()["state"]
    for k, p in enumerate(params):
        assert state[k].keys() == want_state[k].keys(), k
        for key, ref in want_state[k].items():
            value = state[k][key]
            if not isinstance(ref, torch.Tensor):
                assert value == ref, (k, key)
                continue
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            assert whole.shape == ref.shape, (k, key, whole.shape, ref.shape)
            torch.testing.assert_close(whole, ref, rtol=RTOL, atol=ATOL)
            if key == "row_var" or (key == "col_var" and p.dim() > 2):  # split like the param
                assert value.placements == p.placements, (k, key, value.placements)
            elif key == "col_var":  # a matrix's col_var: whole on every rank
                assert value.placements[0].is_replicate(), (k, key, value.placements)
                assert value._local_tensor.shape == ref.shape, (k, key)
    return worst


def _copy_net(net: _Net) -> _Net:
    other = _fsdp_net()
    with torch.no_grad():
        for p, q in zip(other.parameters(), net.parameters(), strict=True):
            p._local_tensor.copy_(q._local_tensor)
    return other


def _check_state_dict_round_trip(rank: int, world_size: int) -> bool:
    """state_dict() / load_state_dict() and DCP get/set_optimizer_state_dict of the sharded
    optimizer: the resumed optimizers step bitwise as the original."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    net = _fsdp_net()
    opt = fo.Optimizer(net.parameters(), fo.adafactor(lr=0.05, weight_decay=0.1))
    for step in range(2):
        _set_sharded_grads(list(net.parameters()), step)
        opt.step()
    plain_net, dcp_net = _copy_net(net), _copy_net(net)
    plain_opt = fo.Optimizer(plain_net.parameters(), fo.adafactor(lr=0.05, weight_decay=0.1))
    plain_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load shares tensors
    dcp_opt = fo.Optimizer(dcp_net.parameters(), fo.adafactor(lr=0.05, weight_decay=0.1))
    saved = copy.deepcopy(get_optimizer_state_dict(net, opt))
    set_optimizer_state_dict(dcp_net, dcp_opt, saved)
    for step in range(2, 4):
        for model, optimizer in ((net, opt), (plain_net, plain_opt), (dcp_net, dcp_opt)):
            _set_sharded_grads(list(model.parameters()), step)
            optimizer.step()
    for p, q, r in zip(net.parameters(), plain_net.parameters(), dcp_net.parameters(), strict=True):
        assert torch.equal(p._local_tensor, q._local_tensor)
        assert torch.equal(p._local_tensor, r._local_tensor)
    return True


def _check_other_placements_raise(rank: int, world_size: int) -> str:
    """A param of 3 dims split along its middle dim raises, naming the param, before any
    change."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = next(iter(_fsdp_net().parameters())).device_mesh
    p = torch.nn.Parameter(DTensor.from_local(torch.ones(3, 2, 4), mesh, [Shard(1)]))
    p.grad = DTensor.from_local(torch.ones(3, 2, 4), mesh, [Shard(1)])
    opt = fo.Optimizer([p], fo.adafactor())
    with pytest.raises(ValueError, match="param 0 of param group 0 has placements") as info:
        opt.step()
    assert torch.equal(p._local_tensor, torch.ones(3, 2, 4))
    assert not opt.state_dict()["state"]
    return str(info.value)


#: (mesh shape, placements per matrix) of tensor-parallel layouts on 2 ranks
TP_SHAPES = [(7, 5), (6, 9), (1, 6), (5, 1)]


def _tp_layouts(world_size: int) -> list[tuple[Any, list[Any]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = init_device_mesh("cpu", (world_size,))
    wide = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    tall = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    strided = _StridedShard(1, split_factor=2)
    return [
        (flat, [[Shard(1)], [Shard(0)], [Shard(1)], [strided]]),
        (wide, [[Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Shard(0)]] * 2),
        (tall, [[Shard(0), Shard(1)], [Replicate(), Shard(1)], [Shard(1), Replicate()]] * 2),
    ]


def _check_tensor_parallel(rank: int, world_size: int) -> list[float]:
    """fo.adafactor on matrices split along columns (and rows) == unsharded, rtol 1e-5; the
    state: row_var split like the param's rows, col_var like its columns."""
    from torch.distributed.tensor import DTensor

    del rank
    worst = []
    for mesh, placements in _tp_layouts(world_size):
        gen = torch.Generator().manual_seed(0)
        fulls = [torch.randn(s, generator=gen) for s in TP_SHAPES]
        ours = [
            torch.nn.Parameter(from_full(f, mesh, pl))
            for f, pl in zip(fulls, placements, strict=False)
        ]
        ref = [torch.nn.Parameter(f.clone()) for f in fulls]
        opt = fo.Optimizer(ours, fo.adafactor(lr=0.05, weight_decay=0.1))
        ref_opt = fo.Optimizer(ref, fo.adafactor(lr=0.05, weight_decay=0.1))
        for _ in range(STEPS):
            grads = [torch.randn(s, generator=gen) for s in TP_SHAPES]
            for p, q, g, pl in zip(ours, ref, grads, placements, strict=False):
                p.grad, q.grad = from_full(g, mesh, pl), g.clone()
            opt.step()
            ref_opt.step()
        for p, q in zip(ours, ref, strict=True):
            torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=RTOL, atol=ATOL)
            worst.append(float((p.full_tensor() - q).abs().max().detach()))
        for k, p in enumerate(ours):
            mine, want = opt.state[p], ref_opt.state[ref[k]]
            for key in ("row_var", "col_var"):
                assert isinstance(mine[key], DTensor), (k, key)
                torch.testing.assert_close(mine[key].full_tensor(), want[key], rtol=RTOL, atol=ATOL)
    return worst


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


def test_fsdp2_adafactor_matches_unsharded(world2: World) -> None:
    for case in CASES:
        worst = world2.run(_check_vs_unsharded, case)
        assert worst[0] == worst[1], case  # every rank sees the same full tensors


def test_fsdp2_adafactor_state_dict_round_trip(world2: World) -> None:
    assert world2.run(_check_state_dict_round_trip) == [True, True]


def test_fsdp2_adafactor_refuses_middle_dim_shards(world2: World) -> None:
    first, second = world2.run(_check_other_placements_raise)
    assert first == second
    assert "params of 3+ dims split by Shard(0) on a 1-D mesh" in first


def test_tensor_parallel_adafactor_matches_unsharded(world2: World) -> None:
    first, second = world2.run(_check_tensor_parallel)
    assert first == second  # every rank sees the same full tensors
