"""The list path and the fused chain step (_lists, _fusion): list maths == update(inplace=True)
bitwise, fused chains == torch's fused kernels bitwise, and == the pure path within tolerance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim import _tail_kernels as tail_kernels
from functional_optim._fusion import plan_tail
from functional_optim._input_checks import GradRules
from functional_optim._kernel_runner import run_kernel
from functional_optim._lists import FusedTail, LeafView, TailCall
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params

TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-14)}
WD, LR = 0.1, 0.05


def is_matrix(tree: Any) -> Any:
    return fo.tree_map(lambda p: p is not None and p.ndim > 1, tree)


def label(tree: Any) -> Any:
    return fo.tree_map(lambda p: "mat" if p is not None and p.ndim > 1 else "vec", tree)


def adamw_chain(lr: float = LR, wd: float = WD) -> fo.GradientTransformation:
    return fo.chain(fo.scale_by_adam(), fo.add_decayed_weights(wd), fo.scale_by_learning_rate(lr))


#: Every transform with list maths, in configurations that exercise its branches.
LIST_TRANSFORMS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "identity": fo.identity,
    "scale": lambda: fo.scale(-0.3),
    "scale_tensor": lambda: fo.scale(torch.tensor(-0.3, dtype=torch.float64)),
    "scale_by_schedule": lambda: fo.scale_by_schedule(fo.linear_schedule(1.0, 0.1, 3)),
    "add_decayed_weights": lambda: fo.add_decayed_weights(0.1),
    "add_decayed_weights_tensor": lambda: fo.add_decayed_weights(torch.tensor(0.1)),
    "clip_by_global_norm": lambda: fo.clip_by_global_norm(0.5),
    "scale_by_adam": fo.scale_by_adam,
    "scale_by_adam_amsgrad": lambda: fo.scale_by_adam(amsgrad=True),
    "scale_by_lion": fo.scale_by_lion,
    "trace": lambda: fo.trace(0.9, 0.2),
    "trace_nesterov": lambda: fo.trace(0.9, nesterov=True),
    "masked": lambda: fo.masked(fo.scale_by_adam(), is_matrix),
    "multi_transform": lambda: fo.multi_transform(
        {"mat": fo.scale_by_lion(), "vec": fo.scale(2.0)}, label
    ),
    "chain": lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.scale_by_adam(), fo.scale(-0.1)),
    "inject_hyperparams": lambda: fo.inject_hyperparams(fo.scale_by_adam)(b1=0.8),
    "scale_by_rms": fo.scale_by_rms,
    "scale_by_rms_centered": lambda: fo.scale_by_rms(0.9, centered=True),
    "scale_by_adagrad": lambda: fo.scale_by_adagrad(initial_accumulator_value=0.1),
    "scale_by_adagrad_decay": lambda: fo.scale_by_adagrad(lr_decay=0.3),
    "scale_by_adadelta": lambda: fo.scale_by_adadelta(0.8),
    "scale_by_adamax": lambda: fo.scale_by_adamax(0.8, 0.9),
    "scale_by_rprop": lambda: fo.scale_by_rprop(0.01, step_sizes=(0.009, 0.011)),
    "clip": lambda: fo.clip(0.5),
    "clip_tensor": lambda: fo.clip(torch.tensor(0.5)),
    "clip_by_block_rms": lambda: fo.clip_by_block_rms(0.5),
    "centralize": fo.centralize,
    "scale_by_sign": fo.scale_by_sign,
    "set_to_zero": fo.set_to_zero,
    "freeze": lambda: fo.freeze(is_matrix),
    "scale_by_trust_ratio": lambda: fo.scale_by_trust_ratio(0.1, 0.5, 1e-3),
    "keep_params_nonnegative": fo.keep_params_nonnegative,
    "zero_nans": fo.zero_nans,
    "scale_by_optax_adam": lambda: fo.scale_by_optax_adam(eps_root=1e-8, nesterov=True),
    "scale_by_amsgrad": fo.scale_by_amsgrad,
    "scale_by_belief": fo.scale_by_belief,
    "scale_by_yogi": fo.scale_by_yogi,
    "scale_by_adan": fo.scale_by_adan,
    "scale_by_novograd": fo.scale_by_novograd,
    "scale_by_sm3": fo.scale_by_sm3,
    "ema": lambda: fo.ema(0.9),
    "scale_by_nadam": lambda: fo.scale_by_nadam(momentum_decay=0.1),
    "scale_by_radam": fo.scale_by_radam,
    "scale_by_asgd": lambda: fo.scale_by_asgd(0.1, t0=2),
    "scale_by_adafactor": fo.scale_by_adafactor,
    "scale_by_rms_debiased": fo.scale_by_rms_debiased,
    "schedule_free": lambda: fo.schedule_free(fo.sgd(0.1), 0.1),
    "add_noise": lambda: fo.add_noise(0.3, 0.55, 7),
}


def mixed_params() -> list[Tensor]:
    """Leaves of two dtypes (float32 and float64), including a 0-d and an empty tensor."""
    a = make_params(dtype=torch.float32)
    b = make_params(((3, 2), (5,)), dtype=torch.float64, seed=3)
    return [*a, *b]


@pytest.mark.parametrize("name", sorted(LIST_TRANSFORMS))
def test_list_maths_equal_inplace_update_bitwise(name: str) -> None:
    tx = LIST_TRANSFORMS[name]()
    assert tx.lists is not None
    params = mixed_params()
    grads = make_grads(params, 4, none_every=3)
    ref_state, list_state = tx.init(params), tx.init(params)
    for row in grads:
        ref_up, ref_state = tx.update(clone_tensors(row), ref_state, params, inplace=True)
        view = LeafView(params, clone_tensors(row))
        out, list_state = tx.lists.apply(view.grads, list_state, view)
        assert_tensors_equal(view.full(out), tree_leaves(ref_up), what=name)
        assert_tensors_equal(
            [x for x in tree_leaves(list_state) if isinstance(x, Tensor) or x is None],
            [x for x in tree_leaves(ref_state) if isinstance(x, Tensor) or x is None],
            what=name + " state",
        )


def torch_clip_adamw(
    params: list[Tensor], grads: list[list[Any]], groups: Callable[[list[Tensor]], Any] = list
) -> tuple[list[Tensor], list[list[Any]]]:
    """``clip_grad_norm_(foreach=True)`` + ``AdamW(fused=True)``: final params and the clipped
    gradients of each step."""
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(groups(leaves), lr=LR, weight_decay=WD, fused=True)
    clipped = []
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        torch.nn.utils.clip_grad_norm_(leaves, 1.0, foreach=True)
        clipped.append([leaf.grad for leaf in leaves])
        opt.step()
    return [leaf.detach() for leaf in leaves], clipped


def run_optimizer(
    tx: fo.GradientTransformation, params: list[Tensor], grads: list[list[Any]]
) -> tuple[list[Tensor], list[list[Any]]]:
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = fo.Optimizer(leaves, tx)
    seen = []
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        opt.step()
        seen.append([leaf.grad for leaf in leaves])
    return [leaf.detach() for leaf in leaves], seen


def two_groups(key: str, value: float) -> Callable[[list[Tensor]], Any]:
    def groups(leaves: list[Tensor]) -> Any:
        return [
            {"params": [x for x in leaves if x.ndim > 1]},
            {"params": [x for x in leaves if x.ndim <= 1], key: value},
        ]

    return groups


def clip_then(tx: fo.GradientTransformation) -> fo.GradientTransformation:
    return fo.chain(fo.clip_by_global_norm(1.0), tx)


BITWISE_CASES: dict[str, tuple[Callable[[], fo.GradientTransformation], Any]] = {
    "hand_chain": (lambda: clip_then(adamw_chain()), list),
    "flat_hand_chain": (
        lambda: fo.chain(
            fo.clip_by_global_norm(1.0),
            fo.scale_by_adam(),
            fo.add_decayed_weights(WD),
            fo.scale_by_learning_rate(LR),
        ),
        list,
    ),
    "alias_tail": (lambda: clip_then(fo.adamw(lr=LR, weight_decay=WD)), list),
    "masked_decay": (
        lambda: clip_then(
            fo.chain(
                fo.scale_by_adam(),
                fo.masked(fo.add_decayed_weights(WD), is_matrix),
                fo.scale_by_learning_rate(LR),
            )
        ),
        two_groups("weight_decay", 0.0),
    ),
    "multi_transform_lr": (
        lambda: clip_then(
            fo.multi_transform({"mat": adamw_chain(), "vec": adamw_chain(LR / 10)}, label)
        ),
        two_groups("lr", LR / 10),
    ),
}


@pytest.mark.parametrize("name", sorted(BITWISE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_chain_bitwise_equal_to_torch_clip_and_fused_adamw(
    name: str, dtype: torch.dtype
) -> None:
    make_tx, groups = BITWISE_CASES[name]
    params = make_params(dtype=dtype)
    grads = make_grads(params, 6, none_every=3)
    tx = make_tx()
    assert tx.step is not None
    ours, ours_grads = run_optimizer(tx, params, grads)
    theirs, clipped = torch_clip_adamw(params, grads, groups)
    assert_tensors_equal(ours, theirs, what="params")
    for seen, expected in zip(ours_grads, clipped, strict=True):
        # The step consumes p.grad as clip_grad_norm_ does: it holds the clipped gradient.
        assert_tensors_equal(seen, expected, what="p.grad after step")


@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_rms_chain_bitwise_equal_to_torch_clip_and_foreach_rmsprop(
    centered: bool, dtype: torch.dtype
) -> None:
    params = make_params(dtype=dtype)
    grads = make_grads(params, 6, none_every=3)
    tx = fo.chain(
        fo.clip_by_global_norm(1.0),
        fo.scale_by_rms(0.9, 1e-6, centered),
        fo.scale_by_learning_rate(LR),
    )
    assert plan_tail(tx.lists.hyper["transforms"]).rule == "rms"  # type: ignore[union-attr]
    ours, _ = run_optimizer(tx, params, grads)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.RMSprop(leaves, lr=LR, alpha=0.9, eps=1e-6, centered=centered, foreach=True)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        torch.nn.utils.clip_grad_norm_(leaves, 1.0, foreach=True)
        opt.step()
    assert_tensors_equal(ours, [leaf.detach() for leaf in leaves], what="params")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_adamax_chain_bitwise_equal_to_torch_foreach_adamax(dtype: torch.dtype) -> None:
    params = make_params(dtype=dtype)
    grads = make_grads(params, 6, none_every=3)
    tx = fo.chain(fo.scale_by_adamax(0.8, 0.9, 1e-6), fo.scale_by_learning_rate(LR))
    assert plan_tail(tx.lists.hyper["transforms"]).rule == "adamax"  # type: ignore[union-attr]
    ours, _ = run_optimizer(tx, params, grads)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.Adamax(leaves, lr=LR, betas=(0.8, 0.9), eps=1e-6, foreach=True)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        opt.step()
    assert_tensors_equal(ours, [leaf.detach() for leaf in leaves], what="params")


def lion_chain() -> fo.GradientTransformation:
    return fo.chain(fo.scale_by_lion(), fo.add_decayed_weights(WD), fo.scale_by_learning_rate(LR))


#: (chain, the tail rule its step must use).
STEP_CASES: dict[str, tuple[Callable[[], fo.GradientTransformation], str]] = {
    "adam_no_decay": (lambda: fo.chain(fo.scale_by_adam(amsgrad=True), fo.scale(-LR)), "adam"),
    "adam_schedule": (
        lambda: fo.chain(
            fo.scale_by_adam(), fo.scale_by_learning_rate(fo.linear_schedule(LR, LR / 4, 3))
        ),
        "adam",
    ),
    "adam_coupled_decay": (
        lambda: fo.chain(fo.add_decayed_weights(WD), fo.scale_by_adam(), fo.scale(-LR)),
        "adam",
    ),
    "lion": (lion_chain, "lion"),
    "lion_masked": (
        lambda: fo.chain(
            fo.scale_by_lion(),
            fo.masked(fo.add_decayed_weights(WD), is_matrix),
            fo.scale_by_learning_rate(LR),
        ),
        "lion",
    ),
    "lr_only": (
        lambda: fo.chain(
            fo.scale_by_lion(), fo.scale(0.5), fo.add_decayed_weights(WD), fo.scale(-LR)
        ),
        "lr",
    ),
    "positive_scale": (lambda: fo.chain(fo.scale_by_adam(), fo.scale(0.01)), "add"),
    "tensor_lr": (
        lambda: fo.chain(fo.scale_by_lion(), fo.scale(torch.tensor(-LR, dtype=torch.float64))),
        "lion",
    ),
    "multi_transform": (
        lambda: fo.multi_transform({"mat": lion_chain(), "vec": adamw_chain()}, label),
        "step",
    ),
    "sgd_momentum": (
        lambda: fo.chain(fo.add_decayed_weights(WD), fo.trace(0.9), fo.scale_by_learning_rate(LR)),
        "lr",
    ),
    "frozen_identity_tail": (lambda: fo.chain(fo.scale_by_lion(), fo.identity()), "add"),
    "rmsprop": (lambda: fo.rmsprop(LR, momentum=0.9, centered=True, weight_decay=WD), "lr"),
    "clip_rms": (
        lambda: fo.chain(
            fo.clip_by_global_norm(1.0), fo.scale_by_rms(), fo.scale_by_learning_rate(LR)
        ),
        "rms",
    ),
    "rms_centered_masked_decay": (
        lambda: fo.chain(
            fo.scale_by_rms(0.9, centered=True),
            fo.masked(fo.add_decayed_weights(WD), is_matrix),
            fo.scale(-LR),
        ),
        "rms",
    ),
    "clip_sign": (lambda: fo.chain(fo.clip(0.5), fo.scale_by_sign(), fo.scale(-LR)), "lr"),
    "centralize_block_rms_adam": (
        lambda: fo.chain(
            fo.centralize(), fo.clip_by_block_rms(0.1), fo.scale_by_adam(), fo.scale(-LR)
        ),
        "adam",
    ),
    "nonnegative_after_lr": (
        lambda: fo.chain(fo.scale_by_rms(), fo.scale(-LR), fo.keep_params_nonnegative()),
        "add",
    ),
    "zero_nans_trust_ratio": (
        lambda: fo.chain(fo.zero_nans(), fo.scale_by_trust_ratio(), fo.scale(-LR)),
        "lr",
    ),
    "belief_yogi_adan": (
        lambda: fo.chain(
            fo.scale_by_belief(), fo.scale_by_yogi(), fo.scale_by_adan(), fo.scale(-LR)
        ),
        "lr",
    ),
    "optax_adam_amsgrad_decay": (
        lambda: fo.chain(
            fo.scale_by_optax_adam(nesterov=True),
            fo.scale_by_amsgrad(),
            fo.add_decayed_weights(WD),
            fo.scale(-LR),
        ),
        "lr",
    ),
    "novograd_sm3": (
        lambda: fo.chain(fo.scale_by_novograd(), fo.scale_by_sm3(), fo.scale(-LR)),
        "lr",
    ),
    "nadam_radam": (
        lambda: fo.chain(fo.scale_by_nadam(), fo.scale_by_radam(), fo.scale(-LR)),
        "lr",
    ),
    "ema_no_debias_then_scale": (  # ema's output is its state buffer: scale must not write it
        lambda: fo.chain(fo.ema(0.9, debias=False), fo.scale(0.5), fo.scale(-LR)),
        "lr",
    ),
    "ema_then_clip": (
        lambda: fo.chain(fo.ema(0.9), fo.clip_by_global_norm(0.5), fo.scale(-LR)),
        "lr",
    ),
    "adagrad": (lambda: fo.adagrad(LR, lr_decay=0.1, weight_decay=WD), "lr"),
    "adadelta": (lambda: fo.adadelta(1.0, weight_decay=WD), "lr"),
    "adamax": (lambda: fo.adamax(LR, weight_decay=WD), "lr"),
    "adamax_chain_decay": (
        lambda: fo.chain(
            fo.scale_by_adamax(0.8), fo.add_decayed_weights(WD), fo.scale_by_learning_rate(LR)
        ),
        "adamax",
    ),
    "rprop": (lambda: fo.rprop(LR), "lr"),
    "schedule_free_rms_debiased": (
        lambda: fo.chain(
            fo.clip_by_global_norm(1.0),
            fo.schedule_free(fo.chain(fo.scale_by_rms_debiased(), fo.scale(-LR)), LR),
        ),
        "add",
    ),
    "adafactor": (lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.scale_by_adafactor()), "add"),
    "asgd": (lambda: fo.chain(fo.clip(0.5), fo.scale_by_asgd(LR, t0=2)), "add"),
}


@pytest.mark.parametrize("name", sorted(STEP_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_step_matches_pure_path(name: str, dtype: torch.dtype) -> None:
    make_tx, rule = STEP_CASES[name]
    tx = make_tx()
    assert tx.step is not None
    if tx.lists is not None and tx.lists.key == "chain":
        assert plan_tail(tx.lists.hyper["transforms"]).rule == rule
    params = make_params(dtype=dtype)
    params.append(torch.randn(3, dtype=dtype))  # frozen: never has a gradient
    grads = [[*row, None] for row in make_grads(params[:-1], 5, none_every=3)]
    p_step, state = clone_tensors(params), tx.init(params)
    p_pure, pure_state = clone_tensors(params), tx.init(params)
    for row in grads:
        state = tx.step(p_step, clone_tensors(row), state)
        updates, pure_state = tx.update(row, pure_state, p_pure)
        p_pure = fo.apply_updates(p_pure, updates)
    assert_tensors_equal(p_step, p_pure, *TOL[dtype])
    assert torch.equal(p_step[-1], params[-1]), "a frozen leaf moved"
    assert_tensors_equal(
        [x for x in tree_leaves(state) if isinstance(x, Tensor)],
        [x for x in tree_leaves(pure_state) if isinstance(x, Tensor)],
        *TOL[dtype],
        what="state",
    )


def test_zero_nans_list_maths_zero_and_flag_nans_as_update_does() -> None:
    tx = fo.zero_nans()
    params = mixed_params()
    grads = make_grads(params, 1)[0]
    grads[2][3] = float("nan")  # type: ignore[index]
    ref_up, ref_state = tx.update(clone_tensors(grads), tx.init(params), params, inplace=True)
    view = LeafView(params, clone_tensors(grads))
    out, state = tx.lists.apply(view.grads, tx.init(params), view)  # type: ignore[union-attr]
    assert_tensors_equal(view.full(out), tree_leaves(ref_up))
    assert [bool(x) for x in tree_leaves(state)] == [bool(x) for x in tree_leaves(ref_state)]
    assert bool(tree_leaves(state)[2])
    assert not bool(tree_leaves(state)[3])
    assert float(out[2][3]) == 0.0


def test_leafwise_lists_copy_an_output_that_is_a_state_buffer() -> None:
    from functional_optim._transforms._leafwise import leafwise_lists

    def update(updates: Any, state: Any, params: Any = None, *, inplace: bool = False) -> Any:
        del params
        sums = [s.add_(u) if inplace else s + u for s, u in zip(state, updates, strict=True)]
        return list(sums), sums

    lists = leafwise_lists("running_sum", {}, update)
    params = [torch.zeros(3), torch.zeros(2)]
    state = [torch.zeros(3), torch.zeros(2)]
    view = LeafView(params, [torch.ones(3), torch.full((2,), 2.0)])
    out, state = lists.apply(view.grads, state, view)
    assert_tensors_equal(out, state)
    assert all(o.data_ptr() != s.data_ptr() for o, s in zip(out, state, strict=True))


def test_chain_without_list_maths_has_no_step_and_nested_chains_fuse() -> None:
    no_lists = fo.add_noise(0.01, 0.55, 0)._replace(lists=None)  # a transform without lists
    assert fo.chain(fo.scale_by_adam(), no_lists).step is None
    assert fo.masked(no_lists, is_matrix).lists is None
    nested = fo.chain(fo.clip_by_global_norm(1.0), adamw_chain())
    assert plan_tail(nested.lists.hyper["transforms"]).rule == "step"  # type: ignore[union-attr]


def test_step_with_no_gradient_still_counts_schedule() -> None:
    tx = fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(fo.linear_schedule(1.0, 0.0, 4)))
    params = [torch.ones(2)]
    state = tx.step(params, [None], tx.init(params))
    assert int(state[1].count) == 1
    assert torch.equal(params[0], torch.ones(2))


def test_step_rejects_a_foreign_state() -> None:
    tx = adamw_chain()
    with pytest.raises(ValueError, match="state of length"):
        tx.step([torch.ones(1)], [torch.ones(1)], ())  # type: ignore[misc]


PURE_CHAINS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adamw_chain": lambda: clip_then(adamw_chain()),
    "alias_adam": lambda: fo.adam(lr=LR, weight_decay=WD, amsgrad=True),
    "lion_masked": STEP_CASES["lion_masked"][0],
    "multi_transform": STEP_CASES["multi_transform"][0],
    "schedule": STEP_CASES["adam_schedule"][0],
    "ema_no_debias_then_scale": STEP_CASES["ema_no_debias_then_scale"][0],
    "optax_adaptive": STEP_CASES["belief_yogi_adan"][0],
    "schedule_free": STEP_CASES["schedule_free_rms_debiased"][0],
    "adafactor": STEP_CASES["adafactor"][0],
    "asgd": STEP_CASES["asgd"][0],
    "add_noise": lambda: fo.chain(fo.add_noise(0.3, 0.55, 7), fo.scale_by_adam(), fo.scale(-LR)),
}


def pure_update_both_ways(
    tx: fo.GradientTransformation, row: Any, fast: tuple[Any, Any], slow: tuple[Any, Any]
) -> tuple[Any, Any, Any, Any]:
    """One ``tx.update`` on the fast pure path (``fast = (params, state)``, no autograd) and on
    the per-leaf one (``slow``: params that require grad): asserts the fast one left its inputs
    alone and that both give the same updates, bitwise.

    Returns:
        ``(fast updates, fast state, slow updates, slow state)``.
    """
    (fast_p, fast_state), (slow_p, slow_state) = fast, slow
    inputs = [x for x in tree_leaves((fast_p, row, fast_state)) if isinstance(x, Tensor)]
    before = [x.clone() for x in inputs]
    fast_up, fast_state = tx.update(row, fast_state, fast_p)
    assert_tensors_equal(inputs, before, what="fast pure-path input")
    slow_up, slow_state = tx.update(row, slow_state, slow_p)
    assert_tensors_equal(
        tree_leaves(fast_up), [x if x is None else x.detach() for x in tree_leaves(slow_up)]
    )
    return fast_up, fast_state, slow_up, slow_state


@pytest.mark.parametrize("name", sorted(PURE_CHAINS))
def test_fast_pure_path_equals_per_leaf_path_bitwise(name: str) -> None:
    """Without autograd the chain's pure update runs the list maths on copies: the same numbers
    as the per-leaf update (taken here by making the params require grad), inputs untouched."""
    tx = PURE_CHAINS[name]()
    params = mixed_params()
    grads = make_grads(params, 4, none_every=3)
    fast_p, slow_p = clone_tensors(params), [p.clone().requires_grad_(True) for p in params]
    fast_state, slow_state = tx.init(fast_p), tx.init(params)
    for row in grads:
        fast_up, fast_state, slow_up, slow_state = pure_update_both_ways(
            tx, row, (fast_p, fast_state), (slow_p, slow_state)
        )
        fast_p = fo.apply_updates(fast_p, fast_up)
        slow_p = fo.apply_updates(slow_p, slow_up)
    assert_tensors_equal(fast_p, [p.detach() for p in slow_p])
    detached = [x.detach() if isinstance(x, Tensor) else x for x in tree_leaves(slow_state)]
    assert_tensors_equal(
        [x for x in tree_leaves(fast_state) if isinstance(x, Tensor)],
        [x for x in detached if isinstance(x, Tensor)],
    )


def test_pure_update_with_a_differentiable_lr_keeps_the_graph() -> None:
    lr = torch.tensor(0.1, requires_grad=True)
    tx = fo.chain(fo.scale_by_lion(), fo.scale(-lr))
    params = [torch.ones(3)]
    updates, _ = tx.update([torch.full((3,), 2.0)], tx.init(params), params)
    (updates[0].sum()).backward()
    assert lr.grad is not None
    assert float(lr.grad) == -3.0


def test_fused_lion_chain_bitwise_equal_to_foreach_reference() -> None:
    """Lion's fused tail is torch-style Lion in _foreach ops (what the benchmark compares)."""
    params = make_params(dtype=torch.float32)
    grads = make_grads(params, 5)
    tx = lion_chain()
    ours, state = clone_tensors(params), tx.init(params)
    theirs, mu = clone_tensors(params), [torch.zeros_like(p) for p in params]
    for row in grads:
        state = tx.step(ours, clone_tensors(row), state)
        torch._foreach_mul_(theirs, 1.0 - LR * WD)
        direction = torch._foreach_lerp(mu, row, 1 - 0.9)
        torch._foreach_sign_(direction)
        torch._foreach_add_(theirs, direction, alpha=-LR)
        torch._foreach_lerp_(mu, row, 1 - 0.99)
    assert_tensors_equal(ours, theirs)
    assert_tensors_equal(tree_leaves(state[0].mu), mu)


def test_a_scaling_transform_declares_its_fused_tail() -> None:
    """A transform outside the package joins the fused tails by declaring one
    (``ListTransform.tail``): the chain step runs its kernel (with a masked decay and a
    learning rate read by ``_fusion``), ``pure_step`` runs it on copies, and the numbers are
    the pure path's."""
    calls: list[int] = []

    def run(call: TailCall) -> None:
        calls.append(len(call.updates))
        direction = list(torch._foreach_sign(call.updates))
        args = [list(call.view.params), direction, call.decays(), call.lr, call.weight_decay]
        run_kernel(tail_kernels.lr_only, args, tail_kernels.LR_ROLES)

    base = fo.scale_by_sign()
    assert base.lists is not None
    tail = FusedTail("sign", GradRules("Sign"), lambda hyper: [], (), run)
    signed = base._replace(lists=base.lists._replace(tail=tail))
    decay = fo.masked(fo.add_decayed_weights(WD), is_matrix)
    tx = fo.chain(signed, decay, fo.scale_by_learning_rate(LR))
    assert tx.lists is not None
    assert plan_tail(tx.lists.hyper["transforms"]).rule == "sign"
    params = make_params()
    grads = make_grads(params, 3)
    p_step, state = clone_tensors(params), tx.init(params)
    p_pure, pure_state = clone_tensors(params), tx.init(params)
    step = fo.pure_step(tx)
    p_fn, fn_state = clone_tensors(params), tx.init(params)
    for row in grads:
        state = tx.step(p_step, clone_tensors(row), state)
        updates, pure_state = tx.update(row, pure_state, p_pure)
        p_pure = fo.apply_updates(p_pure, updates)
        p_fn, fn_state = step(p_fn, row, fn_state)
    assert len(calls) == 2 * len(grads)  # tx.step and pure_step, every step
    assert_tensors_equal(p_step, p_pure, *TOL[torch.float32])
    assert_tensors_equal(p_fn, p_step)
