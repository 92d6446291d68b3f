"""_matrix_layout: each rank's block of a sharded matrix, against DTensor's own sharding rules.

Single process: torch's ``_compute_local_shape_and_global_offset`` (rectangular layouts) and
``_StridedShard._split_tensor`` (strided ones) define where a rank's block sits; the blocks of
all ranks must also tile the matrix exactly once (per replica).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import functional_optim as fo
from functional_optim._matrix_layout import Region, local_region, region_get, region_set
from functional_optim._owner_compute import assign_owners

SHAPES = [(7, 5), (33, 9), (1, 6), (6, 1), (16, 24), (2, 2)]
MESHES = [(2,), (3,), (2, 2), (1, 2), (2, 1), (3, 2)]
PLACEMENTS = [Shard(0), Shard(1), Replicate()]


def _coordinates(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(s) for s in mesh)))


def _block(whole: torch.Tensor, region: Region) -> torch.Tensor:
    return region_get(whole, region)


@pytest.mark.parametrize("mesh", MESHES)
def test_rectangular_blocks_match_dtensor(mesh: tuple[int, ...]) -> None:
    for shape, placements in itertools.product(
        SHAPES, itertools.product(PLACEMENTS, repeat=len(mesh))
    ):
        whole = torch.arange(shape[0] * shape[1]).view(shape)
        for c in _coordinates(mesh):
            local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(c), placements)
            region = local_region(shape, placements, mesh, c)
            assert region.shape == tuple(local), (shape, placements, c)
            expected = whole[offset[0] : offset[0] + local[0], offset[1] : offset[1] + local[1]]
            assert torch.equal(_block(whole, region), expected), (shape, placements, c)


def _strided_local(whole: torch.Tensor, placements: list[Any], mesh: tuple[int, ...], c: Any):
    """The local block by torch's own split functions, in mesh-dim order."""
    local = whole
    for d, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        chunks, _ = placement._split_tensor(local, mesh[d], with_padding=False)
        local = chunks[c[d]]
    return local


@pytest.mark.parametrize("dim", [0, 1])
def test_strided_blocks_match_torch_split(dim: int) -> None:
    mesh = (2, 2)
    cases = [
        [_StridedShard(dim, split_factor=2), Shard(dim)],  # FSDP2 over a tensor-parallel shard
        [_StridedShard(dim, split_factor=2), Replicate()],
        [_StridedShard(dim, split_factor=3), Shard(1 - dim)],
    ]
    for shape, placements in itertools.product(SHAPES, cases):
        whole = torch.arange(shape[0] * shape[1]).view(shape)
        for c in _coordinates(mesh):
            expected = _strided_local(whole, placements, mesh, c)
            region = local_region(shape, placements, mesh, c)
            assert torch.equal(_block(whole, region), expected), (shape, placements, c)


@pytest.mark.parametrize("mesh", [(2, 2), (3, 2)])
def test_blocks_tile_the_matrix(mesh: tuple[int, ...]) -> None:
    placements = [_StridedShard(0, split_factor=2), Shard(1)]
    for shape in SHAPES:
        whole = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)
        rebuilt = torch.full(shape, -1.0)
        for c in _coordinates(mesh):
            region = local_region(shape, placements, mesh, c)
            region_set(rebuilt, region, _block(whole, region))
        assert torch.equal(rebuilt, whole), shape


def test_partial_is_refused() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(ValueError, match="neither Shard nor Replicate"):
        local_region((4, 4), [Partial()], (2,), (0,))


def test_assign_owners_balances_cost() -> None:
    shapes = [(16, 24), (24, 16), (7, 5), (33, 9), (1, 6)]
    # costs 16*24*16 = 6144 (twice), 7*5*5 = 175, 33*9*9 = 2673, 1*6*1 = 6
    assert assign_owners(shapes, 2) == [0, 1, 1, 0, 1]
    assert assign_owners(shapes, 3) == [0, 1, 2, 2, 2]
    assert assign_owners([(4, 4)] * 3, 4) == [0, 1, 2]
    # a caller's cost, by rows: 33 first, then 24 and 16 (rank 1), 7 and 1 (rank 0)
    assert assign_owners(shapes, 2, cost=lambda m, n: float(m)) == [1, 1, 0, 0, 0]


def test_per_matrix_refuses_non_matrices_and_maps_plain_tensors() -> None:
    with pytest.raises(ValueError, match="per_matrix takes 2-D params"):
        fo.per_matrix(torch.linalg.matrix_exp).init({"w": torch.zeros(3, 3), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        fo.Optimizer([torch.nn.Parameter(torch.zeros(2, 3, 4))], fo.muon(lr=0.1))
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3, generator=gen))
    w.grad = torch.randn(4, 3, generator=gen)
    expected = w.detach().add(torch.linalg.qr(w.grad).Q, alpha=-0.1)  # the lr tail's add
    opt = fo.Optimizer([w], fo.chain(fo.per_matrix(_q), fo.scale_by_learning_rate(0.1)))
    opt.step()
    assert torch.equal(w.detach(), expected)


def _q(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q
