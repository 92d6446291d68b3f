"""The ``"int8"`` minifloat codes and the one-pass C++ step of low-bit Adam / AdamW on CPU.

The C++ step (``compile=None``, the default) must give bitwise what the torch-op path gives
(``compile=False``: the batched path with the same maths), and fall back to that path, with
nothing changed first, wherever it does not apply.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import functional_optim as fo
from functional_optim._lowbit import fused_cpu, minifloat

SHAPES = [(37, 53), (129, 31), (300,), (7, 5), (64, 64)]  # partial last blocks, one fp32 param


@pytest.fixture
def cpp_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each C++ step's result (True: it ran), recorded; the extension must build here."""
    pytest.importorskip("ninja", reason="the [cpu-kernels] extra builds the C++ step")
    assert fused_cpu.extension() is not None
    calls: list[bool] = []
    real = fused_cpu.step

    def spy(*args: Any, **kwargs: Any) -> bool:
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(fused_cpu, "step", spy)
    return calls


def _train(
    make: Callable[[bool | None], fo.GradientTransformation],
    compile: bool | None,
    dtype: torch.dtype = torch.float32,
    steps: int = 4,
    grad_view: Callable[[torch.Tensor], torch.Tensor] = lambda g: g,
    shapes: list[tuple[int, ...]] = SHAPES,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    opt = fo.Optimizer(params, make(compile))
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=gen).to(dtype) * 10.0 ** (i - 3)
            p.grad = grad_view(grad)
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def _same(a: tuple[list[torch.Tensor], dict[str, Any]], b: Any) -> bool:
    params_equal = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    state_a, state_b = a[1]["state"], b[1]["state"]
    return params_equal and all(
        torch.equal(state_a[i][k], state_b[i][k]) for i in state_a for k in state_a[i]
    )


def _lowbit(
    inner: Callable[[], fo.GradientTransformation], kind: str = "int8"
) -> Callable[..., Any]:
    def make(compile: bool | None) -> fo.GradientTransformation:
        return fo.quantized_state(inner(), kind, block_size=64, min_size=200, compile=compile)

    return make


CASES = {
    "adamw": _lowbit(lambda: fo.adamw(lr=1e-2, weight_decay=0.1)),
    "adamw_default_decay": _lowbit(lambda: fo.adamw(lr=1e-2)),
    "adam_l2_maximize": _lowbit(lambda: fo.adam(lr=1e-2, weight_decay=0.05, maximize=True)),
    "fp8_adamw": _lowbit(lambda: fo.adamw(lr=1e-2, weight_decay=0.1), "fp8"),
    "fp8_adam_l2_maximize": _lowbit(
        lambda: fo.adam(lr=1e-2, weight_decay=0.05, maximize=True), "fp8"
    ),
    "int4_adamw": _lowbit(lambda: fo.adamw(lr=1e-2, weight_decay=0.1), "int4"),
    "int4_adam_l2_maximize": _lowbit(
        lambda: fo.adam(lr=1e-2, weight_decay=0.05, maximize=True), "int4"
    ),
}


#: name -> (the transform with the C++ step, the same maths on the torch-op path)
PAIRS = {
    name: (functools.partial(make, None), functools.partial(make, False))
    for name, make in CASES.items()
}
PAIRS["alias"] = (
    lambda: fo.adamw8bit(lr=1e-2, block_size=64, min_size=200),
    functools.partial(CASES["adamw_default_decay"], False),
)
PAIRS["fp8_alias"] = (
    lambda: fo.adamw_fp8(lr=1e-2, block_size=64, min_size=200),
    functools.partial(_lowbit(lambda: fo.adamw(lr=1e-2), "fp8"), False),
)
PAIRS["int4_alias"] = (
    lambda: fo.adamw4bit(lr=1e-2, block_size=64, min_size=200),
    functools.partial(_lowbit(lambda: fo.adamw(lr=1e-2), "int4"), False),
)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_cpp_step_is_bitwise_the_torch_op_path(name: str, cpp_calls: list[bool]) -> None:
    fused, torch_ops = PAIRS[name]
    got = _train(lambda _: fused(), None)
    assert cpp_calls  # every step after the first, which lays the buffers out
    assert all(cpp_calls)
    assert _same(got, _train(lambda _: torch_ops(), None))
    assert not _same(got, _train(lambda _: torch_ops(), None, steps=3))  # the check can fail


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cpp_step_gives_the_same_bits_on_one_and_two_threads(
    kind: str, cpp_calls: list[bool]
) -> None:
    """The C++ step splits a param's blocks between torch's threads (64 blocks of 64 or more
    per thread); the blocks are independent, so the thread count changes nothing."""
    shapes = [*SHAPES, (300, 300)]
    make = _lowbit(lambda: fo.adamw(lr=1e-2, weight_decay=0.1), kind)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _train(make, None, shapes=shapes)
        torch.set_num_threads(2)
        two = _train(make, None, shapes=shapes)
    finally:
        torch.set_num_threads(threads)
    assert cpp_calls
    assert all(cpp_calls)
    assert _same(one, two)


@pytest.mark.parametrize(
    "case",
    [
        "amsgrad",
        "bfloat16",
        "transposed_grads",
    ],
)
def test_cpp_step_falls_back_to_the_torch_op_path(case: str, cpp_calls: list[bool]) -> None:
    make = CASES["adamw"]
    kwargs: dict[str, Any] = {}
    if case == "amsgrad":
        make = _lowbit(lambda: fo.adamw(lr=1e-2, amsgrad=True))
    elif case == "bfloat16":
        kwargs["dtype"] = torch.bfloat16
    else:  # non-contiguous gradients: the extension refuses them before changing anything
        kwargs["grad_view"] = lambda g: g.t().contiguous().t() if g.dim() == 2 else g
    fused = _train(make, None, **kwargs)
    assert _same(fused, _train(make, False, **kwargs))
    assert not any(cpp_calls)


def test_minifloat_codes_round_trip_and_never_use_the_spare_codes() -> None:
    for signed, used in ((True, [*range(121), *range(128, 249)]), (False, range(249))):
        codes = torch.tensor(list(used), dtype=torch.int32).to(torch.uint8)
        values = minifloat.decode(codes, signed)
        assert float(values.abs().max()) == 1.0
        back = minifloat.encode(values, signed)
        zero = values == 0  # signed: codes 0 and 128 are both zero
        assert torch.equal(back[~zero], codes[~zero])
        x = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
        x = x * 2 - 1 if signed else x
        got = minifloat.encode(torch.cat([x, torch.tensor([1.0, 1e-30, 0.0])]), signed)
        assert bool((got & 127 <= 120).all()) if signed else bool((got <= 248).all())
    assert int(minifloat.encode(torch.tensor([1e-30]), False)) == 1  # never rounds to zero
    assert int(minifloat.encode(torch.tensor([2.0**-17]), True)) == 0  # below half a step


@pytest.mark.parametrize(
    ("alias", "atol"), [("adamw8bit", 2e-3), ("adamw4bit", 2e-2), ("adamw_fp8", 2e-3)]
)
def test_bfloat16_params_keep_moments_in_their_dtype_like_torch(alias: str, atol: float) -> None:
    """bf16 params: the batched path hands the inner step bf16 moments, as torch.optim keeps
    them (it raised a dtype error before)."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen).bfloat16() for s in SHAPES]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt = fo.Optimizer(ours, getattr(fo, alias)(lr=1e-2, block_size=64, min_size=200))
    torch_opt = torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen).bfloat16()
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b, p0 in zip(ours, theirs, start, strict=True):
        assert a.dtype == torch.bfloat16
        assert not torch.equal(a.detach(), p0)
        # within two bf16 steps (2**-7 relative): the moments' codes move bf16's rounding
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2**-6, atol=atol)


# dynamo's advice on the code maps' and layouts' caches (it traces through them: they are pure)
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_compiled_step_skips_the_cpp_step_and_stays_within_1e6() -> None:
    """Under torch.compile the kernel seam is bypassed: the step takes the batched path (torch's
    kernel maths, traced) instead of writing into the stand-in moments."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(64, 128, generator=gen)) for _ in range(2)]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opts = [
        fo.Optimizer(ps, fo.adamw8bit(lr=1e-2, min_size=1000, block_size=64))
        for ps in (ours, eager)
    ]
    for p, q in zip(ours, eager, strict=True):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    compiled = torch.compile(opts[0].step, backend="aot_eager")
    for _ in range(3):
        compiled()
        opts[1].step()
    for p, q in zip(ours, eager, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
