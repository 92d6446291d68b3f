"""fo.Optimizer on DTensor params (FSDP2, FSDP + TP): local-shard steps, sharded reductions.

One 2-rank world (FSDP2 on a 1-D mesh) and one 4-rank world (a 2 x 2 ``("dp", "tp")`` mesh).
References: torch's own optimizers on the same FSDP2 model (bitwise where the op order is the
same), the same optimizer on plain copies of the local shards (bitwise), and the unsharded
single-process run of the same ``fo.Optimizer`` (rtol 1e-5, atol 1e-7: the sharded norms add
the shards' squares in another order).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import functional_optim as fo
from functional_optim._shard_context import sharded_norms
from tests._world import World

RTOL, ATOL = 1e-5, 1e-7
WIDTHS = (8, 5, 6)  # odd sizes: FSDP2 shards of unequal length
TP_WIDTHS = (8, 4, 6)  # the tensor-parallel hidden size splits evenly


def _plain_model(seed: int = 0, widths: tuple[int, ...] = WIDTHS) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1])


def _fsdp_model(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _plain_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(100 + step))


def _backward(model: torch.nn.Module, step: int) -> None:
    model(_batch(step)).square().mean().backward()


def _full(params: Any) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]


# -- FSDP2 vs torch, and vs the same optimizer on plain local shards (2 ranks) ----------------

TORCH_CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.optim.Optimizer]]] = {
    "adamw": (
        lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    "adam": (
        lambda: fo.adam(lr=1e-2, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, fused=True),
    ),
}

LOCAL_CASES: dict[str, Callable[[], Any]] = {
    "sgd_momentum": lambda: fo.sgd(lr=0.1, momentum=0.9, nesterov=True),
    "lion": lambda: fo.lion(learning_rate=1e-2, weight_decay=0.1),
    "rmsprop": lambda: fo.rmsprop(lr=1e-2, momentum=0.5),
    "adagrad": lambda: fo.adagrad(lr=1e-1),
    "nadam": lambda: fo.nadam(lr=1e-2),
    "radam": lambda: fo.radam(lr=1e-2),
    "optax_chain": lambda: fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(1e-2)),
}


def _check_vs_torch(rank: int, world_size: int, case: str) -> list[float]:
    make_fo, make_torch = TORCH_CASES[case]
    ours, theirs = _fsdp_model(), _fsdp_model()
    opt_ours = fo.Optimizer(ours.parameters(), make_fo())
    opt_theirs = make_torch(theirs.parameters())
    for step in range(3):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
    state = opt_ours.state_dict()["state"][0]
    assert type(state["exp_avg"]).__name__ == "DTensor", state
    return [
        float((a - b).abs().max())
        for a, b in zip(_full(ours.parameters()), _full(theirs.parameters()), strict=True)
    ]


def _check_vs_local(rank: int, world_size: int, case: str) -> list[float]:
    """The FSDP2 step equals the same optimizer run on plain copies of the local shards."""
    model = _fsdp_model()
    params = list(model.parameters())
    plain = [torch.nn.Parameter(p._local_tensor.detach().clone()) for p in params]
    opt, ref = fo.Optimizer(params, LOCAL_CASES[case]()), fo.Optimizer(plain, LOCAL_CASES[case]())
    for step in range(3):
        _backward(model, step)
        for p, q in zip(plain, params, strict=True):
            q.grad._local_tensor.copy_(torch.randn(q.grad._local_tensor.shape) * 1e-2)  # type: ignore[union-attr]
            p.grad = q.grad._local_tensor.clone()  # type: ignore[union-attr]
        opt.step()
        ref.step()
        opt.zero_grad()
    diffs = [float((p._local_tensor - q).abs().max()) for p, q in zip(params, plain, strict=True)]
    for entry, p in zip(opt.state_dict()["state"].values(), params, strict=True):
        for key, value in entry.items():  # per-param buffers are DTensors with the param's spec
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.placements == p.placements, (key, value)
                assert value.shape == p.shape, (key, value.shape, p.shape)
    return diffs


def _unsharded_run(make: Callable[[], Any], widths: tuple[int, ...]) -> list[torch.Tensor]:
    model = _plain_model(widths=widths)
    opt = fo.Optimizer(model.parameters(), make())
    for step in range(3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


REDUCTION_CASES: dict[str, Callable[[], Any]] = {
    "lamb": lambda: fo.lamb(learning_rate=1e-2, weight_decay=0.1),
    "lars": lambda: fo.lars(learning_rate=1e-1),
    "block_rms": lambda: fo.chain(fo.clip_by_block_rms(1e-3), fo.adam(lr=1e-2)),
    "global_clip": lambda: fo.chain(fo.clip_by_global_norm(0.05), fo.adamw(lr=1e-2)),
    "adafactor": lambda: fo.adafactor(lr=1e-2, weight_decay=0.1),
}


def _check_vs_unsharded(rank: int, world_size: int, case: str, tp: bool = False) -> bool:
    make = REDUCTION_CASES[case]
    model = _tp_fsdp_model() if tp else _fsdp_model()
    opt = fo.Optimizer(model.parameters(), make())
    for step in range(3):
        _backward(model, step)
        opt.step()
        opt.zero_grad()
    expected = _unsharded_run(make, TP_WIDTHS if tp else WIDTHS)
    for got, want in zip(_full(model.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    return True


def _check_clip_vs_torch(rank: int, world_size: int) -> bool:
    """chain(clip_by_global_norm, adamw) on FSDP2 == clip_grad_norm_ + AdamW(fused) on FSDP2."""
    ours, theirs = _fsdp_model(), _fsdp_model()
    opt_ours = fo.Optimizer(
        ours.parameters(), fo.chain(fo.clip_by_global_norm(0.05), fo.adamw(lr=1e-2))
    )
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    for step in range(3):
        _backward(ours, step)
        opt_ours.step()
        opt_ours.zero_grad()
        _backward(theirs, step)
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05)
        assert float(norm.full_tensor()) > 0.05  # the clip is active
        opt_theirs.step()
        opt_theirs.zero_grad()
    for got, want in zip(_full(ours.parameters()), _full(theirs.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    return True


def _snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p._local_tensor.clone() if hasattr(p, "_local_tensor") else p.clone() for p in params]


def _unchanged(params: list[torch.Tensor], before: list[torch.Tensor]) -> bool:
    now = _snapshot(params)
    return all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


def _check_errors(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial

    messages = []

    def expect(
        params: list[torch.Tensor], tx: Any, error: type[Exception], grads: Any = None
    ) -> None:
        for p in params:
            p.grad = torch.ones_like(p) if grads is None else grads(p)
        opt = fo.Optimizer(params, tx)
        before = _snapshot(params)
        with pytest.raises(error) as info:
            opt.step()
        assert _unchanged(params, before)
        assert not opt.state_dict()["state"], "state was created"
        messages.append(str(info.value))

    model = _fsdp_model()
    dt = list(model.parameters())
    mixed = [dt[0], torch.nn.Parameter(torch.ones(3))]
    expect(mixed, fo.adam(lr=0.1), ValueError)
    assert "param 1 of param group 0 is a plain tensor" in messages[-1]

    mesh = dt[0].device_mesh
    other = DeviceMesh("cpu", list(reversed(range(world_size))))
    local = torch.ones(2, 3)
    on_other = torch.nn.Parameter(DTensor.from_local(local, other, dt[0].placements))
    expect([dt[0], on_other], fo.adam(lr=0.1), ValueError)
    assert "param 1 of param group 0 is on device mesh" in messages[-1]

    partial = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Partial()]))
    expect([partial], fo.sgd(lr=0.1), ValueError)
    assert "param 0 of param group 0 has placement" in messages[-1]

    # Adafactor's factored statistics finish over the shards in the local step only; a chain
    # without a fused step (a transform with no list maths) would step the DTensors
    no_lists = fo.GradientTransformation(lambda params: (), lambda u, s, p=None: (u, s))
    expect(dt, fo.chain(fo.scale_by_adafactor(), no_lists), ValueError)
    assert "param 0 of param group 0 is sharded" in messages[-1]

    expect(dt[:2], fo.adam(lr=0.1), TypeError, grads=lambda p: torch.ones(p.shape))
    assert "gradient is a plain tensor" in messages[-1]
    return messages


def test_fsdp2_matches_torch_bitwise(world2: World) -> None:
    for case in TORCH_CASES:
        for diffs in world2.run(_check_vs_torch, case):
            assert max(diffs) == 0.0, (case, diffs)


def test_fsdp2_matches_plain_local_shards_bitwise(world2: World) -> None:
    for case in LOCAL_CASES:
        for diffs in world2.run(_check_vs_local, case):
            assert max(diffs) == 0.0, (case, diffs)


def test_fsdp2_global_clip_matches_torch_clip_grad_norm(world2: World) -> None:
    assert world2.run(_check_clip_vs_torch) == [True, True]


def test_fsdp2_reductions_match_unsharded(world2: World) -> None:
    for case in REDUCTION_CASES:
        assert world2.run(_check_vs_unsharded, case) == [True, True], case


def test_bad_groups_raise_before_any_change(world2: World) -> None:
    first, second = world2.run(_check_errors)
    assert first == second
    assert len(first) == 5


def _check_pure_step(rank: int, world_size: int) -> list[float]:
    """``fo.pure_step`` on FSDP2's DTensor params: DTensors out, inputs untouched, and
    ``tx.step``'s numbers on the same gradients (the kernel runs on clones: no flat buffers)."""
    model = _fsdp_model()
    _backward(model, 0)
    params = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters()]
    tx = fo.adamw(lr=0.05, weight_decay=0.1)
    step = fo.pure_step(tx)
    ref_params = [p.clone() for p in params]
    ref_state = tx.init(ref_params)
    state = tx.init(params)
    before = _snapshot(params)
    new_params, state = step(params, grads, state)
    new_params, state = step(new_params, grads, state)
    for _ in range(2):
        ref_state = tx.step(ref_params, [g.clone() for g in grads], ref_state)
    assert all(type(p).__name__ == "DTensor" for p in new_params)
    assert _unchanged(params, before)
    return [
        float((a - b).abs().max()) if a.numel() else 0.0
        for a, b in zip(_full(new_params), _full(ref_params), strict=True)
    ]


def test_pure_step_on_fsdp2_params_matches_its_in_place_step(world2: World) -> None:
    for diffs in world2.run(_check_pure_step):
        assert max(diffs) == 0.0, diffs


TX_STEP_CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.optim.Optimizer]]] = {
    "sgd_momentum": (
        lambda: fo.sgd(lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    ),
    "adagrad": (lambda: fo.adagrad(lr=0.1), lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
}


def _check_tx_step_on_dtensors(rank: int, world_size: int) -> dict[str, list[float]]:
    """``tx.step`` straight on FSDP2's DTensor params: SGD and Adagrad, whose fused CPU kernels
    have no DTensor rule, take torch's default (foreach) path and match torch's optimizer."""
    diffs = {}
    for case, (make, make_torch) in TX_STEP_CASES.items():
        ours, theirs = _fsdp_model(), _fsdp_model()
        tx = make()
        params = [p.detach() for p in ours.parameters()]
        state = tx.init(params)
        opt = make_torch(list(theirs.parameters()))
        for step in range(2):
            _backward(ours, step)
            _backward(theirs, step)
            state = tx.step(params, [p.grad for p in ours.parameters()], state)
            opt.step()
            ours.zero_grad()
            opt.zero_grad()
        diffs[case] = [
            float((a - b).abs().max()) if a.numel() else 0.0
            for a, b in zip(_full(ours.parameters()), _full(theirs.parameters()), strict=True)
        ]
    return diffs


def test_tx_step_on_fsdp2_params_takes_kernels_without_a_dtensor_rule(world2: World) -> None:
    for diffs in world2.run(_check_tx_step_on_dtensors):
        assert diffs.keys() == TX_STEP_CASES.keys()
        assert all(max(d) == 0.0 for d in diffs.values()), diffs


# -- 2 x 2 mesh: FSDP on "dp", tensor parallel on "tp" (4 ranks) -------------------------------


def _tp_fsdp_model() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _plain_model(widths=TP_WIDTHS)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


@pytest.fixture(scope="module")
def world4() -> Iterator[World]:
    with World(4) as world:
        yield world


def test_fsdp_tp_mesh_matches_unsharded(world4: World) -> None:
    for case in ("global_clip", "lamb", "block_rms", "adafactor"):
        assert world4.run(_check_vs_unsharded, case, True) == [True] * 4, case


def _check_muon_tp(rank: int, world_size: int) -> tuple[list[float], list[str]]:
    """fo.muon on the FSDP + TP matrices vs torch's Muon on the unsharded ones, fed the same
    (full) gradients: the largest difference per matrix, and the matrices' placements."""
    model, ref = _tp_fsdp_model(), _plain_model(widths=TP_WIDTHS)
    mats = [p for p in model.parameters() if p.dim() == 2]
    ref_mats = [p for p in ref.parameters() if p.dim() == 2]
    args = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    opt, ref_opt = fo.Optimizer(mats, fo.muon(**args)), torch.optim.Muon(ref_mats, **args)
    for step in range(3):
        _backward(model, step)
        for p, q in zip(mats, ref_mats, strict=True):
            q.grad = p.grad.full_tensor()  # type: ignore[union-attr]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    diffs = [
        float((p.full_tensor() - q).detach().abs().max())  # type: ignore[operator]
        for p, q in zip(mats, ref_mats, strict=True)
    ]
    return diffs, [str(tuple(p.placements)) for p in mats]  # type: ignore[attr-defined]


def test_fsdp_tp_muon_matches_torch_bitwise(world4: World) -> None:
    for diffs, placements in world4.run(_check_muon_tp):
        assert diffs == [0.0] * len(diffs), (diffs, placements)
        # column-parallel under FSDP: a strided row shard; row-parallel: rows and columns
        assert any("_StridedShard(dim=0" in pl for pl in placements), placements
        assert any("Shard(dim=1)" in pl for pl in placements), placements


# -- plain tensors: nothing changes (single process) -------------------------------------------


def test_plain_params_skip_the_local_step() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fo.Optimizer(params, fo.adamw(lr=1e-2, weight_decay=0.1))
    theirs = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for p, q in zip(params, ref, strict=True):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            q.grad = p.grad.clone()
        opt.step()
        theirs.step()
    assert opt._sharded._caches == {0: None}  # looked at once, never unwrapped
    for p, q in zip(params, ref, strict=True):
        assert torch.equal(p, q)
    assert sharded_norms([params[0]], [params[0]]) is None  # no shard context: unsharded maths
