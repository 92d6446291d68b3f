"""``pure_step``'s flat buffers: Adam into recycled generations, out of place or by copying.

Both ways are checked: ``"fused"`` (pure_step's default: copy, then torch's kernel in place on
the copy) and the out-of-place kernel of ``compiled=True``, run as Python (``"python"``: the
same function, no compile) for speed; one smoke test compiles it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._flat_buffers import MAX_GENERATIONS, Layout, Pool
from functional_optim._pure_flat import FlatAdam
from functional_optim._pure_step import CHUNK_BYTES, PureStepFn, _make_step

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params
from .test_pure_step import FUSED, _others, _tensors

#: The kernel's op order differs from torch's fused one: an ulp or two.
TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-14)}
LR = 0.05


def _flat_step(tx: fo.GradientTransformation, mode: str = "python") -> tuple[PureStepFn, FlatAdam]:
    flat = FlatAdam(mode, CHUNK_BYTES)
    return _make_step(tx, flat), flat


def _pools(flat: FlatAdam) -> list[Pool]:
    return list(flat._pools.values())


def _generations(flat: FlatAdam) -> int:
    return sum(len(pool.generations) for pool in _pools(flat))


def _snapshot(*trees: Any) -> list[Tensor]:
    return [t.clone() for tree in trees for t in _tensors(tree)]


@pytest.mark.parametrize("none_every", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_flat_step_matches_in_place_step(name: str, dtype: torch.dtype, none_every: int) -> None:
    """Every Adam-tailed transform pure_step fuses: the flat path equals ``tx.step`` to the
    kernel's rounding, leaves every input alone and returns a state sharing nothing with it."""
    tx = FUSED[name]()
    step, flat = _flat_step(tx)
    params = make_params(dtype=dtype)
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    rtol, atol = TOL[dtype]
    for row in make_grads(params, 4, none_every=none_every):
        before = _snapshot(params, row, state)
        new_params, new_state = step(params, row, state)
        assert_tensors_equal(_snapshot(params, row, state), before, what="an input was mutated")
        assert not {id(x) for x in _tensors(state)} & {id(x) for x in _tensors(new_state)}
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
        assert_tensors_equal(list(new_params), ref_params, rtol, atol, what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), rtol, atol, what="state")
        assert _others(new_state) == _others(ref_state)
        params, state = new_params, new_state
    if none_every == 0:  # the flat path ran (with None gradients the counters drift apart)
        assert _generations(flat) >= 1


def _loop(
    step: PureStepFn, tx: fo.GradientTransformation, params: list[Tensor], steps: int, seed: int
) -> tuple[list[Tensor], Any]:
    state = tx.init(params)
    for row in make_grads(params, steps, seed=seed):
        params, state = step(params, row, state)
    return params, state


def _inside(leaf: Tensor, flats: list[Tensor]) -> bool:
    start = leaf.data_ptr()
    return any(f.data_ptr() <= start < f.data_ptr() + f.numel() * f.element_size() for f in flats)


MODES = pytest.mark.parametrize("mode", ["python", "fused"])


@MODES
def test_two_generations_alternate_and_outputs_live_in_them(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a loop the step reads its own last outputs in place (no gather after the first
    step, empty and 0-d leaves included) and writes into the generation before."""
    found: list[bool] = []
    find = Pool.find

    def recording_find(pool: Pool, leaves: Any) -> Any:
        gen = find(pool, leaves)
        found.append(gen is not None)
        return gen

    monkeypatch.setattr(Pool, "find", recording_find)
    tx = fo.adamw(lr=LR, weight_decay=0.1)
    step, flat = _flat_step(tx, mode)
    params, state = _loop(step, tx, make_params(), 6, seed=3)
    assert found == [False] + [True] * 5
    params, state = _loop(step, tx, make_params(((7,), (4, 5), (2, 3, 4), (4, 5))), 6, seed=3)
    assert _generations(flat) == 3  # two; the first layout's spare one was released
    flats = [f for pool in _pools(flat) for gen in pool.generations for kind in gen for f in kind]
    moments = [t for t in _tensors(state) if t.dim() > 0]
    assert len(moments) == 2 * len(params)
    for leaf in [*params, *moments]:
        assert _inside(leaf, flats), "a returned leaf is not a view of a kept generation"


@MODES
def test_a_changing_set_of_gradients_keeps_the_memory_of_one_layout(mode: str) -> None:
    """Leaves without a gradient on alternate steps make two layouts; only the one in use
    keeps spare buffers, so the buffers held stay those of one layout plus the caller's."""
    tx = fo.adam(lr=LR)
    step, flat = _flat_step(tx, mode)
    params = make_params(((4, 5), (7,), (3,)))
    state = tx.init(params)
    ref_params, ref_state = params, state
    for k, row in enumerate(make_grads(params, 8, seed=18)):
        grads = [None if (k % 2 and j == 1) else g for j, g in enumerate(row)]
        params, state = step(params, grads, state)
        updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = fo.apply_updates(ref_params, updates)
        assert _generations(flat) <= 3
        assert sum(pool.grads is not None for pool in _pools(flat)) <= 1
    assert len(_pools(flat)) == 2
    assert_tensors_equal(list(params), list(ref_params), *TOL[torch.float32], what="params")


@MODES
def test_float32_and_float64_leaves_in_one_tree(mode: str) -> None:
    """One bucket per dtype (and per decay group): a mixed tree matches ``tx.step``."""
    tx = fo.chain(
        fo.clip_by_global_norm(0.5),
        fo.scale_by_adam(),
        fo.masked(fo.add_decayed_weights(0.1), lambda ps: [p.ndim > 1 for p in ps]),
        fo.scale_by_learning_rate(LR),
    )
    step, flat = _flat_step(tx, mode)
    params = make_params(dtype=torch.float32) + make_params(dtype=torch.float64, seed=4)
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    tol = TOL[torch.float32] if mode == "python" else (0.0, 0.0)
    for row in make_grads(params, 3, seed=19):
        params, state = step(params, row, state)
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
        assert_tensors_equal(list(params), ref_params, *tol, what="params")
        assert_tensors_equal(_tensors(state), _tensors(ref_state), *tol, what="state")
    (pool,) = _pools(flat)
    assert {(b.dtype, b.weight_decay) for b in pool.layout.buckets} == {
        (dtype, wd) for dtype in (torch.float32, torch.float64) for wd in (0.1, 0.0)
    }


@MODES
def test_a_state_the_caller_keeps_is_never_overwritten(mode: str) -> None:
    """Old params and state, and a view of an old leaf, keep their values while the step goes
    on; the pool grows to its cap and no further."""
    tx = fo.adam(lr=LR)
    step, flat = _flat_step(tx, mode)
    params = make_params(dtype=torch.float64)
    state = tx.init(params)
    kept: list[tuple[list[Tensor], list[Tensor]]] = []
    view_of_old: Tensor | None = None
    for k, row in enumerate(make_grads(params, 8, seed=5)):
        params, state = step(params, row, state)
        if k in (1, 3, 4):
            kept.append((list(params) + _tensors(state), _snapshot(params, state)))
        if k == 2:
            view_of_old = params[3][1:]
            view_values = view_of_old.clone()
    for live, values in kept:
        assert_tensors_equal(live, values, what="a kept state changed")
    assert view_of_old is not None
    assert torch.equal(view_of_old, view_values)
    assert _generations(flat) == MAX_GENERATIONS


@MODES
def test_same_inputs_twice_give_the_same_independent_outputs(mode: str) -> None:
    tx = fo.adam(lr=LR)
    step, _ = _flat_step(tx, mode)
    params, state = _loop(step, tx, make_params(), 2, seed=7)
    grads = make_grads(params, 1, seed=8)[0]
    first_params, first_state = step(params, grads, state)
    first_values = _snapshot(first_params, first_state)
    second_params, second_state = step(params, grads, state)
    assert_tensors_equal(_snapshot(second_params, second_state), first_values, what="branch")
    assert_tensors_equal(_snapshot(first_params, first_state), first_values, what="overwritten")


@MODES
def test_inputs_from_elsewhere_are_gathered_first(mode: str) -> None:
    """Copies of the state (not the step's own views) give the same result as the views."""
    tx = fo.adam(lr=LR, amsgrad=True)
    step, _ = _flat_step(tx, mode)
    params, state = _loop(step, tx, make_params(), 3, seed=9)
    grads = make_grads(params, 1, seed=10)[0]
    own = step(params, grads, state)
    copied_state = fo.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, state)
    copied = step([p.clone() for p in params], grads, copied_state)
    assert_tensors_equal(_snapshot(*copied), _snapshot(*own), what="gathered vs own")


@MODES
def test_a_transposed_view_of_a_returned_leaf_is_read_by_value(mode: str) -> None:
    """A transposed view of a returned square leaf starts where the leaf did, with its
    elements laid out differently: it is gathered by value, and the result is ``update`` +
    ``apply_updates``'s (the eager step once copied the param with its strides and the moments
    with theirs, pairing the wrong elements)."""
    tx = fo.adam(lr=LR)
    step, _ = _flat_step(tx, mode)
    params, state = _loop(step, tx, make_params(((3, 3), (4,))), 2, seed=14)
    grads = make_grads(params, 1, seed=15)[0]
    moved = [params[0].t(), params[1]]
    assert moved[0].data_ptr() == params[0].data_ptr()
    ours, _ = step(moved, grads, state)
    updates, _ = tx.update(grads, state, moved)
    expected = fo.apply_updates(moved, updates)
    assert_tensors_equal(list(ours), list(expected), *TOL[torch.float32], what="params")


@MODES
def test_buffers_made_in_inference_mode_are_not_written_outside_it(mode: str) -> None:
    """Steps inside ``torch.inference_mode()`` make inference tensors, which may not be written
    outside it: the step keeps separate buffers per mode, and the results stay usable."""
    tx = fo.adam(lr=LR)
    step, _ = _flat_step(tx, mode)
    params = make_params(((3, 4), (5,)))
    state = tx.init(params)
    rows = make_grads(params, 7, seed=17)
    ref_params, ref_state = params, state
    with torch.inference_mode():
        for row in rows[:3]:
            params, state = step(params, row, state)
    for row in rows[3:]:
        params, state = step(params, row, state)
    assert not params[0].is_inference()
    for row in rows:
        updates, ref_state = tx.update(row, ref_state, ref_params)
        ref_params = fo.apply_updates(ref_params, updates)
    assert_tensors_equal(list(params), list(ref_params), *TOL[torch.float32], what="params")


def test_gradient_buffers_a_view_escaped_from_are_replaced() -> None:
    """If a transform kept a view of the private gradient copy, the step copies it away
    before writing over it."""
    params = make_params()
    layout = Layout(params, [(list(range(len(params))), 0.0)])
    pool = Pool(layout, 3)
    grads = make_grads(params, 1)[0]
    first = pool.gradient_buffers()
    layout.gather(grads, first)
    escaped = layout.views(first)[2]
    value = escaped.clone()
    assert pool.reclaim_gradients()[0] is not first[0]
    assert pool.gradient_buffers()[0] is not first[0]
    assert torch.equal(escaped, value)
    del escaped
    free = pool.gradient_buffers()
    assert pool.reclaim_gradients() is free


def _counts_drifted(params: list[Tensor]) -> tuple[fo.GradientTransformation, Any]:
    tx = fo.adam(lr=LR)
    state = tx.init(params)
    grads: list[Tensor | None] = list(make_grads(params, 1, seed=11)[0])
    grads[2] = None
    _, state = fo.pure_step(tx)(params, grads, state)
    return tx, state


def test_unequal_step_counts_take_the_fused_way_bitwise() -> None:
    """The out-of-place kernel takes one step count; counters that drifted apart (a leaf
    without a gradient once) go the way with per-leaf counts: pure_step's default, bitwise."""
    params = make_params()
    tx, state = _counts_drifted(params)
    step, _ = _flat_step(tx)
    grads = make_grads(params, 1, seed=12)[0]
    ours = step(params, grads, state)
    default = fo.pure_step(tx)(params, grads, state)
    assert_tensors_equal(_snapshot(*ours), _snapshot(*default), what="fallback")


@pytest.mark.parametrize("mode", ["python", "fused"])
@pytest.mark.parametrize(
    "make_tx",
    [lambda: fo.adam(lr=LR), lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR))],
    ids=["adam", "clip then adamw"],
)
@pytest.mark.parametrize(
    "change",
    [
        lambda p, g: (p.to(torch.bfloat16), g.to(torch.bfloat16)),
        lambda p, g: (p, g.double()),
    ],
    ids=["bfloat16 params", "float64 grads for float32 params"],
)
def test_calls_the_out_of_place_kernel_does_not_take(
    change: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    make_tx: Callable[[], fo.GradientTransformation],
    mode: str,
) -> None:
    """Other dtypes, and gradients that do not match their params (which cannot be gathered),
    give ``tx.step``'s result bitwise, or its error."""
    tx = make_tx()
    pairs = [change(p, g) for p, g in zip(make_params(), make_grads(make_params(), 1)[0])]
    params = [p for p, _ in pairs]
    grads = [g for _, g in pairs]
    state = tx.init(params)
    step, _ = _flat_step(tx, mode)
    ref_params = clone_tensors(params)
    try:
        ref_state = tx.step(ref_params, clone_tensors(grads), tx.init(ref_params))
    except (RuntimeError, TypeError, ValueError) as error:
        with pytest.raises(type(error)):
            step(params, grads, state)
    else:
        new_params, new_state = step(params, grads, state)
        assert_tensors_equal(list(new_params), ref_params, what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), what="state")


def test_autograd_and_torch_func_calls_take_the_per_leaf_path() -> None:
    params = make_params(((3,), (2, 2)), dtype=torch.float64)
    grads = make_grads(params, 1)[0]
    flat_step, flat = _flat_step(fo.adam(lr=LR))

    def after(lr: Tensor, use_flat: bool) -> Tensor:
        tx = fo.adam(lr=lr)
        step = _make_step(tx, flat) if use_flat else fo.pure_step(tx)
        new, _ = step(params, grads, tx.init(params))
        return sum((p * p).sum() for p in new)  # type: ignore[return-value]

    lr = torch.tensor(LR, dtype=torch.float64)
    ours = torch.func.grad(after)(lr, True)
    assert ours.abs() > 0
    assert_tensors_equal([ours], [torch.func.grad(after)(lr, False)], what="meta-gradient")
    assert _generations(flat) == 0
    del flat_step


@pytest.mark.compile
def test_torch_compile_smoke_pure_step() -> None:
    """One torch.compile run (a few seconds on CPU): the compiled kernel matches ``tx.step``."""
    tx = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR, weight_decay=0.1))
    step = fo.pure_step(tx, compiled=True)
    params = make_params(((5, 4), (7,), (5, 4)))
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    for row in make_grads(params, 3, seed=13):
        before = _snapshot(params, row, state)
        new_params, new_state = step(params, row, state)
        assert_tensors_equal(_snapshot(params, row, state), before, what="an input was mutated")
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
        assert_tensors_equal(list(new_params), ref_params, *TOL[torch.float32], what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), *TOL[torch.float32])
        params, state = new_params, new_state


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["default", "compiled"])
def test_cuda_pure_step_matches_in_place_step(compiled: bool) -> None:
    """On CUDA both ways run on the device: the default bitwise ``tx.step``, the compiled
    kernel (triton) within an ulp or two; every input is left alone."""
    tx = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR, weight_decay=0.1))
    step = fo.pure_step(tx, compiled=compiled)
    params = [p.cuda() for p in make_params()]
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    tol = TOL[torch.float32] if compiled else (0.0, 0.0)
    for row in make_grads(params, 4, seed=16):
        grads = [g.cuda() for g in row if g is not None]
        before = _snapshot(params, grads, state)
        new_params, new_state = step(params, grads, state)
        assert_tensors_equal(_snapshot(params, grads, state), before, what="an input was mutated")
        ref_state = tx.step(ref_params, clone_tensors(grads), ref_state)
        assert all(p.is_cuda for p in new_params)
        assert_tensors_equal(list(new_params), ref_params, *tol, what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), *tol, what="state")
        params, state = new_params, new_state
