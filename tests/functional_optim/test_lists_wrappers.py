"""List maths and fused steps of the wrappers (apply_if_finite): the list path equals
update(inplace=True) bitwise, the fast pure path the per-leaf one, and the step the inner step
on finite gradients only (params and inner state untouched otherwise)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._fusion import plan_tail
from functional_optim._lists import LeafView
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params
from .test_fusion import LR, WD, adamw_chain, mixed_params, pure_update_both_ways


def nan_grads(params: list[Tensor], steps: int, bad: set[int]) -> list[list[Any]]:
    """Gradients with a NaN (and an infinity) in one leaf at the steps in ``bad``."""
    rows = make_grads(params, steps, none_every=4)
    for step in bad:
        g = rows[step][2]
        assert g is not None
        g.view(-1)[0] = float("nan")
        rows[step][0] = torch.full_like(params[0], float("inf"))
    return rows


def tensors_of(tree: Any) -> list[Any]:
    return [x for x in tree_leaves(tree) if isinstance(x, Tensor) or x is None]


#: finite, NaN, finite, NaN, NaN: with max_consecutive_errors=1 steps 1 and 3 are skipped.
FINITE_STEPS, BAD_STEPS, SKIPPED = 5, {1, 3, 4}, {1, 3}


def test_apply_if_finite_lists_equal_inplace_update_bitwise_and_skip() -> None:
    tx = fo.apply_if_finite(fo.chain(fo.scale_by_adam(), fo.scale(-LR)), 1)
    assert tx.lists is not None
    params = mixed_params()
    ref_state, list_state = tx.init(params), tx.init(params)
    for i, row in enumerate(nan_grads(params, FINITE_STEPS, BAD_STEPS)):
        inner_before = clone_tensors(tree_leaves(list_state.inner_state))
        ref_up, ref_state = tx.update(clone_tensors(row), ref_state, params, inplace=True)
        view = LeafView(params, clone_tensors(row))
        out, list_state = tx.lists.apply(view.grads, list_state, view)
        assert_tensors_equal(view.full(out), tree_leaves(ref_up), what=f"step {i}")
        assert_tensors_equal(tree_leaves(list_state), tree_leaves(ref_state), what="state")
        if i in SKIPPED:
            assert all(float(u.abs().sum()) == 0 for u in out)
            assert_tensors_equal(tree_leaves(list_state.inner_state), inner_before)
    assert int(list_state.total_notfinite) == len(BAD_STEPS)


def test_apply_if_finite_fast_pure_path_equals_per_leaf_path_bitwise() -> None:
    tx = fo.chain(fo.apply_if_finite(fo.chain(fo.scale_by_lion(), fo.scale(-LR)), 1))
    params = mixed_params()
    fast_state, slow_state = tx.init(params), tx.init(params)
    slow_p = [p.clone().requires_grad_(True) for p in params]
    for row in nan_grads(params, FINITE_STEPS, BAD_STEPS):
        _, fast_state, _, slow_state = pure_update_both_ways(
            tx, row, (params, fast_state), (slow_p, slow_state)
        )
        assert_tensors_equal(tree_leaves(fast_state), tree_leaves(slow_state), what="state")


@pytest.mark.parametrize("inner", ["chain", "alias"])
def test_apply_if_finite_step_is_the_inner_step_on_finite_gradients_only(inner: str) -> None:
    def make_inner() -> fo.GradientTransformation:
        return adamw_chain() if inner == "chain" else fo.adamw(lr=LR, weight_decay=WD)

    tx = fo.chain(fo.scale(1.0), fo.apply_if_finite(make_inner(), 1))
    assert tx.step is not None
    assert plan_tail(tx.lists.hyper["transforms"]).rule == "step"  # type: ignore[union-attr]
    params = make_params(dtype=torch.float64)
    ours, state = clone_tensors(params), tx.init(params)
    ref_tx = make_inner()
    assert ref_tx.step is not None
    theirs, ref_state = clone_tensors(params), ref_tx.init(params)
    for i, row in enumerate(nan_grads(params, FINITE_STEPS, BAD_STEPS)):
        before = clone_tensors(ours)
        state = tx.step(ours, clone_tensors(row), state)
        if i in SKIPPED:
            assert_tensors_equal(ours, before, what="params after a skipped step")
        else:
            ref_state = ref_tx.step(theirs, clone_tensors(row), ref_state)
        assert_tensors_equal(ours, theirs, what=f"params after step {i}")
        assert_tensors_equal(tensors_of(state[1].inner_state), tensors_of(ref_state))
    assert int(state[1].notfinite_count) == 2  # steps 3 and 4; the last one went through
    assert int(state[1].total_notfinite) == len(BAD_STEPS)
