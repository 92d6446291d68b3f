"""``pure_step``'s kernel runner and its flat buffers: recycled generations, inputs kept intact.

Every test compares with the transform's own in-place ``tx.step`` on copies (bitwise: the same
kernel on the same values) or with ``update`` + ``apply_updates``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._flat_buffers import MAX_GENERATIONS, Pool
from functional_optim._pure_flat import FlatRunner

from . import test_pure_step
from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params
from .test_pure_step import _others, _tensors

TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-14)}
LR = 0.05


class _Spy:
    """Records the runners ``pure_step`` makes, to look at their pools."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runners: list[FlatRunner] = []
        init = FlatRunner.__init__

        def recording_init(runner: FlatRunner, chunk_bytes: int) -> None:
            init(runner, chunk_bytes)
            self.runners.append(runner)

        monkeypatch.setattr(FlatRunner, "__init__", recording_init)

    def pools(self, kind: str = "kernel") -> list[Pool]:
        """The pools of the kernel calls' outputs, or (``"copies"``) of gradient copies."""
        return [
            pool
            for r in self.runners
            for key, pools in r._pools.items()
            if (key[0] == "copies") == (kind == "copies")
            for pool in pools
        ]

    def generations(self) -> int:
        return sum(len(pool.generations) for pool in self.pools())


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> _Spy:
    return _Spy(monkeypatch)


def _snapshot(*trees: Any) -> list[Tensor]:
    return [t.clone() for tree in trees for t in _tensors(tree)]


def _loop(
    step: Any, tx: fo.GradientTransformation, params: list[Tensor], steps: int, seed: int
) -> tuple[list[Tensor], Any]:
    state = tx.init(params)
    for row in make_grads(params, steps, seed=seed):
        params, state = step(params, row, state)
    return params, state


def _inside(leaf: Tensor, flats: list[Tensor]) -> bool:
    start = leaf.data_ptr()
    return any(f.data_ptr() <= start < f.data_ptr() + f.numel() * f.element_size() for f in flats)


@pytest.mark.parametrize(
    "make_tx",
    [lambda: fo.adamw(lr=LR, weight_decay=0.1), lambda: fo.sgd(lr=LR, momentum=0.9)],
    ids=["adamw", "sgd momentum (buffers made by the first step)"],
)
def test_two_generations_alternate_and_outputs_live_in_them(
    make_tx: Callable[[], fo.GradientTransformation], spy: _Spy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a loop the step reads its own last outputs (slice copies after the first step or
    two, empty and 0-d leaves included), writes into the generation before, and hands out the
    same leaf objects every other step."""
    found: list[bool] = []
    find = Pool.find

    def recording_find(pool: Pool, leaves: Any) -> Any:
        gen = find(pool, leaves)
        found.append(gen is not None)
        return gen

    monkeypatch.setattr(Pool, "find", recording_find)
    tx = make_tx()
    step = fo.pure_step(tx)
    params, state = _loop(step, tx, make_params(), 6, seed=3)
    assert len(found) >= 4
    assert all(found[-4:])
    params = make_params(((7,), (4, 5), (2, 3, 4), (4, 5)))
    state = tx.init(params)
    returned: list[list[int]] = []
    for row in make_grads(params, 6, seed=3):
        params, state = step(params, row, state)
        returned.append([id(p) for p in params])
    assert returned[-1] == returned[-3]
    assert returned[-1] != returned[-2]
    assert spy.generations() == 2  # the second layout's two; the first layout's were released
    flats = [
        f for pool in spy.pools() for gen in pool.generations for kind in gen.flats for f in kind
    ]
    moments = [t for t in _tensors(state) if t.dim() > 0]
    assert len(moments) >= len(params)
    for leaf in [*params, *moments]:
        assert _inside(leaf, flats), "a returned leaf is not a view of a kept generation"


def test_a_changing_set_of_gradients_keeps_the_memory_of_one_layout(spy: _Spy) -> None:
    """Leaves without a gradient on alternate steps make two layouts; only the one in use
    keeps spare buffers."""
    tx = fo.adam(lr=LR)
    step = fo.pure_step(tx)
    params = make_params(((4, 5), (7,), (3,)))
    state = tx.init(params)
    ref_params, ref_state = clone_tensors(params), tx.init(clone_tensors(params))
    for k, row in enumerate(make_grads(params, 8, seed=18)):
        grads = [None if (k % 2 and j == 1) else g for j, g in enumerate(row)]
        params, state = step(params, grads, state)
        ref_state = tx.step(ref_params, clone_tensors(grads), ref_state)
        assert spy.generations() <= 3
    assert len(spy.pools()) == 2
    assert_tensors_equal(list(params), ref_params, what="params")
    assert_tensors_equal(_tensors(state), _tensors(ref_state), what="state")


def test_float32_and_float64_leaves_and_a_masked_decay(spy: _Spy) -> None:
    """One flat buffer per dtype; a masked decay makes two kernel calls, each with its pool."""
    tx = fo.chain(
        fo.clip_by_global_norm(0.5),
        fo.scale_by_adam(),
        fo.masked(fo.add_decayed_weights(0.1), lambda ps: [p.ndim > 1 for p in ps]),
        fo.scale_by_learning_rate(LR),
    )
    step = fo.pure_step(tx)
    params = make_params(dtype=torch.float32) + make_params(dtype=torch.float64, seed=4)
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    for row in make_grads(params, 3, seed=19):
        inputs = (params, row, state)
        before = _snapshot(*inputs)
        params, state = step(params, row, state)
        assert_tensors_equal(_snapshot(*inputs), before, what="an input was mutated")
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
        assert_tensors_equal(list(params), ref_params, what="params")
        assert_tensors_equal(_tensors(state), _tensors(ref_state), what="state")
        assert _others(state) == _others(ref_state)
    pools = spy.pools()
    assert len(pools) == 2
    assert len(spy.pools("copies")) == 1  # the clipped gradients
    for pool in [*pools, *spy.pools("copies")]:
        assert {b.dtype for b in pool.layout.buckets} == {torch.float32, torch.float64}


def test_a_state_the_caller_keeps_is_never_overwritten(spy: _Spy) -> None:
    """Old params and state, a view of an old leaf, and a leaf the caller made require grad
    keep their values while the step goes on; the pool grows to its cap and no further."""
    tx = fo.adam(lr=LR)
    step = fo.pure_step(tx)
    params = make_params(dtype=torch.float64)
    state = tx.init(params)
    kept: list[tuple[list[Tensor], list[Tensor]]] = []
    view_of_old: Tensor | None = None
    marked: Tensor | None = None
    for k, row in enumerate(make_grads(params, 9, seed=5)):
        params, state = step(params, row, state)
        if k in (1, 3, 4):
            kept.append((list(params) + _tensors(state), _snapshot(params, state)))
        if k == 2:
            view_of_old = params[3][1:]
            view_values = view_of_old.clone()
        if k == 5:
            marked = params[0].requires_grad_(True)
            marked_value = marked.detach().clone()
    for live, values in kept:
        assert_tensors_equal(live, values, what="a kept state changed")
    assert view_of_old is not None
    assert marked is not None
    assert torch.equal(view_of_old, view_values)
    assert torch.equal(marked.detach(), marked_value)
    assert spy.generations() == MAX_GENERATIONS


def test_same_inputs_twice_give_the_same_independent_outputs() -> None:
    tx = fo.adam(lr=LR)
    step = fo.pure_step(tx)
    params, state = _loop(step, tx, make_params(), 2, seed=7)
    grads = make_grads(params, 1, seed=8)[0]
    first_params, first_state = step(params, grads, state)
    first_values = _snapshot(first_params, first_state)
    second_params, second_state = step(params, grads, state)
    assert_tensors_equal(_snapshot(second_params, second_state), first_values, what="branch")
    assert_tensors_equal(_snapshot(first_params, first_state), first_values, what="overwritten")


def test_inputs_from_elsewhere_are_copied_leaf_by_leaf() -> None:
    """Copies of the state (not the step's own views) give the same result as the views."""
    tx = fo.adam(lr=LR, amsgrad=True)
    step = fo.pure_step(tx)
    params, state = _loop(step, tx, make_params(), 3, seed=9)
    grads = make_grads(params, 1, seed=10)[0]
    own = step(params, grads, state)
    copied_state = fo.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, state)
    copied = step([p.clone() for p in params], grads, copied_state)
    assert_tensors_equal(_snapshot(*copied), _snapshot(*own), what="copied vs own")


def test_a_transposed_view_of_a_returned_leaf_is_read_by_value() -> None:
    """A transposed view of a returned square leaf starts where the leaf did, with its
    elements laid out differently: it is copied by value, and the result is ``update`` +
    ``apply_updates``'s."""
    tx = fo.adam(lr=LR)
    step = fo.pure_step(tx)
    params, state = _loop(step, tx, make_params(((3, 3), (4,))), 2, seed=14)
    grads = make_grads(params, 1, seed=15)[0]
    moved = [params[0].t(), params[1]]
    assert moved[0].data_ptr() == params[0].data_ptr()
    ours, _ = step(moved, grads, state)
    updates, _ = tx.update(grads, state, moved)
    expected = fo.apply_updates(moved, updates)
    assert_tensors_equal(list(ours), list(expected), *TOL[torch.float32], what="params")


def test_buffers_made_in_inference_mode_are_not_written_outside_it() -> None:
    """Steps inside ``torch.inference_mode()`` make inference tensors, which may not be written
    outside it: the step keeps separate buffers per mode, and the results stay usable."""
    tx = fo.adam(lr=LR)
    step = fo.pure_step(tx)
    params = make_params(((3, 4), (5,)))
    state = tx.init(params)
    rows = make_grads(params, 7, seed=17)
    ref_params, ref_state = clone_tensors(params), tx.init(clone_tensors(params))
    with torch.inference_mode():
        for row in rows[:3]:
            params, state = step(params, row, state)
    for row in rows[3:]:
        params, state = step(params, row, state)
    assert not params[0].is_inference()
    for row in rows:
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
    assert_tensors_equal(list(params), ref_params, what="params")


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fo.adafactor(lr=LR),
        lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR)),
        lambda: fo.sgd(lr=LR, momentum=0.9),
    ],
    ids=["adafactor (factored state)", "clip then adamw", "sgd momentum"],
)
@pytest.mark.parametrize(
    "change",
    [
        lambda p, g: (p.to(torch.bfloat16), g.to(torch.bfloat16)),
        lambda p, g: (p, g.double()),
        lambda p, g: (p.t() if p.ndim == 2 else p, g.t() if g.ndim == 2 else g),
    ],
    ids=["bfloat16", "float64 grads for float32 params", "transposed params"],
)
def test_unusual_leaves_give_the_in_place_steps_numbers(
    change: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    make_tx: Callable[[], fo.GradientTransformation],
) -> None:
    """Factored moments and other dtypes (the kernel runs on clones), non-contiguous params
    (copied by value): ``tx.step``'s result bitwise, or its error; no input changes."""
    tx = make_tx()
    pairs = [change(p, g) for p, g in zip(make_params(), make_grads(make_params(), 1)[0])]
    params = [p for p, _ in pairs]
    state = tx.init(params)
    step = fo.pure_step(tx)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    for row in make_grads(params, 3, seed=20):
        grads = [change(p, g)[1] for p, g in zip(make_params(), row)]
        try:
            ref_state = tx.step(ref_params, clone_tensors(grads), ref_state)
        except (RuntimeError, TypeError, ValueError, ZeroDivisionError) as error:
            with pytest.raises(type(error)):
                step(params, grads, state)
            return
        inputs = (params, grads, state)
        before = _snapshot(*inputs)
        params, state = step(params, grads, state)
        assert_tensors_equal(_snapshot(*inputs), before, what="an input was mutated")
        assert_tensors_equal(list(params), ref_params, what="params")
        assert_tensors_equal(_tensors(state), _tensors(ref_state), what="state")


def test_autograd_and_torch_func_calls_take_the_per_leaf_path(spy: _Spy) -> None:
    """A meta-gradient through ``pure_step`` (test_pure_step's) makes no flat buffer."""
    test_pure_step.test_pure_step_differentiable_under_torch_func()
    assert spy.runners
    assert spy.generations() == 0


@pytest.mark.compile
def test_torch_compile_of_pure_step_takes_the_traceable_path() -> None:
    """Under ``torch.compile`` the step is ``update`` + ``apply_updates`` (the kernel runner
    is plain Python): one compiled run matches it and leaves every input alone."""
    tx = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR, weight_decay=0.1))
    step = torch.compile(fo.pure_step(tx), backend="aot_eager")
    params = make_params(((5, 4), (7,), (5, 4)))
    state = tx.init(params)
    ref_params, ref_state = params, state
    for row in make_grads(params, 3, seed=13):
        inputs = (params, row, state)
        before = _snapshot(*inputs)
        params, state = step(params, row, state)
        assert_tensors_equal(_snapshot(*inputs), before, what="an input was mutated")
        updates, ref_state = tx.update(row, ref_state, ref_params)
        ref_params = fo.apply_updates(ref_params, updates)
        assert_tensors_equal(list(params), list(ref_params), *TOL[torch.float32], what="params")


@pytest.mark.gpu
def test_cuda_pure_step_matches_in_place_step() -> None:
    """On CUDA the step runs on the device, bitwise ``tx.step``; every input is left alone."""
    tx = fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=LR, weight_decay=0.1))
    step = fo.pure_step(tx)
    params = [p.cuda() for p in make_params()]
    state = tx.init(params)
    ref_params = clone_tensors(params)
    ref_state = tx.init(ref_params)
    for row in make_grads(params, 4, seed=16):
        grads = [g.cuda() for g in row if g is not None]
        before = _snapshot(params, grads, state)
        new_params, new_state = step(params, grads, state)
        assert_tensors_equal(_snapshot(params, grads, state), before, what="an input was mutated")
        ref_state = tx.step(ref_params, clone_tensors(grads), ref_state)
        assert all(p.is_cuda for p in new_params)
        assert_tensors_equal(list(new_params), ref_params, what="params")
        assert_tensors_equal(_tensors(new_state), _tensors(ref_state), what="state")
        params, state = new_params, new_state


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fo.adam(lr=LR),
        lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.scale_by_adam(), fo.scale(-LR)),
        lambda: fo.chain(fo.scale_by_lion(), fo.scale_by_learning_rate(LR)),
    ],
    ids=["adam", "clipped adam tail", "lion tail"],
)
def test_step_counters_stay_one_block(make_tx: Callable[[], fo.GradientTransformation]) -> None:
    """The counters a kernel increments are copied as one block (one op), not cloned one by
    one before the step: the new counters are views of one buffer, as ``init`` made them."""
    tx = make_tx()
    params, state = _loop(fo.pure_step(tx), tx, make_params(((3, 2), (5,), (4,))), 3, seed=21)
    counts = [
        t
        for t in _tensors(state)
        if t.dim() == 0 and t.dtype == torch.float32 and t._base is not None
    ]
    assert len(counts) == len(params)
    assert all(c._base is counts[0]._base for c in counts)
    assert [float(c) for c in counts] == [3.0] * len(params)
