"""Low-bit optimizer states under sharding: bitwise the same parameters as one process.

Blocks are defined over the whole flattened parameter, so 1 process, ZeRO (every partition
mode, ``flat`` at 2 and 3 ranks) and FSDP2-style ``Shard(0)`` DTensors at 2 ranks give
bit-identical parameters. The shapes make pieces straddle blocks (block size 64) and a small
batch size makes params span several batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import functional_optim as fo
from compat_api import ZeroRedundancyOptimizer
from functional_optim._lowbit import transform as lowbit_transform
from tests._world import World

SHAPES = [(37, 53), (129, 31), (300,), (7, 5), (64, 64)]
KINDS = {"int8": fo.adamw8bit, "int4": fo.adamw4bit, "fp8": fo.adamw_fp8}
STEPS = 4


class LowbitAdamW(fo.Optimizer):
    """A torch-style constructor around ``fo.adamw8bit`` & co (for ZeRO's optimizer_class)."""

    elementwise_update = True

    def __init__(self, params: Any, lr: float = 1e-2, kind: str = "int8") -> None:
        super().__init__(params, KINDS[kind](lr=lr, block_size=64, min_size=200))


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) * (1 + i) for i, s in enumerate(SHAPES)]


def _train(opt: Any, params: list[Any], steps: range, shard: bool = False) -> None:
    """Give ``params`` the gradients of ``steps`` (as ``Shard(0)`` DTensors with ``shard``)
    and step ``opt`` after each."""
    for step in steps:
        for p, g in zip(params, _grads(step), strict=True):
            if shard:
                from torch.distributed.tensor import Shard, distribute_tensor

                g = distribute_tensor(g, p.device_mesh, [Shard(0)])
            p.grad = g
        opt.step()


def _reference(kind: str) -> list[torch.Tensor]:
    params = [torch.nn.Parameter(p) for p in _params()]
    opt = LowbitAdamW(params, kind=kind)
    _train(opt, params, range(STEPS))
    return [p.detach() for p in params]


def _mismatches(got: list[torch.Tensor], expected: list[torch.Tensor]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if not torch.equal(a, b)]


def _zero_case(rank: int, world_size: int, kind: str, partition: str) -> list[int]:
    lowbit_transform.BATCH_ELEMENTS = 256  # several batches per param
    expected = _reference(kind)
    params = [torch.nn.Parameter(p) for p in _params()]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition=partition, lr=1e-2, kind=kind)
    _train(zero, params, range(STEPS))
    return _mismatches([p.detach() for p in params], expected)


def _dtensor_case(rank: int, world_size: int, kind: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    lowbit_transform.BATCH_ELEMENTS = 256
    expected = _reference(kind)
    mesh = init_device_mesh("cpu", (world_size,))
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in _params()]
    opt = LowbitAdamW(params, kind=kind)
    _train(opt, params, range(STEPS), shard=True)
    return _mismatches([p.full_tensor().detach() for p in params], expected)


def _quantised_somewhere(rank: int, world_size: int) -> bool:
    """Sanity: the layout really straddles (some shared blocks) in the flat mode."""
    params = [torch.nn.Parameter(p) for p in _params()]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2)
    sharing = zero.strategy.shards.block_sharing()
    flags = torch.tensor([float(sharing.slots)])
    dist.all_reduce(flags)
    return bool(flags.item() > 0)


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Iterator[World]:
    with World(3) as world:
        yield world


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_flat_two_ranks_bitwise(world2: World, kind: str) -> None:
    assert world2.run(_zero_case, kind, "flat") == [[], []]


@pytest.mark.parametrize("partition", ["sorted_greedy", "cost_balanced"])
def test_zero_whole_param_modes_bitwise(world2: World, partition: str) -> None:
    assert world2.run(_zero_case, "int8", partition) == [[], []]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dtensor_shard0_two_ranks_bitwise(world2: World, kind: str) -> None:
    assert world2.run(_dtensor_case, kind) == [[], []]


def test_flat_layout_straddles_blocks(world3: World) -> None:
    assert world3.run(_quantised_somewhere) == [True, True, True]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_flat_three_ranks_bitwise(world3: World, kind: str) -> None:
    assert world3.run(_zero_case, kind, "flat") == [[], [], []]


def _reference_state(kind: str, steps: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    params = [torch.nn.Parameter(p) for p in _params()]
    opt = LowbitAdamW(params, kind=kind)
    _train(opt, params, range(steps))
    return [p.detach() for p in params], opt.state_dict()


def _consolidate_case(rank: int, world_size: int, kind: str) -> list[str]:
    """Consolidated ZeRO flat state == one process's state, bit for bit."""
    lowbit_transform.BATCH_ELEMENTS = 256
    _, expected = _reference_state(kind, 2)
    params = [torch.nn.Parameter(p) for p in _params()]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    _train(zero, params, range(2))
    zero.consolidate_state_dict(to=0)
    if rank != 0:
        return []
    got = zero.state_dict()["state"]
    wrong = []
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            if not torch.equal(got[index][key], value):
                wrong.append(f"{index}.{key}")
    return wrong


def _reshard_case(rank: int, world_size: int, kind: str) -> list[int]:
    """One process's checkpoint loaded into ZeRO flat on this world resumes bitwise."""
    lowbit_transform.BATCH_ELEMENTS = 256
    expected, _ = _reference_state(kind, 4)
    start, saved = _reference_state(kind, 2)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    zero.load_state_dict(saved)
    _train(zero, params, range(2, 4))
    return _mismatches([p.detach() for p in params], expected)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_zero_flat_consolidates_to_the_one_process_state(world2: World, kind: str) -> None:
    assert world2.run(_consolidate_case, kind) == [[], []]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_one_process_checkpoint_reshards_into_zero_flat(world3: World, kind: str) -> None:
    assert world3.run(_reshard_case, kind) == [[], [], []]


def _save_case(rank: int, world_size: int, kind: str, root: str) -> None:
    lowbit_transform.BATCH_ELEMENTS = 256
    params = [torch.nn.Parameter(p) for p in _params()]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    _train(zero, params, range(2))
    zero.save_sharded(root)


def _load_case(rank: int, world_size: int, kind: str, root: str) -> list[int]:
    lowbit_transform.BATCH_ELEMENTS = 256
    expected, _ = _reference_state(kind, 4)
    start, _ = _reference_state(kind, 2)
    params = [torch.nn.Parameter(p.clone()) for p in start]
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    zero.load_sharded(root)
    _train(zero, params, range(2, 4))
    return _mismatches([p.detach() for p in params], expected)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_sharded_checkpoint_two_ranks_to_three_and_one(
    world2: World, world3: World, kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from dist_runtime.sharded_checkpoint import load_plain_optimizer

    root = str(tmp_path_factory.mktemp(f"lowbit_{kind}"))
    world2.run(_save_case, kind, root)
    assert world3.run(_load_case, kind, root) == [[], [], []]
    lowbit_transform.BATCH_ELEMENTS = 256
    try:
        expected, _ = _reference_state(kind, 4)
        start, _ = _reference_state(kind, 2)
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = LowbitAdamW(params, kind=kind)
        load_plain_optimizer(root, opt)
        _train(opt, params, range(2, 4))
        assert _mismatches([p.detach() for p in params], expected) == []
    finally:
        lowbit_transform.BATCH_ELEMENTS = 1 << 18


def _diloco_case(rank: int, world_size: int) -> list[float]:
    """A low-bit inner optimizer under DiLoCo (outer SGD, lr 1: the outer step is the average)
    against the same inner steps with the parameters averaged by hand every 3 steps."""
    from compat_api.algorithms.model_averaging import DiLoCoAverager
    from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer

    def grads(step: int) -> list[torch.Tensor]:
        return [g * (1 + rank) for g in _grads(step)]

    ours = [torch.nn.Parameter(p) for p in _params()]
    averager = DiLoCoAverager(fo.sgd(lr=1.0), period=3, params=ours)
    optimizer = PostLocalSGDOptimizer(LowbitAdamW(ours), averager)
    ref = [torch.nn.Parameter(p) for p in _params()]
    ref_opt = LowbitAdamW(ref)
    errors = []
    for step in range(6):
        for p, q, g in zip(ours, ref, grads(step), strict=True):
            p.grad, q.grad = g, g.clone()
        optimizer.step()
        ref_opt.step()
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                for q in ref:
                    dist.all_reduce(q)
                    q /= world_size
        errors.append(max(float((p - q).abs().max()) for p, q in zip(ours, ref, strict=True)))
    assert "exp_avg_codes" in optimizer.state_dict()["state"][0]
    return errors


def test_lowbit_inner_optimizer_under_diloco(world2: World) -> None:
    for errors in world2.run(_diloco_case):
        assert max(errors) < 1e-5, errors


def _holder(tensors: list[torch.Tensor]) -> torch.nn.Module:
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in tensors])
    return module


def _dsd_save_case(rank: int, world_size: int, kind: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    lowbit_transform.BATCH_ELEMENTS = 256
    model = _holder(_params())
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    _train(zero, params, range(2))
    dcp.save({"optim": get_optimizer_state_dict(model, zero)}, checkpoint_id=root)


def _dsd_load_case(rank: int, world_size: int, kind: str, root: str) -> list[int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    lowbit_transform.BATCH_ELEMENTS = 256
    expected, _ = _reference_state(kind, 4)
    start, _ = _reference_state(kind, 2)
    model = _holder(start)
    params = list(model.parameters())
    zero = ZeroRedundancyOptimizer(params, LowbitAdamW, partition="flat", lr=1e-2, kind=kind)
    target = get_optimizer_state_dict(model, zero)
    dcp.load({"optim": target}, checkpoint_id=root)
    set_optimizer_state_dict(model, zero, target)
    _train(zero, params, range(2, 4))
    return _mismatches([p.detach() for p in params], expected)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_zero_dsd_checkpoint_two_ranks_to_three(
    world2: World, world3: World, kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = str(tmp_path_factory.mktemp(f"dsd_{kind}"))
    world2.run(_dsd_save_case, kind, root)
    assert world3.run(_dsd_load_case, kind, root) == [[], [], []]


def _dtensor_params(world_size: int, full: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    return [torch.nn.Parameter(distribute_tensor(p.clone(), mesh, [Shard(0)])) for p in full]


def _dcp_save_case(rank: int, world_size: int, kind: str, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    lowbit_transform.BATCH_ELEMENTS = 256
    params = _dtensor_params(world_size, _params())
    opt = LowbitAdamW(params, kind=kind)
    _train(opt, params, range(2), shard=True)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=root)


def _dcp_load_case(rank: int, world_size: int, kind: str, root: str) -> list[int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    lowbit_transform.BATCH_ELEMENTS = 256
    expected, _ = _reference_state(kind, 4)
    start, _ = _reference_state(kind, 2)
    params = _dtensor_params(world_size, start)
    opt = LowbitAdamW(params, kind=kind, lr=0.0)
    for p in params:  # a template: state for every param (lr 0: nothing moves)
        p.grad = distribute_tensor(torch.zeros(p.shape), p.device_mesh, [Shard(0)])
    opt.step()
    template = opt.state_dict()
    dcp.load({"optim": template}, checkpoint_id=root)
    opt.load_state_dict(template)
    for group in opt.param_groups:
        group["lr"] = 1e-2
    _train(opt, params, range(2, 4), shard=True)
    return _mismatches([p.full_tensor().detach() for p in params], expected)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_dcp_of_dtensor_params_reshards_two_to_three(
    world2: World, world3: World, kind: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = str(tmp_path_factory.mktemp(f"dcp_{kind}"))
    world2.run(_dcp_save_case, kind, root)
    assert world3.run(_dcp_load_case, kind, root) == [[], [], []]
