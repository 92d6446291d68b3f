"""Wrappers with optax's semantics: masked, multi_transform, freeze, MultiSteps, apply_if_finite,
lookahead; bad input raises before anything is mutated."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal


def _params() -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "enc": {"w": torch.randn(3, 2, generator=gen, dtype=torch.float64)},
        "head": {
            "w": torch.randn(2, generator=gen, dtype=torch.float64),
            "b": torch.randn((), generator=gen, dtype=torch.float64),
        },
    }


def _grads(params: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return fo.tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params)


def _run(
    tx: fo.GradientTransformation, params: dict[str, Tensor], steps: int = 3
) -> dict[str, Tensor]:
    state = tx.init(params)
    for s in range(steps):
        updates, state = tx.update(_grads(params, s), state, params)
        params = fo.apply_updates(params, updates)
    return params


def test_masked_applies_inner_only_where_selected() -> None:
    params = _params()
    mask = {"enc": True, "head": {"w": False, "b": True}}  # a prefix at "enc"
    tx = fo.masked(fo.adam(lr=0.1), mask)
    state = tx.init(params)
    assert state.inner_state.inner_state[2].mu["head"]["w"] is None  # no state where unmasked
    g = _grads(params, 0)
    out, _ = tx.update(g, state, params)
    assert out["head"]["w"] is g["head"]["w"]  # passed through unchanged
    alone = fo.adam(lr=0.1)
    ref, _ = alone.update(g, alone.init(params), params)
    assert torch.equal(out["enc"]["w"], ref["enc"]["w"])
    assert torch.equal(out["head"]["b"], ref["head"]["b"])


def test_masked_global_norm_covers_only_the_selected_leaves() -> None:
    params = _params()
    g = _grads(params, 1)
    tx = fo.masked(fo.clip_by_global_norm(0.1), {"enc": True, "head": False})
    out, _ = tx.update(g, tx.init(params), params)
    torch.testing.assert_close(
        out["enc"]["w"].norm(), torch.tensor(0.1, dtype=torch.float64), rtol=1e-5, atol=0
    )


def test_masked_with_a_callable_mask() -> None:
    params = _params()
    tx = fo.masked(fo.set_to_zero(), lambda tree: fo.tree_map(lambda x: x.ndim == 0, tree))
    out, _ = tx.update(_grads(params, 0), tx.init(params), params)
    assert torch.equal(out["head"]["b"], torch.zeros((), dtype=torch.float64))
    assert bool(out["enc"]["w"].abs().sum() > 0)


def test_bad_mask_raises_before_the_state_changes() -> None:
    params = _params()
    good = {"enc": True, "head": True}
    holder = {"mask": good}
    tx = fo.masked(fo.scale_by_lion(), lambda tree: holder["mask"])
    state = tx.init(params)
    before = [x.clone() for x in tree_leaves(state) if isinstance(x, Tensor)]
    holder["mask"] = {"enc": True, "oops": True}
    with pytest.raises(ValueError, match="mask must have the structure"):
        tx.update(_grads(params, 0), state, params, inplace=True)
    after = [x for x in tree_leaves(state) if isinstance(x, Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    holder["mask"] = {"enc": 1, "head": True}
    with pytest.raises(TypeError, match="bools"):
        tx.update(_grads(params, 0), state, params)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fo.masked(fo.scale_by_lion, good)  # type: ignore[arg-type]


def test_multi_transform_equals_each_transform_on_its_leaves() -> None:
    params = _params()
    labels = {"enc": "sgd", "head": {"w": "lion", "b": "frozen"}}
    transforms = {
        "sgd": fo.sgd(lr=0.1, momentum=0.9),
        "lion": fo.lion(0.01),
        "frozen": fo.set_to_zero(),
    }
    out = _run(fo.multi_transform(transforms, labels), params)
    sgd_only = _run(fo.masked(fo.sgd(lr=0.1, momentum=0.9), {"enc": True, "head": False}), params)
    lion_only = _run(
        fo.masked(fo.lion(0.01), {"enc": False, "head": {"w": True, "b": False}}), params
    )
    assert torch.equal(out["enc"]["w"], sgd_only["enc"]["w"])
    assert torch.equal(out["head"]["w"], lion_only["head"]["w"])
    assert torch.equal(out["head"]["b"], params["head"]["b"])


def test_multi_transform_errors() -> None:
    params = _params()
    tx = fo.multi_transform({"a": fo.sgd(lr=0.1)}, {"enc": "a", "head": "b"})
    with pytest.raises(ValueError, match="'b' have no transform"):
        tx.init(params)
    with pytest.raises(TypeError, match="transforms\\['a'\\]"):
        fo.multi_transform({"a": fo.sgd}, {"enc": "a", "head": "a"})  # type: ignore[dict-item]


def test_freeze_zeroes_the_frozen_leaves() -> None:
    params = _params()
    tx = fo.chain(fo.freeze({"enc": True, "head": False}), fo.sgd(lr=0.1))
    out = _run(tx, params)
    assert torch.equal(out["enc"]["w"], params["enc"]["w"])
    assert not torch.equal(out["head"]["w"], params["head"]["w"])


def test_multi_steps_accumulates_the_mean_and_steps_every_k() -> None:
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    grads = [{"w": torch.tensor([0.1 * i, 1.0 - i], dtype=torch.float64)} for i in range(6)]
    ms = fo.MultiSteps(fo.adam(lr=0.1), every_k_schedule=3)
    state = ms.init(params)
    inner = fo.adam(lr=0.1)
    inner_state = inner.init(params)
    for i, g in enumerate(grads):
        out, state = ms.update(g, state, params)
        if i % 3 < 2:
            assert torch.equal(out["w"], torch.zeros(2, dtype=torch.float64))
            assert not ms.has_updated(state)
        else:
            mean = {"w": sum(x["w"] for x in grads[i - 2 : i + 1]) / 3}
            ref, inner_state = inner.update(mean, inner_state, params)
            torch.testing.assert_close(out["w"], ref["w"], rtol=1e-14, atol=1e-15)
            assert ms.has_updated(state)
    assert int(state.gradient_step) == 2


def test_multi_steps_sum_schedule_and_skip() -> None:
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    ms = fo.MultiSteps(
        fo.sgd(lr=1.0),
        every_k_schedule=lambda step: 2,
        use_grad_mean=False,
        should_skip_update_fn=fo.skip_not_finite,
    )
    state = ms.init(params)
    one = {"w": torch.ones(2, dtype=torch.float64)}
    bad = {"w": torch.tensor([float("nan"), 1.0], dtype=torch.float64)}
    _, state = ms.update(one, state, params)
    out, state = ms.update(bad, state, params)  # skipped: nothing accumulated, no step
    assert torch.equal(out["w"], torch.zeros(2, dtype=torch.float64))
    assert int(state.skip_state["num_not_finite"]) == 1
    out, state = ms.update(one, state, params)
    assert torch.equal(out["w"], torch.full((2,), -2.0, dtype=torch.float64))  # sum of two
    with pytest.raises(ValueError, match="every_k_schedule"):
        fo.MultiSteps(fo.sgd(), 0)


def test_multi_steps_runs_in_place_through_optimizer() -> None:
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = fo.Optimizer([w], fo.MultiSteps(fo.sgd(lr=0.5), 2).gradient_transformation())
    for g in (1.0, 3.0):
        w.grad = torch.full((3,), g, dtype=torch.float64)
        opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), 1.0 - 0.5 * 2.0, dtype=torch.float64))


def _without_step(tx: fo.GradientTransformation) -> fo.GradientTransformation:
    return fo.GradientTransformation(tx.init, tx.update)


MULTI_STEPS_CASES: dict[str, Callable[[], fo.MultiSteps]] = {
    "adamw (inner step)": lambda: fo.MultiSteps(fo.adamw(lr=0.1, weight_decay=0.1), 3),
    "adamw, no inner step": lambda: fo.MultiSteps(
        _without_step(fo.adamw(lr=0.1, weight_decay=0.1)), 3
    ),
    "sum, k=2, skip non-finite": lambda: fo.MultiSteps(
        _without_step(fo.sgd(lr=0.5, momentum=0.9)),
        lambda step: 2,
        use_grad_mean=False,
        should_skip_update_fn=fo.skip_not_finite,
    ),
}


@pytest.mark.parametrize("name", sorted(MULTI_STEPS_CASES))
def test_multi_steps_in_place_step_matches_update_then_apply(name: str) -> None:
    """``step`` (what fo.Optimizer runs) against ``update(inplace=True)`` + ``apply_updates``:
    bitwise for a sum, to rounding for a mean (one lerp against optax's division) or a fused
    inner step. A ``None`` gradient and a non-finite one (skipped) are among the calls."""
    ms = MULTI_STEPS_CASES[name]()
    tx = ms.gradient_transformation()
    assert tx.step is not None
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.randn(4, 3, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    ]
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    state, ref_state = tx.init(ours), tx.init(ref)
    tol = (0.0, 0.0) if "sum" in name else (1e-12, 1e-14)
    for call in range(8):
        grads: list[Tensor | None] = [
            torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in params
        ]
        if call == 4:
            grads[1] = None
        if call == 5:
            grads[0][0, 0] = float("nan")
        ref_grads = [None if g is None else g.clone() for g in grads]
        state = tx.step(ours, grads, state)
        updates, ref_state = tx.update(ref_grads, ref_state, ref, inplace=True)
        fo.apply_updates(ref, updates, inplace=True)
        assert_tensors_equal(ours, ref, *tol, what=f"params after call {call}")
        assert_tensors_equal(_state_tensors(state), _state_tensors(ref_state), *tol, what="state")
    assert int(state.gradient_step) >= 2


def _state_tensors(state: Any) -> list[Tensor]:
    return [x for x in tree_leaves(state) if isinstance(x, Tensor)]


def test_apply_if_finite_skips_then_gives_up() -> None:
    params = {"w": torch.ones(2, dtype=torch.float64)}
    tx = fo.apply_if_finite(fo.adam(lr=0.1), max_consecutive_errors=1)
    state = tx.init(params)
    nan = {"w": torch.tensor([float("nan"), 1.0], dtype=torch.float64)}
    out, state = tx.update(nan, state, params, inplace=True)
    assert torch.equal(out["w"], torch.zeros(2, dtype=torch.float64))
    assert int(state.notfinite_count) == 1
    assert not bool(state.last_finite)
    assert float(state.inner_state.inner_state[2].count["w"]) == 0  # adam state untouched
    out, state = tx.update(nan, state, params, inplace=True)  # 2 > 1 consecutive: applied
    assert bool(out["w"].isnan().any())
    assert int(state.total_notfinite) == 2
    ok = {"w": torch.ones(2, dtype=torch.float64)}
    _, state = tx.update(ok, state, params)
    assert int(state.notfinite_count) == 0
    assert bool(state.last_finite)


def test_apply_if_finite_under_vmap_selects_per_batch_element() -> None:
    tx = fo.apply_if_finite(fo.scale_by_adan(), max_consecutive_errors=3)
    params = {"w": torch.ones(2, dtype=torch.float64)}
    grads = torch.tensor([[1.0, 2.0], [float("inf"), 1.0], [0.5, -1.0]], dtype=torch.float64)

    def run(g: Tensor) -> tuple[Tensor, Tensor]:
        state = tx.init(params)
        out, state = tx.update({"w": g}, state, params)
        out, state = tx.update({"w": torch.ones_like(g)}, state, params)
        return out["w"], state.total_notfinite

    swept, totals = torch.func.vmap(run)(grads)
    for i in range(3):
        one, total = run(grads[i])
        torch.testing.assert_close(swept[i], one, rtol=0, atol=0)
        assert int(totals[i]) == int(total)
    assert [int(t) for t in totals] == [0, 1, 0]


def test_lookahead_matches_the_two_loop_algorithm() -> None:
    p0 = {"w": torch.tensor([1.0, -1.0], dtype=torch.float64)}
    grads = [{"w": torch.tensor([0.5 * i, 1.0], dtype=torch.float64)} for i in range(4)]
    tx = fo.lookahead(fo.sgd(lr=0.1), sync_period=2, slow_step_size=0.5)
    params = fo.LookaheadParams.init_synced(p0)
    state = tx.init(params)
    fast, slow = p0["w"].clone(), p0["w"].clone()
    for i, g in enumerate(grads):
        updates, state = tx.update(g, state, params)
        params = fo.apply_updates(params, updates)
        fast = fast - 0.1 * g["w"]
        if i % 2 == 1:
            slow = slow + 0.5 * (fast - slow)
            fast = slow.clone()
        torch.testing.assert_close(params.fast["w"], fast, rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(params.slow["w"], slow, rtol=1e-14, atol=1e-15)
    with pytest.raises(TypeError, match="LookaheadParams"):
        tx.update(grads[0], state, p0)
    with pytest.raises(ValueError, match="sync_period"):
        fo.lookahead(fo.sgd(), 0, 0.5)


def test_lookahead_reset_state_restarts_the_fast_optimizer() -> None:
    p0 = {"w": torch.tensor([1.0], dtype=torch.float64)}
    tx = fo.lookahead(
        fo.sgd(lr=0.1, momentum=0.9), sync_period=2, slow_step_size=0.5, reset_state=True
    )
    params = fo.LookaheadParams.init_synced(p0)
    state = tx.init(params)
    for _ in range(2):
        updates, state = tx.update({"w": torch.ones(1, dtype=torch.float64)}, state, params)
        params = fo.apply_updates(params, updates)
    assert tree_leaves(state.fast_state) == tree_leaves(tx.init(params).fast_state)


ROUND_TRIP = {
    "lion": lambda: fo.lion(0.1),
    "sm3": lambda: fo.sm3(0.1),
    "adan": lambda: fo.adan(0.1, weight_decay=0.1),
    "noisy_sgd": lambda: fo.noisy_sgd(0.1),
    "schedule_free_adamw": lambda: fo.schedule_free_adamw(0.1),
    "masked": lambda: fo.masked(fo.lion(0.1), [True, False]),
    "multi_transform": lambda: fo.multi_transform(
        {"a": fo.lion(0.1), "b": fo.adam(lr=0.1)}, ["a", "b"]
    ),
    "multi_steps": lambda: fo.MultiSteps(fo.lamb(0.1), 2).gradient_transformation(),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.yogi(0.1), 2),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_optimizer_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    import copy

    make = ROUND_TRIP[name]
    gen = torch.Generator().manual_seed(0)
    ws = [
        torch.nn.Parameter(torch.randn(3, 2, generator=gen)),
        torch.nn.Parameter(torch.randn(4, generator=gen)),
    ]
    opt = fo.Optimizer(ws, make())
    for _ in range(3):
        for w in ws:
            w.grad = torch.randn(w.shape, generator=gen)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    ws2 = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    opt2 = fo.Optimizer(ws2, make())
    opt2.load_state_dict(saved)
    grads = [torch.randn(w.shape, generator=gen) for w in ws]
    for a, b, g in zip(ws, ws2, grads, strict=True):
        a.grad, b.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    for a, b in zip(ws, ws2, strict=True):
        assert torch.equal(a, b)


def test_multi_steps_takes_optax_arguments() -> None:
    params = inspect.signature(fo.MultiSteps).parameters
    assert list(params) == [
        "opt", "every_k_schedule", "use_grad_mean", "should_skip_update_fn", "accumulator_dtype",
    ]  # fmt: skip
    assert params["accumulator_dtype"].default is None
    for bad in (torch.int32, torch.bool, "float64", float):
        with pytest.raises(TypeError, match="accumulator_dtype"):
            fo.MultiSteps(fo.sgd(), 2, accumulator_dtype=bad)  # type: ignore[arg-type]


# 1 + 2**-24 + 2**-24: float32 rounds each partial sum back to 1 (2**-24 is half an ulp of 1),
# float64 holds 1 + 2**-23, which float32 represents.
HALF_ULP_GRADS = (1.0, 2.0**-24, 2.0**-24)


@pytest.mark.parametrize(
    ("accumulator_dtype", "expected"),
    [(None, 1.0), (torch.float32, 1.0), (torch.float64, 1.0 + 2.0**-23)],
    ids=["none", "float32", "float64"],
)
@pytest.mark.parametrize("inplace", [False, True], ids=["pure", "inplace"])
def test_multi_steps_accumulates_in_accumulator_dtype(
    accumulator_dtype: torch.dtype | None, expected: float, inplace: bool
) -> None:
    params = {"w": torch.zeros(2, dtype=torch.float32), "b": torch.zeros((), dtype=torch.float32)}
    ms = fo.MultiSteps(fo.sgd(lr=1.0), 3, use_grad_mean=False, accumulator_dtype=accumulator_dtype)
    state = ms.init(params)
    acc_dtype = accumulator_dtype or torch.float32
    assert {a.dtype for a in state.acc_grads.values()} == {acc_dtype}
    for g in HALF_ULP_GRADS:
        grads = {"w": torch.full((2,), g, dtype=torch.float32), "b": torch.tensor(g)}
        out, state = ms.update(grads, state, params, inplace=inplace)
        assert {a.dtype for a in state.acc_grads.values()} == {acc_dtype}
        assert {u.dtype for u in out.values()} == {torch.float32}  # the updates' dtype
    assert ms.has_updated(state)
    assert torch.equal(out["w"], torch.full((2,), -expected, dtype=torch.float32))
    assert float(out["b"]) == -expected


@pytest.mark.parametrize(
    ("accumulator_dtype", "expected"),
    [(None, 1.0), (torch.float64, 1.0 + 2.0**-23)],
    ids=["none", "float64"],
)
@pytest.mark.parametrize("inner_step", [True, False], ids=["inner step", "no inner step"])
def test_multi_steps_step_accumulates_in_accumulator_dtype(
    accumulator_dtype: torch.dtype | None, expected: float, inner_step: bool
) -> None:
    inner = fo.sgd(lr=1.0) if inner_step else _without_step(fo.sgd(lr=1.0))
    tx = fo.MultiSteps(
        inner, 3, use_grad_mean=False, accumulator_dtype=accumulator_dtype
    ).gradient_transformation()
    assert tx.step is not None
    w = torch.nn.Parameter(torch.full((4,), 3.0, dtype=torch.float32))
    opt = fo.Optimizer([w], tx)
    for g in HALF_ULP_GRADS:
        w.grad = torch.full((4,), g, dtype=torch.float32)
        opt.step()
    assert w.dtype == torch.float32
    assert torch.equal(w.detach(), torch.full((4,), 3.0 - expected, dtype=torch.float32))


@pytest.mark.parametrize("use_grad_mean", [False, True], ids=["sum", "mean"])
def test_multi_steps_float64_accumulators_step_matches_update(use_grad_mean: bool) -> None:
    """float32 params, float64 accumulators: ``step`` and ``update(inplace=True)`` +
    ``apply_updates`` agree (bitwise for a sum; to float64 rounding, cast once, for a mean)."""
    ms = fo.MultiSteps(
        _without_step(fo.sgd(lr=0.5, momentum=0.9)),
        2,
        use_grad_mean=use_grad_mean,
        accumulator_dtype=torch.float64,
    )
    tx = ms.gradient_transformation()
    assert tx.step is not None
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen)]
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    state, ref_state = tx.init(ours), tx.init(ref)
    for _ in range(6):
        grads: list[Tensor | None] = [torch.randn(p.shape, generator=gen) for p in params]
        ref_grads = [None if g is None else g.clone() for g in grads]
        state = tx.step(ours, grads, state)
        updates, ref_state = tx.update(ref_grads, ref_state, ref, inplace=True)
        fo.apply_updates(ref, updates, inplace=True)
        assert {a.dtype for a in state.acc_grads} == {torch.float64}
        assert {a.dtype for a in ref_state.acc_grads} == {torch.float64}
        tol = (0.0, 0.0) if not use_grad_mean else (1e-6, 1e-7)
        assert_tensors_equal(ours, ref, *tol, what="params")
    assert int(state.gradient_step) == 3


def test_multi_steps_complex_params_keep_complex_accumulators() -> None:
    params = [torch.zeros(2, dtype=torch.complex64), torch.zeros(2)]
    ms = fo.MultiSteps(fo.sgd(lr=1.0), 2, accumulator_dtype=torch.float64)
    state = ms.init(params)
    assert [a.dtype for a in state.acc_grads] == [torch.complex128, torch.float64]
    grads = [torch.tensor([1 + 2j, 3j], dtype=torch.complex64), torch.ones(2)]
    _, state = ms.update(grads, state, params)
    out, state = ms.update(grads, state, params)
    assert out[0].dtype == torch.complex64
    assert torch.equal(out[0], -grads[0])
