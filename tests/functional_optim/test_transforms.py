"""Transforms one by one: formulas vs torch, pure == in-place bitwise, state conversions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params

TRANSFORMS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "scale": lambda: fo.scale(-0.3),
    "scale_by_schedule": lambda: fo.scale_by_schedule(fo.linear_schedule(1.0, 0.1, 3)),
    "add_decayed_weights": lambda: fo.add_decayed_weights(0.1),
    "clip_by_global_norm": lambda: fo.clip_by_global_norm(0.5),
    "trace": lambda: fo.trace(0.9, 0.2),
    "trace_nesterov": lambda: fo.trace(0.9, nesterov=True),
    "scale_by_adam": lambda: fo.scale_by_adam(amsgrad=True),
    "scale_by_adamax": lambda: fo.scale_by_adamax(),
    "scale_by_rms": lambda: fo.scale_by_rms(centered=True),
    "scale_by_adagrad": lambda: fo.scale_by_adagrad(lr_decay=0.1, initial_accumulator_value=0.1),
    "scale_by_adadelta": lambda: fo.scale_by_adadelta(),
    "scale_by_rprop": lambda: fo.scale_by_rprop(0.01),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pure_and_inplace_agree_bitwise(name: str, dtype: torch.dtype) -> None:
    """The one maths definition gives the same numbers in both modes; pure never mutates."""
    tx = TRANSFORMS[name]()
    params = make_params(dtype=dtype)
    grads = make_grads(params, 4, none_every=3)
    pure_state, inplace_state = tx.init(params), tx.init(clone_tensors(params))
    for row in grads:
        snapshot = [x.clone() for x in tree_leaves(pure_state) if isinstance(x, Tensor)]
        pure_up, pure_state_new = tx.update(row, pure_state, params)
        after = [x for x in tree_leaves(pure_state) if isinstance(x, Tensor)]
        assert_tensors_equal(after, snapshot, what="pure input state")
        pure_state = pure_state_new
        in_up, inplace_state = tx.update(clone_tensors(row), inplace_state, params, inplace=True)
        assert_tensors_equal(tree_leaves(in_up), tree_leaves(pure_up), what=name)
        assert_tensors_equal(
            [x for x in tree_leaves(inplace_state) if isinstance(x, Tensor) or x is None],
            [x for x in tree_leaves(pure_state) if isinstance(x, Tensor) or x is None],
            what=name + " state",
        )


@settings(max_examples=20)
@given(max_norm=st.floats(0.0, 5.0), seed=st.integers(0, 1000), none_every=st.sampled_from([0, 2]))
def test_clip_by_global_norm_matches_torch(max_norm: float, seed: int, none_every: int) -> None:
    params = make_params(seed=seed)
    grads = make_grads(params, 1, seed=seed, none_every=none_every)[0]
    tx = fo.clip_by_global_norm(max_norm)
    ours, _ = tx.update(grads, tx.init(params))
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = None if g is None else g.clone()
    torch.nn.utils.clip_grad_norm_(leaves, max_norm, foreach=False)
    assert_tensors_equal(ours, [leaf.grad for leaf in leaves])


def test_clip_rejects_negative() -> None:
    with pytest.raises(ValueError, match="max_norm"):
        fo.clip_by_global_norm(-1.0)


def test_add_decayed_weights_needs_params_and_tensor_decay() -> None:
    g, p = [torch.ones(2)], [torch.full((2,), 2.0)]
    tx = fo.add_decayed_weights(0.5)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(g, tx.init(p))
    out, _ = fo.add_decayed_weights(torch.tensor(0.5)).update(g, (), p)
    assert torch.equal(out[0], torch.full((2,), 2.0))
    out, _ = fo.add_decayed_weights(0.0).update(g, ())
    assert out is g


def test_trace_matches_torch_sgd_momentum_buffers() -> None:
    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 5, none_every=2)
    tx = fo.trace(0.9, 0.3)
    state = tx.init(params)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.SGD(leaves, lr=0.1, momentum=0.9, dampening=0.3, foreach=False)
    for row in grads:
        _, state = tx.update(row, state, params)
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g
        opt.step()
    expected = [opt.state[leaf].get("momentum_buffer") for leaf in leaves]
    assert_tensors_equal(state.momentum_buffer, expected)


def test_scale_by_schedule_counts_updates() -> None:
    seen: list[int] = []

    def schedule(count: Tensor | int) -> float:
        seen.append(int(count))
        return 2.0

    tx = fo.scale_by_schedule(schedule)
    state = tx.init([torch.ones(1)])
    for _ in range(3):
        _, state = tx.update([torch.ones(1)], state)
    assert seen == [0, 1, 2]
    assert int(state.count) == 3
    lr_tx = fo.scale_by_learning_rate(fo.constant_schedule(0.5))
    out, _ = lr_tx.update([torch.ones(1)], lr_tx.init([torch.ones(1)]))
    assert torch.equal(out[0], torch.full((1,), -0.5))
    out, _ = fo.scale_by_learning_rate(0.5, flip_sign=False).update([torch.ones(1)], ())
    assert torch.equal(out[0], torch.full((1,), 0.5))


def test_inject_hyperparams_changes_take_effect() -> None:
    tx = fo.inject_hyperparams(fo.sgd)(lr=0.1)
    params = [torch.ones(2)]
    state = tx.init(params)
    assert state.hyperparams["lr"] == 0.1
    out, state = tx.update([torch.ones(2)], state, params)
    assert torch.equal(out[0], torch.full((2,), -0.1))
    state = state._replace(hyperparams={**state.hyperparams, "lr": 0.5})
    out, _ = tx.update([torch.ones(2)], state, params)
    assert torch.equal(out[0], torch.full((2,), -0.5))
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        tx.update([torch.ones(2)], state._replace(hyperparams={"lr": -1}), params)


def _round_trip(tx: fo.GradientTransformation, params: list[Tensor]) -> Any:
    state = tx.init(params)
    for row in make_grads(params, 3, none_every=2):
        _, state = tx.update(row, state, params)
    per_param, group = fo.to_torch_state(state, params)
    back = fo.from_torch_state(tx.init(params), params, per_param, group)
    assert_tensors_equal(
        [x for x in tree_leaves(back) if isinstance(x, Tensor)],
        [x for x in tree_leaves(state) if isinstance(x, Tensor)],
    )
    return per_param, group


def test_torch_state_names_and_collisions() -> None:
    params = make_params()
    per_param, group = _round_trip(fo.adam(amsgrad=True), params)
    assert sorted(per_param[2]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert group == {}
    tx = fo.chain(
        fo.trace(0.9), fo.trace(0.5), fo.scale_by_adam(), fo.scale_by_learning_rate(lambda c: 0.1)
    )
    per_param, group = _round_trip(tx, params)
    assert sorted(per_param[2]) == [
        "1.momentum_buffer",
        "exp_avg",
        "exp_avg_sq",
        "momentum_buffer",
        "step",
    ]
    assert list(group) == ["3.count"]
    with pytest.raises(ValueError, match="per-param dicts"):
        fo.from_torch_state(tx.init(params), params, per_param[:1], group)
