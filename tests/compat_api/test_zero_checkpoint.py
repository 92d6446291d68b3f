"""Sharded optimizer checkpoints (dist_runtime.sharded_checkpoint): save at world 2, reload at 3
and 1, continue bit-identically; a crash between two ranks' writes keeps the previous one.

Gradients are the same on every rank (as after DDP's all-reduce), so an uninterrupted run gives
the same parameters at every world size and the comparisons are bitwise.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_runtime.flat_shards import FlatShards
from dist_runtime.sharded_checkpoint import (
    latest_checkpoint,
    load_optimizer_shards,
    load_plain_optimizer,
    save_optimizer_shards,
)
from tests._world import World

pytestmark = pytest.mark.distributed

SHAPES = [(7, 5), (13,), (3, 4, 2), (), (33,), (2, 9)]
OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("Rprop", {"lr": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9}),
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


class _FailOnRank1(dcp.FileSystemWriter):
    """A writer whose rank 1 dies before writing its shard."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if dist.get_rank() == 1:
            raise OSError("simulated crash of rank 1 before its write")
        return super().write_data(plan, planner)


def _flat_run(
    rank: int,
    world_size: int,
    root: str,
    name: str,
    kwargs: dict[str, Any],
    load: bool,
    steps: range,
    save_after: int | None,
) -> list[torch.Tensor]:
    params = _params(seed=1 if load else 0)  # a loaded run must not depend on its init
    shards = FlatShards(params)
    opt = getattr(torch.optim, name)(shards.local_param_groups(_groups(params)), **kwargs)
    if load:
        extra = {f"param.{i}": p.data for i, p in enumerate(params)}
        load_optimizer_shards(root, opt, shards.piece_info, extra=extra)
    for step in steps:
        _set_grads(params, step)
        shards.attach_local_grads()
        opt.step()
        shards.all_gather_params()
        if step == save_after:
            extra = {f"param.{i}": p.data for i, p in enumerate(params)}
            save_optimizer_shards(
                root, opt, shards.piece_info, params, _groups(params), extra=extra
            )
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(("name", "kwargs"), OPTIMIZERS)
def test_save_at_2_load_at_3_and_1(
    world2: World, world3: World, tmp_path: Any, name: str, kwargs: dict[str, Any]
) -> None:
    root = str(tmp_path)
    uninterrupted = world2.run(_flat_run, root, name, kwargs, False, range(5), 2)
    assert torch.equal(uninterrupted[0][0], uninterrupted[1][0])
    files = sorted(os.listdir(latest_checkpoint(root) or ""))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank

    resumed3 = world3.run(_flat_run, root, name, kwargs, True, range(3, 5), None)
    for params in resumed3:
        for got, want in zip(params, uninterrupted[0]):
            assert torch.equal(got, want)

    params = _params(seed=2)
    opt = getattr(torch.optim, name)(_groups(params), **kwargs)
    extra = {f"param.{i}": p.data for i, p in enumerate(params)}
    load_plain_optimizer(root, opt, extra=extra)
    for step in range(3, 5):
        _set_grads(params, step)
        opt.step()
    for got, want in zip(params, uninterrupted[0]):
        assert torch.equal(got.detach(), want)


def _crash(rank: int, world_size: int, root: str) -> list[Any]:
    params = _params()
    shards = FlatShards(params)
    opt = torch.optim.Adam(shards.local_param_groups(_groups(params)), lr=0.01)
    _set_grads(params, 0)
    shards.attach_local_grads()
    opt.step()
    shards.all_gather_params()
    first = save_optimizer_shards(root, opt, shards.piece_info, params, _groups(params))
    saved = {k: v.clone() for k, v in opt.state[shards.pieces[0]].items()}
    _set_grads(params, 1)
    shards.attach_local_grads()
    opt.step()
    error = ""
    try:
        save_optimizer_shards(
            root, opt, shards.piece_info, params, _groups(params), storage_writer=_FailOnRank1
        )
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        error = type(e).__name__
    dist.barrier()
    latest = latest_checkpoint(root)
    fresh = torch.optim.Adam(shards.local_param_groups(_groups(params)), lr=0.01)
    load_optimizer_shards(root, fresh, shards.piece_info)
    reloaded = fresh.state[shards.pieces[0]]
    same = all(torch.equal(saved[k], reloaded[k]) for k in saved)
    return [error, latest == first, same]


def test_crash_between_writes_keeps_previous(world2: World, tmp_path: Any) -> None:
    for error, latest_is_first, same in world2.run(_crash, str(tmp_path)):
        assert error == "CheckpointException"
        assert latest_is_first
        assert same


def test_no_checkpoint(tmp_path: Any) -> None:
    opt = torch.optim.SGD(_params(), lr=0.1)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        load_plain_optimizer(str(tmp_path), opt)
