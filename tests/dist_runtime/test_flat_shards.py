"""dist_runtime.flat_shards against single-process torch.optim (gloo worlds of 2 and 3).

Gradients are dyadic rationals (multiples of 2**-8, small), so every sum is exact whatever order
gloo adds them in, and dividing by 2 is exact: the flat run must then equal the reference
bitwise. Averaging over 3 ranks is not exact, so world 3 reduces with ``average=False``.
On gloo the reduce-scatter is the ring of dist_runtime.ring_reduce_scatter (checked against
all_reduce and for its bytes sent here).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

import functional_optim as fo
from dist_runtime.flat_shards import (
    FlatShards,
    check_elementwise_optimizer,
    elementwise_optimizers,
)
from dist_runtime.streaming_consolidation import consolidate_piece_states, load_global_state
from tests._world import World

pytestmark = pytest.mark.distributed

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (), (33,), (2, 9)]
FROZEN = 3  # index of a frozen parameter

OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    ("AdamW", {"lr": 0.01}),
    ("Adamax", {"lr": 0.02}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01}),
    ("Adadelta", {"lr": 1.0}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 0.01}),
    ("Adam", {"lr": 0.01, "foreach": True}),
]


def _params() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    for i, p in enumerate(params):
        p.requires_grad_(i != FROZEN)
    return params


def _grad(step: int, rank: int, index: int) -> torch.Tensor | None:
    if step == 1 and index == 1:
        return None  # a parameter without gradient in one step
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + index)
    return torch.randint(-64, 64, SHAPES[index], generator=gen, dtype=torch.float64) / 256


def _groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    return [{"params": params[:4]}, {"params": params[4:], "lr": 0.003}]


def _run_flat(
    rank: int, world_size: int, name: str, kwargs: dict[str, Any], mode: str, steps: int
) -> list[torch.Tensor]:
    params = _params()
    shards = FlatShards(params)
    opt = getattr(torch.optim, name)(shards.local_param_groups(_groups(params)), **kwargs)
    for step in range(steps):
        for i, p in enumerate(params):
            if p.requires_grad:
                # DDP-like mode: every rank holds the same (already averaged) gradient.
                p.grad = _grad(step, 0 if mode == "local" else rank, i)
        if mode == "local":
            shards.attach_local_grads()
        else:
            shards.reduce_scatter_grads(average=mode == "mean")
        opt.step()
        shards.all_gather_params()
    return [p.detach().clone() for p in params]


def _reference(
    world_size: int, name: str, kwargs: dict[str, Any], mode: str, steps: int
) -> list[torch.Tensor]:
    params = _params()
    opt = getattr(torch.optim, name)(_groups(params), **kwargs)
    for step in range(steps):
        for i, p in enumerate(params):
            if not p.requires_grad:
                continue
            if mode == "local":
                p.grad = _grad(step, 0, i)
                continue
            grads = [_grad(step, r, i) for r in range(world_size)]
            if all(g is None for g in grads):
                # reduce_scatter treats missing gradients as zeros
                p.grad = torch.zeros(SHAPES[i], dtype=torch.float64)
                continue
            total = sum(g for g in grads if g is not None)
            assert isinstance(total, torch.Tensor)
            p.grad = total / world_size if mode == "mean" else total
        opt.step()
    return [p.detach().clone() for p in params]


def _parity(world: World, mode: str) -> None:
    for name, kwargs in OPTIMIZERS:
        results = world.run(_run_flat, name, kwargs, mode, 3)
        expected = _reference(world.world_size, name, kwargs, mode, 3)
        for rank, params in enumerate(results):
            for i, (got, want) in enumerate(zip(params, expected)):
                assert torch.equal(got, want), (
                    name,
                    kwargs,
                    mode,
                    rank,
                    i,
                    (got - want).abs().max(),
                )


def test_parity_world2_local_and_mean(world2: World) -> None:
    _parity(world2, "local")
    _parity(world2, "mean")


def test_parity_world3_sum(world3: World) -> None:
    _parity(world3, "sum")


def _layout_facts(rank: int, world_size: int) -> dict[str, Any]:
    params = _params()
    shards = FlatShards(params)
    views = all(
        p.data.data_ptr() >= shards.buckets[0].flat.data_ptr() for p in params if p.requires_grad
    )
    frozen_kept = params[FROZEN].data_ptr() != shards.buckets[0].flat.data_ptr()
    return {
        "numels": shards.shard_numels(),
        "mine": sum(t.numel() for t in shards.pieces),
        "views": views,
        "frozen_kept": frozen_kept,
        "collectives": dict(shards.collectives),
        "shard_size": shards.buckets[0].layout.shard_size,
    }


def test_layout_and_views(world3: World) -> None:
    facts = world3.run(_layout_facts)
    total = sum(math.prod(s) for i, s in enumerate(SHAPES) if i != FROZEN)
    for rank, fact in enumerate(facts):
        assert fact["mine"] == fact["numels"][rank]
        assert sum(fact["numels"]) == total
        assert fact["shard_size"] == -(-total // 3)
        assert fact["views"]
        assert fact["frozen_kept"]


def _clip(rank: int, world_size: int, max_norm: float, norm_type: float) -> list[Any]:
    params = _params()
    shards = FlatShards(params)
    opt = torch.optim.SGD(shards.local_param_groups([{"params": params}]), lr=1.0)
    for i, p in enumerate(params):
        if p.requires_grad:
            p.grad = _grad(0, 0, i)
    shards.attach_local_grads()
    total = shards.clip_grad_norm_(max_norm, norm_type)
    opt.step()
    shards.all_gather_params()
    return [total, [p.detach().clone() for p in params]]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_grad_norm_matches_torch(world2: World, norm_type: float) -> None:
    max_norm = 0.5
    results = world2.run(_clip, max_norm, norm_type)
    params = _params()
    for i, p in enumerate(params):
        if p.requires_grad:
            p.grad = _grad(0, 0, i)
    want = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    torch.optim.SGD(params, lr=1.0).step()
    for total, got in results:
        torch.testing.assert_close(total, want, rtol=1e-12, atol=0)
        for g, w in zip(got, params):
            torch.testing.assert_close(g, w.detach(), rtol=1e-12, atol=1e-15)


class _WholeTensor(torch.optim.SGD):
    elementwise_update = False


def test_check_elementwise_optimizer() -> None:
    """The known element-wise classes are the registry's entries declared ``elementwise``."""
    known = {a.torch_name for a in fo.ALGORITHMS if a.elementwise}
    assert {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Rprop", "ASGD"} <= known
    assert not {"LBFGS", "Adafactor", "Muon", "SparseAdam"} & known
    assert {c.__name__ for c in elementwise_optimizers()} == known
    for name in sorted(known):
        check_elementwise_optimizer(getattr(torch.optim, name))
    with pytest.raises(ValueError, match="declares elementwise_update = False"):
        check_elementwise_optimizer(_WholeTensor)
    for name in ("LBFGS", "Adafactor", "Muon"):
        with pytest.raises(ValueError, match="not a known elementwise optimizer"):
            check_elementwise_optimizer(getattr(torch.optim, name))


def _consolidate(
    rank: int, world_size: int, name: str, kwargs: dict[str, Any], to: int
) -> dict[int, Any] | None:
    params = _params()
    shards = FlatShards(params)
    opt = getattr(torch.optim, name)(shards.local_param_groups(_groups(params)), **kwargs)
    for step in range(2):
        for i, p in enumerate(params):
            if p.requires_grad:
                p.grad = _grad(step, 0, i)
        shards.attach_local_grads()
        opt.step()
        shards.all_gather_params()
    state = consolidate_piece_states(opt, shards.piece_info, to=to)
    snapshot = copy.deepcopy(state)
    shards.attach_local_grads()
    opt.step()  # the consolidated state is a copy: later steps leave it alone
    if state is not None:
        _assert_state_equal(state, snapshot)  # type: ignore[arg-type]
    return state


def _load_and_continue(
    rank: int,
    world_size: int,
    name: str,
    kwargs: dict[str, Any],
    state: dict[int, Any],
    values: list[torch.Tensor],
) -> list[torch.Tensor]:
    params = _params()
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    shards = FlatShards(params)
    opt = getattr(torch.optim, name)(shards.local_param_groups(_groups(params)), **kwargs)
    load_global_state(opt, shards.piece_info, state)
    for i, p in enumerate(params):
        if p.requires_grad:
            p.grad = _grad(2, 0, i)
    shards.attach_local_grads()
    opt.step()
    shards.all_gather_params()
    return [p.detach().clone() for p in params]


def _assert_state_equal(got: dict[int, Any], want: dict[int, Any]) -> None:
    assert list(got) == list(want)
    for index in want:
        assert list(got[index]) == list(want[index])
        for key, value in want[index].items():
            if isinstance(value, torch.Tensor):
                assert got[index][key].shape == value.shape
                assert torch.equal(got[index][key], value), (index, key)
            else:
                assert got[index][key] == value


@pytest.mark.parametrize(("name", "kwargs"), [OPTIMIZERS[1], OPTIMIZERS[6], OPTIMIZERS[7]])
def test_streaming_consolidation_is_torch_state(
    world3: World, name: str, kwargs: dict[str, Any]
) -> None:
    results = world3.run(_consolidate, name, kwargs, 1)
    assert results[0] is None
    assert results[2] is None
    params = _params()
    ref = getattr(torch.optim, name)(_groups(params), **kwargs)
    for step in range(2):
        for i, p in enumerate(params):
            if p.requires_grad:
                p.grad = _grad(step, 0, i)
        ref.step()
    want = ref.state_dict()["state"]
    _assert_state_equal(results[1], want)
    # ...and it loads back into another layout (world 3 flat shards), continuing bitwise.
    values = [p.detach().clone() for p in params]
    resumed = world3.run(_load_and_continue, name, kwargs, want, values)
    for i, p in enumerate(params):
        if p.requires_grad:
            p.grad = _grad(2, 0, i)
    ref.step()
    for got in resumed:
        for g, w in zip(got, params):
            assert torch.equal(g, w.detach())


def _wchar() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def _ring(rank: int, world_size: int, numel: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dist_runtime.ring_reduce_scatter import ring_reduce_scatter

    gen = torch.Generator().manual_seed(rank)
    data = torch.randn(numel * world_size, generator=gen, dtype=torch.float64)
    want = data.clone()
    dist.all_reduce(want)
    out = torch.empty(numel, dtype=torch.float64)
    dist.barrier()
    before = _wchar()
    ring_reduce_scatter(out, data.clone())
    sent = _wchar() - before
    error = ""
    try:
        ring_reduce_scatter(torch.empty(3), torch.empty(7))
    except ValueError as e:
        error = str(e)
    dist.barrier()
    return {
        "out": out,
        "want": want[rank * numel : (rank + 1) * numel],
        "sent": sent,
        "error": error,
    }


@pytest.mark.parametrize("world_name", ["world2", "world3"])
def test_ring_reduce_scatter_is_all_reduce_with_ddp_volume(
    world_name: str, request: pytest.FixtureRequest
) -> None:
    world: World = request.getfixturevalue(world_name)
    n = world.world_size
    numel = 1 << 17  # 1 MiB of float64 per rank's chunk
    for result in world.run(_ring, numel):
        if n == 2:
            # One addition per element: the same as any all-reduce, bitwise.
            assert torch.equal(result["out"], result["want"])
        else:
            # Ring order vs gloo's order: a few ulps of the (unit-scale) sums.
            torch.testing.assert_close(result["out"], result["want"], rtol=1e-14, atol=1e-14)
        ideal = (n - 1) * numel * 8  # (N - 1) / N of the buffer
        assert ideal <= result["sent"] < 1.05 * ideal + 65536, result["sent"]
        assert "world_size" in result["error"]


def _exchange(rank: int, world_size: int) -> dict[str, Any]:
    from dist_runtime.flat_grad_exchange import GradExchange

    params = _params()
    trainable = [i for i, p in enumerate(params) if p.requires_grad]
    grads = {i: _grad(0, rank, i) for i in trainable}
    for i in trainable:
        params[i].grad = grads[i]
    shards = FlatShards(params)
    shards.reduce_scatter_grads(average=True)
    want = [t.grad.clone() for t in shards.pieces]  # type: ignore[union-attr]
    for t in shards.pieces:
        t.grad = None
    exchange = GradExchange(shards)
    # Buckets as DDP hands them over: last parameters first; one bucket seen twice (a new
    # backward pass restarts the round).
    buckets = [trainable[3:], trainable[:3]]
    exchange.add(0, [params[i] for i in buckets[0]], [grads[i] * 7 for i in buckets[0]])
    for key, bucket in enumerate(buckets):
        exchange.add(key, [params[i] for i in bucket], [grads[i] for i in bucket])
    complete = exchange.finish()
    got = [t.grad.clone() for t in shards.pieces]  # type: ignore[union-attr]
    exchange.add(0, [params[i] for i in buckets[0]], [grads[i] for i in buckets[0]])
    partial = exchange.finish()  # the first parameters never came: nothing is attached
    return {"complete": complete, "partial": partial, "got": got, "want": want}


@pytest.mark.parametrize("world_name", ["world2", "world3"])
def test_grad_exchange_equals_reduce_scatter(
    world_name: str, request: pytest.FixtureRequest
) -> None:
    world: World = request.getfixturevalue(world_name)
    for result in world.run(_exchange):
        assert result["complete"]
        assert not result["partial"]
        assert len(result["got"]) == len(result["want"])
        for got, want in zip(result["got"], result["want"]):
            if world.world_size == 2:
                assert torch.equal(got, want)
            else:  # own + others in rank order vs the ring's order
                torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
