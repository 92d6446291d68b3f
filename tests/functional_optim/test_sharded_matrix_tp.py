"""Whole-matrix methods on tensor-parallel and 2-D-mesh DTensor matrices (2 gloo ranks).

Placements beyond FSDP2's ``Shard(0)``: column shards (``Shard(1)``, tensor parallelism's
row-wise layers), strided shards (FSDP2 over a tensor-parallel shard), and 2-D meshes of shape
(1, 2) and (2, 1), where a ``Replicate`` dim of size 2 makes both ranks hold the same block
(sent once, returned to both). Reference: single-process ``torch.optim.Muon`` on the whole
tensors, fed the same gradients; tolerance: bitwise (each owner orthogonalises exactly the
bfloat16 cast of the whole direction). ``fo.per_matrix`` in a chain against the same chain on
whole tensors, bitwise (the matrices travel in their own dtype).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_optim as fo
import functional_optim._owner_compute as owner_compute
from tests._world import World
from tests.functional_optim._dtensor_blocks import from_full

SHAPES = [(7, 5), (33, 9), (16, 24), (1, 6), (6, 1)]
STEPS = 3
MUON: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True}


@pytest.fixture(scope="module")
def world2() -> Any:
    with World(2) as world:
        yield world


def _layouts(world_size: int) -> list[tuple[Any, list[list[Any]]]]:
    """(mesh, one placement list per matrix) cases."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = init_device_mesh("cpu", (world_size,))
    wide = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    tall = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    strided = _StridedShard(1, split_factor=2)
    return [
        (flat, [[Shard(1)], [Shard(0)], [Shard(1)], [Shard(1)], [Shard(0)]]),
        (flat, [[strided], [_StridedShard(0, split_factor=3)], [strided], [Shard(0)], [strided]]),
        (wide, ([[Replicate(), Shard(1)], [Shard(0), Shard(1)], [Shard(1), Shard(0)]] * 2)[:5]),
        (tall, ([[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]] * 2)[:5]),
    ]


def _run(tx: Any, mesh: Any, placements: list[list[Any]], reference: Any) -> list[float]:
    """``STEPS`` steps of ``tx`` on DTensors and of ``reference(params)`` on whole tensors;
    the largest difference of each matrix (0.0: bitwise)."""
    shapes = SHAPES[: len(placements)]
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    ours = [
        torch.nn.Parameter(from_full(f, mesh, pl)) for f, pl in zip(fulls, placements, strict=True)
    ]
    ref = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt, ref_opt = fo.Optimizer(ours, tx), reference(ref)
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g, pl in zip(ours, ref, grads, placements, strict=True):
            p.grad, q.grad = from_full(g, mesh, pl), g
        opt.step()
        ref_opt.step()
    return [float((p.full_tensor() - q).detach().abs().max()) for p, q in zip(ours, ref)]


def _check_muon(rank: int, world_size: int, adjust: str | None) -> list[list[float]]:
    del rank
    return [
        _run(
            fo.muon(**MUON, adjust_lr_fn=adjust),  # type: ignore[arg-type]
            mesh,
            placements,
            lambda ps: torch.optim.Muon(ps, **MUON, adjust_lr_fn=adjust),
        )
        for mesh, placements in _layouts(world_size)
    ]


def _orthogonal(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(x).Q if x.size(0) >= x.size(1) else torch.linalg.qr(x.t()).Q.t()


def _chain() -> Any:
    return fo.chain(
        fo.trace(0.9, nesterov=True),
        fo.per_matrix(_orthogonal),
        fo.add_decayed_weights(0.1),
        fo.scale_by_learning_rate(0.05),
    )


def _check_per_matrix(rank: int, world_size: int) -> list[list[float]]:
    del rank
    return [
        _run(_chain(), mesh, placements, lambda ps: fo.Optimizer(ps, _chain()))
        for mesh, placements in _layouts(world_size)
    ]


@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_tensor_parallel_placements_match_torch_bitwise(world2: World, adjust: str | None) -> None:
    for diffs in world2.run(_check_muon, adjust):
        assert diffs == [[0.0] * len(d) for d in diffs], diffs


def test_per_matrix_chain_matches_whole_tensors_bitwise(world2: World) -> None:
    for diffs in world2.run(_check_per_matrix):
        assert diffs == [[0.0] * len(d) for d in diffs], diffs


def _trace_collectives(rank: int, world_size: int) -> tuple[list[str], float]:
    """The order of the step's collective starts and waits, and the result's difference from
    one batch (``MAX_BATCHES = 1``)."""
    from torch.distributed.tensor import Shard

    del rank
    mesh, _ = _layouts(world_size)[0]
    events: list[str] = []
    start, wait = owner_compute._start, owner_compute._wait

    def traced_start(*args: Any) -> Any:
        events.append("start")
        return start(*args)

    def traced_wait(t: Any) -> Any:
        events.append("wait")
        return wait(t)

    placements = [[Shard(0)]] * len(SHAPES)
    results = []
    owner_compute.MIN_BATCH_BYTES = 0  # batch these small matrices too
    for batches in (owner_compute.MAX_BATCHES, 1):
        owner_compute.MAX_BATCHES = batches
        owner_compute._PLANS.clear()
        owner_compute._start, owner_compute._wait = traced_start, traced_wait  # type: ignore
        try:
            events.clear()
            _run(fo.muon(**MUON), mesh, placements, lambda ps: torch.optim.Muon(ps, **MUON))
            results.append(list(events))
        finally:
            owner_compute._start, owner_compute._wait = start, wait  # type: ignore
            owner_compute.MAX_BATCHES = 4
            owner_compute._PLANS.clear()
    owner_compute.MIN_BATCH_BYTES = 1 << 20
    return results[0][: len(results[0]) // STEPS], float(len(results[1]) // STEPS)


def test_later_batches_travel_while_earlier_ones_compute(world2: World) -> None:
    for events, one_batch in world2.run(_trace_collectives):
        # owners of SHAPES at 2 ranks: rank 0 the (16, 24), rank 1 four -> 4 batches, each a
        # gather and a return; every gather is started before the first wait
        batches = events.count("start") // 2
        assert batches == 4, events
        assert events.count("wait") == 2 * batches, events
        assert events[: batches + 1] == ["start"] * batches + ["wait"], events
        assert one_batch == 4  # one batch: two collectives, two waits


def _check_errors(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    messages = []
    unnamed = init_device_mesh("cpu", (1, world_size))
    flat = init_device_mesh("cpu", (world_size,))
    cols = 3 if rank == 0 else 4  # the ranks disagree on the matrix
    disagree = DTensor.from_local(
        torch.ones(4, cols), flat, [Shard(0)], shape=(8, cols), stride=(cols, 1)
    )
    unnamed_param = from_full(torch.ones(4, 6), unnamed, [Shard(0), Shard(1)])
    rows = 4 if rank == 0 else 2  # torch.chunk gives rank 1 three rows of 7: only it sees it
    misplaced = DTensor.from_local(
        torch.ones(rows, 3), flat, [Shard(0)], shape=(7, 3), stride=(3, 1)
    )
    for param in (disagree, unnamed_param, misplaced):
        p = torch.nn.Parameter(param)
        p.grad = torch.ones_like(p)
        opt = fo.Optimizer([p], fo.muon(lr=0.05))
        before = p._local_tensor.clone()  # type: ignore[attr-defined]
        with pytest.raises(ValueError) as info:
            opt.step()
        messages.append(str(info.value))
        assert torch.equal(p._local_tensor, before)  # type: ignore[attr-defined]
        assert not opt.state_dict()["state"], "state was created"
    return messages


def test_bad_layouts_raise_before_any_change(world2: World) -> None:
    (disagree, unnamed, misplaced), other = world2.run(_check_errors)
    assert "the ranks disagree on the sharded matrices Muon steps" in disagree
    assert "rank 1 has 1" in other[0] or "rank 0 has 1" in other[0]
    assert "need mesh_dim_names" in unnamed
    assert "rank 1: a local shape Muon cannot place" in misplaced  # rank 0 raises too
    assert "local shape (2, 3), not the (3, 3) of torch.chunk's rule" in other[2]
