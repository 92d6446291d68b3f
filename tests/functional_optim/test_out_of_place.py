"""``pure_step``'s out-of-place CPU kernels (Adam, AdamW, SGD): they run where they apply, give
``tx.step``'s bits (torch's fused kernels'), and decline, with nothing written, elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim import _out_of_place
from functional_optim._out_of_place import cpu_extension as built

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params
from .test_pure_step import _tensors

#: sizes with a scalar tail only, whole vectors, vectors and a tail, several 64-byte pieces
SHAPES = ((3,), (8,), (5, 5), (16, 17), (1029,), (64, 64), (0,))

needs_extension = pytest.mark.skipif(
    built.built() is None, reason="needs the C++ extension (x86 AVX2 and a compiler)"
)


class _Calls:
    """Counts the out-of-place kernels' runs and declines."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ran = 0
        self.declined = 0
        table = dict(_out_of_place._BY_KERNEL)
        for kernel, fast in table.items():
            table[kernel] = self._counting(fast)
        monkeypatch.setattr(_out_of_place, "_BY_KERNEL", table)

    def _counting(self, fast: _out_of_place.OutOfPlace) -> _out_of_place.OutOfPlace:
        def run(args: Sequence[Any], old: Sequence[Sequence[Tensor] | None]) -> bool:
            ran = fast(args, old)
            self.ran += ran
            self.declined += not ran
            return ran

        return run


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    return _Calls(monkeypatch)


def _compare(
    make_tx: Callable[[], fo.GradientTransformation],
    steps: int = 4,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    dtype: torch.dtype = torch.float32,
) -> None:
    """``steps`` pure steps against ``tx.step`` on copies, bitwise, the inputs left intact."""
    tx = make_tx()
    params = make_params(shapes, dtype=dtype)
    grads = make_grads(params, steps, seed=5)
    step = fo.pure_step(tx)
    state = tx.init(params)
    ref_params, ref_state = clone_tensors(params), tx.init(clone_tensors(params))
    for row in grads:
        before = [t.clone() for t in [*params, *_tensors(state)]]
        params_in, state_in = params, state
        params, state = step(params, row, state)
        assert_tensors_equal([*params_in, *_tensors(state_in)], before, what="inputs")
        ref_state = tx.step(ref_params, clone_tensors(row), ref_state)
        assert_tensors_equal(params, ref_params, what="params")
        assert_tensors_equal(_tensors(state), _tensors(ref_state), what="state")


ALGORITHMS = {
    "adam": lambda: fo.adam(lr=0.05),
    "adam l2 maximize": lambda: fo.adam(lr=0.05, weight_decay=0.1, maximize=True),
    "adam amsgrad small beta1": lambda: fo.adam(lr=0.05, betas=(0.3, 0.9), amsgrad=True),
    "adamw": lambda: fo.adamw(lr=0.05, weight_decay=0.1),
    "adamw amsgrad maximize": lambda: fo.adamw(lr=0.05, amsgrad=True, maximize=True),
    "chain clip adamw": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=0.05)),
    "optax adamw tail": lambda: fo.chain(
        fo.scale_by_adam(), fo.add_decayed_weights(0.01), fo.scale_by_learning_rate(0.05)
    ),
    "sgd momentum": lambda: fo.sgd(lr=0.05, momentum=0.9),
    "sgd nesterov decay maximize": lambda: fo.sgd(
        lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True
    ),
    "sgd dampening": lambda: fo.sgd(lr=0.05, momentum=0.9, dampening=0.2),
    "sgd plain": lambda: fo.sgd(lr=0.05),
}


@needs_extension
@pytest.mark.parametrize("make_tx", ALGORITHMS.values(), ids=ALGORITHMS.keys())
def test_out_of_place_steps_equal_the_in_place_step(
    make_tx: Callable[[], fo.GradientTransformation], calls: _Calls
) -> None:
    """Vector loops, scalar tails and empty leaves; every option of the three kernels."""
    _compare(make_tx)
    assert calls.ran >= 2  # SGD's first step makes its buffers: torch's kernel then


@needs_extension
def test_threads_split_tensors_as_torch_does(calls: _Calls) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _compare(lambda: fo.adamw(lr=0.05, weight_decay=0.1), shapes=((1000, 37), (4099,)))
        _compare(lambda: fo.sgd(lr=0.05, momentum=0.9), shapes=((1000, 37), (4099,)))
    finally:
        torch.set_num_threads(threads)
    assert calls.ran >= 6


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fo.adam(lr=0.05, foreach=True),  # not torch's fused maths
        lambda: fo.adamw(lr=0.05, foreach=False),
        lambda: fo.sgd(lr=0.05, momentum=0.9, foreach=False),
    ],
    ids=["adam foreach", "adamw single", "sgd single"],
)
def test_other_paths_are_declined_and_give_the_same_numbers(
    make_tx: Callable[[], fo.GradientTransformation], calls: _Calls
) -> None:
    _compare(make_tx)
    assert calls.ran == 0
    assert calls.declined >= 2


def test_float64_params_are_declined(calls: _Calls) -> None:
    _compare(lambda: fo.adam(lr=0.05), dtype=torch.float64)
    assert calls.ran == 0


@needs_extension
def test_a_declined_call_writes_nothing() -> None:
    """A list that does not fit (a wrong size, a non-contiguous tensor, a float64 counter, no
    counters)
    returns False before any counter or buffer is written."""
    fast = _out_of_place.for_kernel(fo.kernels.adam)
    assert fast is not None
    old = [torch.randn(9) for _ in range(3)]
    for bad in ("size", "strides", "counter", "no counters"):
        new = [torch.zeros(9) for _ in range(3)]
        grads = [torch.randn(9)]
        steps = [torch.tensor(1.0)]
        if bad == "size":
            new[2] = torch.zeros(8)
        elif bad == "strides":
            grads = [torch.randn(9, 2)[:, 0]]
        elif bad == "counter":
            steps = [torch.tensor(1.0, dtype=torch.float64)]
        else:
            steps = []
        args = [[new[0]], grads, [new[1]], [new[2]], [], steps, False, 0.9, 0.99, 0.1, 0.0, 1e-8]
        args.append(False)
        olds = [[old[0]], None, [old[1]], [old[2]], None, None]
        assert not fast(args, olds + [None] * 7), bad
        assert all(not t.any() for t in new), bad
        assert all(s.item() == 1.0 for s in steps), bad


def test_a_kernel_that_disagrees_with_torch_is_not_used() -> None:
    """The once-per-process probe: maths rounded otherwise than torch's kernels (here torch's
    unfused ops) fail it, so such a build would never be used."""

    class Unfused:
        @staticmethod
        def adam_out(old: Any, grads: Any, out: Any, steps: Any, *hyper: Any) -> None:
            lr, b1, b2, wd, eps, amsgrad, maximize, decoupled, _ = hyper
            for j, g in enumerate(grads):
                steps[j] += 1
                t = steps[j].item()
                g = -g if maximize else g
                p = old[0][j] * (1 - lr * wd) if decoupled else old[0][j]
                g = g if decoupled else g + old[0][j] * wd
                m = old[1][j] + (g - old[1][j]) * (1 - b1)
                v = old[2][j] * b2 + g * g * (1 - b2)
                if amsgrad:
                    v = torch.maximum(old[3][j], v)
                    out[3][j].copy_(v)
                denom = v.sqrt() / (1 - b2**t) ** 0.5 + eps
                out[0][j].copy_(p - lr / (1 - b1**t) * m / denom)
                out[1][j].copy_(m)
                out[2][j].copy_(old[2][j] * b2 + g * g * (1 - b2))

    assert not built.agrees_with_torch(Unfused())


@needs_extension
def test_the_built_extension_agrees_with_torch() -> None:
    assert built.agrees_with_torch(built.built())
    assert built.extension() is not None


@needs_extension
def test_the_check_runs_on_cpu_float32_whatever_the_defaults() -> None:
    """The first use may come inside a user's ``torch.device`` context or under a float64
    default dtype: the probe makes its own tensors on the CPU in fp32."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            assert built.agrees_with_torch(built.built())
    finally:
        torch.set_default_dtype(dtype)


@needs_extension
def test_streaming_stores_give_the_same_bits(
    calls: _Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large steps write with streaming stores (where a 32-byte address allows); forced here."""
    monkeypatch.setattr(_out_of_place, "STREAM_BYTES", 0)
    _compare(lambda: fo.adamw(lr=0.05, weight_decay=0.1, amsgrad=True), shapes=((64, 65), (40,)))
    _compare(lambda: fo.sgd(lr=0.05, momentum=0.9, nesterov=True), shapes=((64, 65), (40,)))
    assert calls.ran >= 6
