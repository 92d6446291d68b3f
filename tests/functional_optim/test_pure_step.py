"""``fo.pure_step``: new params and state, inputs untouched; bitwise equal to the in-place
``tx.step`` where that step ends in one list kernel, to ``update`` + ``apply_updates`` where it
does not, and the differentiable per-leaf path under autograd and ``torch.func``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._pure_step import kernel_writes
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params

LR, WD = 0.05, 0.1
TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-14)}


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, Tensor)]


def _others(tree: Any) -> list[Any]:
    return [x for x in tree_leaves(tree) if not isinstance(x, Tensor)]


def _is_matrix(tree: Any) -> Any:
    return fo.tree_map(lambda p: p is not None and p.ndim > 1, tree)


def _clip_adamw(decay: fo.GradientTransformation) -> fo.GradientTransformation:
    return fo.chain(
        fo.clip_by_global_norm(0.5),
        fo.scale_by_adam(0.8, 0.9),
        decay,
        fo.scale_by_learning_rate(fo.linear_schedule(LR, LR / 10, 3)),
    )


#: Transforms whose step ends in one list kernel: pure_step runs that kernel on copies.
FUSED: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adam": lambda: fo.adam(lr=LR, betas=(0.8, 0.9)),
    "adam l2 maximize": lambda: fo.adam(lr=LR, weight_decay=WD, maximize=True),
    "adam amsgrad": lambda: fo.adam(lr=LR, amsgrad=True),
    "adamw": lambda: fo.adamw(lr=LR, weight_decay=WD),
    "sgd momentum nesterov": lambda: fo.sgd(lr=LR, momentum=0.9, nesterov=True),
    "sgd momentum maximize": lambda: fo.sgd(lr=LR, momentum=0.9, maximize=True),
    "rmsprop centered": lambda: fo.rmsprop(lr=LR, centered=True, momentum=0.5),
    "adagrad": lambda: fo.adagrad(lr=LR),
    "nadam": lambda: fo.nadam(lr=LR),
    "lion": lambda: fo.lion(LR, weight_decay=WD),
    "chain clip adamw schedule": lambda: _clip_adamw(fo.add_decayed_weights(WD)),
    "chain masked decay": lambda: _clip_adamw(fo.masked(fo.add_decayed_weights(WD), _is_matrix)),
    "chain tensor lr": lambda: fo.chain(fo.scale_by_adam(), fo.scale(torch.tensor(-LR))),
    "chain ending in an alias": lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(LR)),
    "lion chain": lambda: fo.chain(fo.scale_by_lion(), fo.scale_by_learning_rate(LR)),
    "rms chain": lambda: fo.chain(fo.scale_by_rms(), fo.add_decayed_weights(WD), fo.scale(-LR)),
    "adamax chain": lambda: fo.chain(fo.scale_by_adamax(), fo.scale(-LR)),
    "momentum chain": lambda: fo.chain(fo.trace(0.9), fo.scale(-LR)),
}

#: Transforms whose step is not one kernel: pure_step is update + apply_updates.
UNFUSED: dict[str, Callable[[], fo.GradientTransformation]] = {
    "scale_by_adam alone": fo.scale_by_adam,
    "adam then an ascent scale": lambda: fo.chain(fo.scale_by_adam(), fo.scale(2.0)),
}


def _run(
    tx: fo.GradientTransformation,
    dtype: torch.dtype,
    none_every: int,
    chunk_bytes: int,
) -> None:
    step = fo.pure_step(tx, chunk_bytes=chunk_bytes)
    params = make_params(dtype=dtype)
    state = tx.init(params)
    in_place_params = clone_tensors(params)
    in_place_state = tx.init(in_place_params)
    ref_params, ref_state = params, state
    for row in make_grads(params, 3, none_every=none_every):
        before = clone_tensors([*params, *row, *_tensors(state)])
        new_params, new_state = step(params, row, state)
        after = [*params, *row, *_tensors(state)]
        assert_tensors_equal(after, before, what="an input was mutated")
        fused = tx.step is not None and kernel_writes(tx, state) is not None
        if fused:  # (the per-leaf update may keep the buffers of a leaf without a gradient)
            old_ids = {id(x) for x in _tensors(state)}
            assert not old_ids & {id(x) for x in _tensors(new_state)}, "new state aliases old"
            in_place_state = tx.step(in_place_params, clone_tensors(row), in_place_state)
            assert_tensors_equal(list(new_params), in_place_params, what="params vs tx.step")
            assert_tensors_equal(
                _tensors(new_state), _tensors(in_place_state), what="state vs tx.step"
            )
            assert _others(new_state) == _others(in_place_state)
        updates, ref_state = tx.update(row, ref_state, ref_params)
        ref_params = fo.apply_updates(ref_params, updates)
        rtol, atol = TOL[dtype] if fused else (0.0, 0.0)
        assert_tensors_equal(list(new_params), list(ref_params), rtol, atol, what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), rtol, atol, what="state")
        params, state = new_params, new_state


@pytest.mark.parametrize("chunk_bytes", [1, fo._pure_step.CHUNK_BYTES])
@pytest.mark.parametrize("none_every", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_pure_step_matches_in_place_step(
    name: str, dtype: torch.dtype, none_every: int, chunk_bytes: int
) -> None:
    tx = FUSED[name]()
    assert kernel_writes(tx, tx.init(make_params())) is not None
    _run(tx, dtype, none_every, chunk_bytes)


@pytest.mark.parametrize("name", sorted(UNFUSED))
def test_unfused_pure_step_is_update_then_apply(name: str) -> None:
    tx = UNFUSED[name]()
    assert kernel_writes(tx, tx.init(make_params())) is None
    _run(tx, torch.float64, 3, 64)


def test_pure_step_keeps_params_without_grad() -> None:
    params = {"a": torch.randn(3), "b": torch.randn(2)}
    new, _ = fo.pure_step(fo.adam(lr=LR))(
        params, {"a": torch.randn(3), "b": None}, fo.adam().init(params)
    )
    assert new["b"] is params["b"]
    assert not torch.equal(new["a"], params["a"])


def _loss(params: list[Tensor]) -> Tensor:
    return sum((p * p).sum() for p in params)  # type: ignore[return-value]


def test_pure_step_differentiable_under_torch_func() -> None:
    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 1)[0]

    def after_step(lr: Tensor, use_step: bool) -> Tensor:
        tx = fo.adam(lr=lr)
        state = tx.init(params)
        if use_step:
            new, _ = fo.pure_step(tx)(params, grads, state)
        else:
            updates, _ = tx.update(grads, state, params)
            new = fo.apply_updates(params, updates)
        return _loss(new)

    lr = torch.tensor(LR, dtype=torch.float64)
    ours = torch.func.grad(after_step)(lr, True)
    reference = torch.func.grad(after_step)(lr, False)
    assert ours.abs() > 0
    assert_tensors_equal([ours], [reference], what="meta-gradient")


def test_pure_step_under_vmap_and_autograd() -> None:
    tx = fo.adam(lr=LR)
    params = make_params((3, (2, 2)), dtype=torch.float64)
    state = tx.init(params)
    batch = [torch.randn(4, *p.shape, dtype=torch.float64) for p in params]

    def one(*grads: Tensor) -> list[Tensor]:
        new, _ = fo.pure_step(tx)(params, list(grads), state)
        return list(new)

    batched = torch.func.vmap(one)(*batch)
    for k in range(4):
        updates, _ = tx.update([g[k] for g in batch], state, params)
        expected = fo.apply_updates(params, updates)
        assert_tensors_equal([b[k] for b in batched], list(expected), what=f"vmap row {k}")
    leaves = [p.clone().requires_grad_(True) for p in params]
    new, _ = fo.pure_step(tx)(leaves, [g[0] for g in batch], tx.init(leaves))
    _loss(new).backward()
    assert all(p.grad is not None for p in leaves)


def test_pure_step_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="GradientTransformation"):
        fo.pure_step(fo.adam)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        fo.pure_step(fo.adam(), chunk_bytes=0)
    tx = fo.chain(fo.scale_by_adam(), fo.scale(-LR))
    params = make_params()
    with pytest.raises(ValueError, match="chain of 2 transforms"):
        fo.pure_step(tx)(params, params, (tx.init(params)[0],))
