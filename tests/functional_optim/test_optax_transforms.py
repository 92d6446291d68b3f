"""optax-named transforms one by one: formulas, pure == in place bitwise, ``inject_hyperparams``."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params

TRANSFORMS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "scale_by_optax_adam_nesterov": lambda: fo.scale_by_optax_adam(eps_root=1e-8, nesterov=True),
    "scale_by_lion": lambda: fo.scale_by_lion(),
    "scale_by_amsgrad": lambda: fo.scale_by_amsgrad(),
    "scale_by_belief": lambda: fo.scale_by_belief(nesterov=True),
    "scale_by_yogi": lambda: fo.scale_by_yogi(),
    "scale_by_novograd": lambda: fo.scale_by_novograd(weight_decay=0.1),
    "scale_by_adan": lambda: fo.scale_by_adan(),
    "scale_by_sm3": lambda: fo.scale_by_sm3(),
    "scale_by_trust_ratio": lambda: fo.scale_by_trust_ratio(min_norm=1e-3, eps=1e-6),
    "scale_by_sign": lambda: fo.scale_by_sign(),
    "scale_by_rms_debiased": lambda: fo.scale_by_rms_debiased(),
    "clip": lambda: fo.clip(0.5),
    "clip_by_block_rms": lambda: fo.clip_by_block_rms(0.5),
    "centralize": lambda: fo.centralize(),
    "zero_nans": lambda: fo.zero_nans(),
    "keep_params_nonnegative": lambda: fo.keep_params_nonnegative(),
    "ema": lambda: fo.ema(0.9),
    "add_noise": lambda: fo.add_noise(0.1, 0.55, 3),
    "set_to_zero": lambda: fo.set_to_zero(),
    "masked": lambda: fo.masked(fo.scale_by_adan(), [True, False, True, False, True]),
    "multi_transform": lambda: fo.multi_transform(
        {"a": fo.scale_by_lion(), "b": fo.ema(0.5)}, ["a", "b", "a", "b", "b"]
    ),
    "freeze": lambda: fo.freeze([False, True, False, True, False]),
    "apply_if_finite": lambda: fo.apply_if_finite(fo.scale_by_yogi(), 2),
    "multi_steps": lambda: fo.MultiSteps(fo.scale_by_amsgrad(), 2).gradient_transformation(),
    "schedule_free": lambda: fo.schedule_free(fo.scale_by_learning_rate(0.1), 0.1),
}


def _tensors(tree: object) -> list[Tensor | None]:
    return [x for x in tree_leaves(tree) if isinstance(x, Tensor) or x is None]


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pure_and_inplace_agree_bitwise(name: str, dtype: torch.dtype) -> None:
    tx = TRANSFORMS[name]()
    params = make_params(dtype=dtype)
    grads = make_grads(params, 4, none_every=3)
    pure_state, inplace_state = tx.init(params), tx.init(clone_tensors(params))
    for row in grads:
        snapshot = [None if x is None else x.clone() for x in _tensors(pure_state)]
        pure_up, new_pure = tx.update(row, pure_state, params)
        assert_tensors_equal(_tensors(pure_state), snapshot, what="pure input state")
        pure_state = new_pure
        in_up, inplace_state = tx.update(clone_tensors(row), inplace_state, params, inplace=True)
        assert_tensors_equal(tree_leaves(in_up), tree_leaves(pure_up), what=name)
        assert_tensors_equal(_tensors(inplace_state), _tensors(pure_state), what=name + " state")
        if name != "multi_steps":  # it emits what earlier micro-steps accumulated
            for u, g in zip(tree_leaves(pure_up), row, strict=True):
                assert (u is None) == (g is None)  # a missing gradient stays missing


def _apply(
    tx: fo.GradientTransformation, updates: list[Tensor], params: list[Tensor] | None = None
) -> list[Tensor]:
    out, _ = tx.update(updates, tx.init(updates if params is None else params), params)
    return list(out)


def test_small_transforms_formulas() -> None:
    u = torch.tensor([[-2.0, 0.5, 3.0], [1.0, -0.1, 0.0]], dtype=torch.float64)
    p = torch.tensor([[1.0, -1.0, 2.0], [0.5, 0.05, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(_apply(fo.clip(1.0), [u])[0], u.clamp(-1.0, 1.0))
    rms = float(u.square().mean().sqrt())
    torch.testing.assert_close(_apply(fo.clip_by_block_rms(0.5), [u])[0], u / (rms / 0.5))
    assert torch.equal(_apply(fo.clip_by_block_rms(100.0), [u])[0], u)
    torch.testing.assert_close(_apply(fo.centralize(), [u])[0], u - u.mean(dim=1, keepdim=True))
    vec = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert torch.equal(_apply(fo.centralize(), [vec])[0], vec)  # 1-d: unchanged
    assert torch.equal(_apply(fo.scale_by_sign(), [u])[0], torch.sign(u))
    assert torch.equal(_apply(fo.set_to_zero(), [u])[0], torch.zeros_like(u))
    kept = _apply(fo.keep_params_nonnegative(), [u], [p])[0]
    assert bool(((p + kept) >= 0).all())
    assert torch.equal(kept, torch.where(p + u < 0, -p, u))
    norm_p, norm_u = p.norm(), u.norm()
    torch.testing.assert_close(
        _apply(fo.scale_by_trust_ratio(trust_coefficient=0.1), [u], [p])[0],
        u * 0.1 * norm_p / norm_u,
    )
    zero = torch.zeros(3, dtype=torch.float64)
    assert torch.equal(_apply(fo.scale_by_trust_ratio(), [zero + 1], [zero])[0], zero + 1)


def test_zero_nans_zeroes_and_flags() -> None:
    tx = fo.zero_nans()
    u = [torch.tensor([1.0, float("nan")]), torch.tensor([2.0])]
    out, state = tx.update(u, tx.init(u))
    assert torch.equal(out[0], torch.tensor([1.0, 0.0]))
    assert torch.equal(out[1], u[1])
    assert [bool(f) for f in state.found_nan] == [True, False]


def test_ema_debiased_and_raw() -> None:
    xs = [
        torch.tensor([1.0, -2.0], dtype=torch.float64),
        torch.tensor([3.0, 0.5], dtype=torch.float64),
    ]
    for debias in (True, False):
        tx = fo.ema(0.8, debias=debias)
        state, avg = tx.init([xs[0]]), torch.zeros(2, dtype=torch.float64)
        for t, x in enumerate(xs, start=1):
            out, state = tx.update([x], state)
            avg = 0.2 * x + 0.8 * avg
            torch.testing.assert_close(out[0], avg / (1 - 0.8**t) if debias else avg)
        torch.testing.assert_close(state.ema[0], avg)


def test_params_are_required_where_optax_requires_them() -> None:
    for tx in (
        fo.scale_by_trust_ratio(),
        fo.keep_params_nonnegative(),
        fo.scale_by_novograd(weight_decay=0.1),
    ):
        with pytest.raises(ValueError, match="needs the params"):
            tx.update([torch.ones(2)], tx.init([torch.ones(2)]))


@pytest.mark.parametrize("call", [lambda: fo.clip(-1.0), lambda: fo.clip_by_block_rms(0.0)])
def test_bad_clip_arguments(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def test_inject_hyperparams_stores_every_numeric_hyperparameter() -> None:
    tx = fo.inject_hyperparams(fo.scale_by_yogi)(0.5)  # b1 by position, the rest defaults
    params = [torch.ones(3, dtype=torch.float64)]
    state = tx.init(params)
    assert set(state.hyperparams) == {"b1", "b2", "eps", "eps_root", "initial_accumulator_value"}
    assert state.hyperparams["b1"] == 0.5
    assert state.hyperparams["eps"] == 1e-3
    g = [torch.full((3,), 2.0, dtype=torch.float64)]
    base, _ = tx.update(g, state)
    state.hyperparams["eps"] = 1.0  # changing any of them changes the next update
    changed, _ = tx.update(g, state)
    reference, _ = fo.scale_by_yogi(0.5, eps=1.0).update(g, fo.scale_by_yogi(0.5).init(params))
    assert not torch.equal(base[0], changed[0])
    assert torch.equal(changed[0], reference[0])


def test_inject_hyperparams_static_args_and_tensor_gradients() -> None:
    with pytest.raises(ValueError, match="static_args"):
        fo.inject_hyperparams(fo.ema, static_args=("nope",))
    tx = fo.inject_hyperparams(fo.masked, static_args="mask")(fo.set_to_zero(), mask=[True, False])
    assert "mask" not in tx.init([torch.ones(1), torch.ones(1)]).hyperparams
    x = [torch.tensor([1.0, 2.0], dtype=torch.float64)]

    def f(decay: Tensor) -> Tensor:
        t = fo.inject_hyperparams(fo.ema)(decay=decay, debias=False)
        out, state = t.update(x, t.init(x))
        out, _ = t.update([x[0] * 3], state)
        return out[0].sum()

    d0 = torch.tensor(0.7, dtype=torch.float64)
    grad = torch.func.grad(f)(d0)
    fd = (f(d0 + 1e-6) - f(d0 - 1e-6)) / 2e-6
    assert float(grad) == pytest.approx(float(fd), rel=1e-6)


def _unrolled(tx: fo.GradientTransformation, scale: Tensor, params: list[Tensor]) -> list[Tensor]:
    """Three pure updates of gradients ``scale * g_k``; returns the summed outputs per leaf."""
    state = tx.init(params)
    total = [torch.zeros_like(p) for p in params]
    for base in _BASE_GRADS:
        updates, state = tx.update([scale * g for g in base], state, params)
        total = [t + u for t, u in zip(total, updates, strict=True)]
    return total


_GEN = torch.Generator().manual_seed(5)
_PARAMS = [
    torch.randn(s, generator=_GEN, dtype=torch.float64) for s in ((), (5,), (3, 4), (2,), (2,))
]
_BASE_GRADS = [
    [torch.randn(p.shape, generator=_GEN, dtype=p.dtype) for p in _PARAMS] for _ in range(3)
]
_SMOOTH = sorted(set(TRANSFORMS) - {"scale_by_sign", "set_to_zero", "freeze", "zero_nans"})
_F64 = [
    torch.randn(s, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for s in ((), (5,), (3, 4))
]


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transform_vmaps_over_a_batch_of_gradient_scales(name: str) -> None:
    tx = TRANSFORMS[name]()
    params = _PARAMS
    scales = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    randomness = "same" if name == "add_noise" else "error"
    swept = torch.func.vmap(lambda s: _unrolled(tx, s, params), randomness=randomness)(scales)
    for i, s in enumerate(scales):
        one = _unrolled(tx, s, params)
        for a, b in zip(swept, one, strict=True):
            torch.testing.assert_close(a[i], b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", _SMOOTH)
def test_transform_is_differentiable(name: str) -> None:
    """d(sum of outputs)/d(gradient scale) by torch.func.grad equals finite differences (sign,
    zeroing and NaN-zeroing transforms are piecewise constant: left out)."""
    tx = TRANSFORMS[name]()
    params = _PARAMS

    def f(s: Tensor) -> Tensor:
        return sum((o * o).sum() for o in _unrolled(tx, s, params))  # type: ignore[return-value]

    s0 = torch.tensor(0.8, dtype=torch.float64)
    g = torch.func.grad(f)(s0)
    fd = (f(s0 + 1e-4) - f(s0 - 1e-4)) / 2e-4  # f is ~100: a smaller step drowns in rounding
    assert float(g) == pytest.approx(float(fd), rel=1e-5, abs=1e-9)


def _noise(tx: fo.GradientTransformation, steps: int = 2) -> list[Tensor]:
    zeros = [torch.zeros(64, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64)]
    state = tx.init(zeros)
    out: list[Tensor] = []
    for _ in range(steps):
        updates, state = tx.update(zeros, state, zeros)
        out.extend(updates)
    return out


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_add_noise_takes_optax_key_as_the_seed() -> None:
    # optax 0.2.8: add_noise(eta, gamma, key=None, *, seed=None)
    params = inspect.signature(fo.add_noise).parameters
    assert list(params) == ["eta", "gamma", "key", "seed"]
    assert params["key"].default is None
    assert params["seed"].default is None
    assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY
    by_seed = _noise(fo.add_noise(0.3, 0.55, seed=5))
    assert _same(_noise(fo.add_noise(0.3, 0.55, key=5)), by_seed)
    assert _same(_noise(fo.add_noise(0.3, 0.55, 5)), by_seed)  # positional, as before
    assert _same(_noise(fo.add_noise(0.3, 0.55, key=torch.tensor(5))), by_seed)
    assert not _same(_noise(fo.add_noise(0.3, 0.55, key=6)), by_seed)
    assert _same(_noise(fo.add_noise(0.3, 0.55)), _noise(fo.add_noise(0.3, 0.55, key=0)))


def test_add_noise_key_can_be_a_generator_it_draws_the_seed_from() -> None:
    seed = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(11)))
    gen = torch.Generator().manual_seed(11)
    first = _noise(fo.add_noise(0.3, 0.55, key=gen))
    assert _same(first, _noise(fo.add_noise(0.3, 0.55, seed=seed)))
    assert _same(first, _noise(fo.add_noise(0.3, 0.55, key=torch.Generator().manual_seed(11))))
    # the generator moved on: a second transform from it draws other noise
    assert not _same(_noise(fo.add_noise(0.3, 0.55, key=gen)), first)
    tx = fo.add_noise(0.3, 0.55, key=torch.Generator().manual_seed(11))
    assert int(tx.init([torch.zeros(1)]).rng_key) == seed


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fo.add_noise(0.1, 0.5, key=1, seed=1), "not both"),
        (lambda: fo.add_noise(0.1, 0.5, 1, seed=2), "not both"),
        (lambda: fo.add_noise(0.1, 0.5, key=1.5), "got float"),  # type: ignore[arg-type]
        (lambda: fo.add_noise(0.1, 0.5, key=True), "got bool"),
        (lambda: fo.add_noise(0.1, 0.5, key="0"), "got str"),  # type: ignore[arg-type]
        (lambda: fo.add_noise(0.1, 0.5, key=torch.tensor([1, 2])), "shape"),
        (lambda: fo.add_noise(0.1, 0.5, seed=torch.tensor(1.0)), "torch.float32 tensor"),
        (lambda: fo.add_noise(0.1, 0.5, key=torch.tensor(True)), "torch.bool tensor"),
    ],
)
def test_add_noise_refuses_a_bad_key(call: Callable[[], object], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        call()
