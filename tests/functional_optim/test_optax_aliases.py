"""optax's optimizers against float64 NumPy re-statements of optax's formulas.

Each reference below restates optax's documented update (``optax/_src/alias.py`` and
``transform.py``, ``optax/contrib/_schedule_free.py``) independently, step by step, on NumPy
arrays; the alias runs the same gradients through its pure ``update`` and through
``fo.Optimizer`` (the in-place path), which must agree bitwise with each other and with the
reference to float64 rounding. A few cross-checks run torch.optim where the algorithms coincide.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import functional_optim as fo

from ._parity import assert_tensors_equal

SHAPES = [(), (7,), (4, 5), (2, 3, 4)]
STEPS = 4
RTOL, ATOL = 1e-11, 1e-13
#: fused in-place step vs the pure path (float64 data; see the test below)
FUSED_RTOL, FUSED_ATOL = 1e-12, 1e-15

Arrays = list[np.ndarray]


def _data(seed: int = 0) -> tuple[Arrays, list[Arrays]]:
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def _norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.sum(x * x)))


def _ratio(
    p: np.ndarray, u: np.ndarray, coeff: float = 1.0, eps: float = 0.0, min_norm: float = 0.0
) -> float:
    pn, un = max(_norm(p), min_norm), max(_norm(u), min_norm)
    if pn == 0.0 or un == 0.0:
        return 1.0
    return coeff * pn / (un + eps)


def _reference(
    step: Callable[[int, np.ndarray, np.ndarray, dict[str, Any]], np.ndarray],
) -> Callable[[Arrays, list[Arrays]], Arrays]:
    """Run ``step(t, p, g, state) -> new p`` per leaf for every step (t = 1, 2, ...)."""

    def run(params: Arrays, grads: list[Arrays]) -> Arrays:
        ps = [p.copy() for p in params]
        states: list[dict[str, Any]] = [{} for _ in ps]
        for t, row in enumerate(grads, start=1):
            ps = [step(t, p, g, s) for p, g, s in zip(ps, row, states, strict=True)]
        return ps

    return run


def _moments(
    s: dict[str, Any], g: np.ndarray, b1: float, b2: float, init: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    s["m"] = (1 - b1) * g + b1 * s.get("m", np.full_like(g, init))
    s["v"] = (1 - b2) * g * g + b2 * s.get("v", np.full_like(g, init))
    return s["m"], s["v"]


LR = 0.05


@_reference
def ref_lion(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, wd = 0.9, 0.99, 0.01
    m = s.get("m", np.zeros_like(g))
    c = (1 - b1) * g + b1 * m
    s["m"] = (1 - b2) * g + b2 * m
    return p - LR * (np.sign(c) + wd * p)


@_reference
def ref_lamb(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, eps, wd = 0.9, 0.999, 1e-6, 0.01
    m, v = _moments(s, g, b1, b2)
    a = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * p
    return p - LR * _ratio(p, a) * a


@_reference
def ref_lars(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    wd, coeff, mom = 0.01, 0.5, 0.9
    a = g + wd * p
    u = -LR * _ratio(p, a, coeff) * a
    s["buf"] = u + mom * s.get("buf", np.zeros_like(g))
    return p + s["buf"]


@_reference
def ref_nadamw(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01
    m, v = _moments(s, g, b1, b2)
    m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
    return p - LR * (m_hat / (np.sqrt(v / (1 - b2**t)) + eps) + wd * p)


@_reference
def ref_amsgrad(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, eps = 0.9, 0.999, 1e-8
    m, v = _moments(s, g, b1, b2)
    s["vmax"] = np.maximum(s.get("vmax", np.zeros_like(g)), v / (1 - b2**t))
    return p - LR * (m / (1 - b1**t)) / (np.sqrt(s["vmax"]) + eps)


def _belief(nesterov: bool) -> Callable[[Arrays, list[Arrays]], Arrays]:
    @_reference
    def ref(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
        b1, b2, eps, eps_root = 0.9, 0.999, 1e-16, 1e-16
        s["m"] = m = (1 - b1) * g + b1 * s.get("m", np.zeros_like(g))
        s["s"] = v = (1 - b2) * (g - m) ** 2 + b2 * s.get("s", np.zeros_like(g)) + eps_root
        if nesterov:
            m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        else:
            m_hat = m / (1 - b1**t)
        return p - LR * m_hat / (np.sqrt(v / (1 - b2**t)) + eps)

    return ref


@_reference
def ref_yogi(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, eps = 0.9, 0.999, 1e-3
    s["m"] = m = (1 - b1) * g + b1 * s.get("m", np.full_like(g, 1e-6))
    v = s.get("v", np.full_like(g, 1e-6))
    s["v"] = v = v - (1 - b2) * np.sign(v - g * g) * g * g
    return p - LR * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)


@_reference
def ref_novograd(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, eps, wd = 0.9, 0.25, 1e-6, 0.01
    sq = _norm(g) ** 2
    s["nu"] = nu = sq if t == 1 else (1 - b2) * sq + b2 * s["nu"]
    add = g / (np.sqrt(nu) + eps) + wd * p
    s["m"] = m = add if t == 1 else b1 * s["m"] + add
    return p - LR * m


@_reference
def ref_adan(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, b2, b3, eps, eps_root, wd = 0.98, 0.92, 0.99, 1e-8, 1e-8, 0.01
    d = np.zeros_like(g) if t == 1 else g - s["prev"]
    s["prev"] = g
    s["m"] = m = (1 - b1) * g + b1 * s.get("m", np.zeros_like(g))
    s["v"] = v = (1 - b2) * d + b2 * s.get("v", np.zeros_like(g))
    s["n"] = n = (1 - b3) * (g + (1 - b2) * d) ** 2 + b3 * s.get("n", np.zeros_like(g))
    num = m / (1 - b1**t) + (1 - b2) * v / (1 - b2**t)
    return p - LR * (num / (np.sqrt(n / (1 - b3**t) + eps_root) + eps) + wd * p)


@_reference
def ref_sm3(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b1, eps = 0.9, 1e-8
    x = g.reshape(1) if g.ndim == 0 else g
    accs = s.get("acc", [np.zeros(n) for n in x.shape])
    if x.ndim < 2:
        acc = x * x + accs[0]
        s["acc"] = [acc]
    else:
        low = np.full(x.shape, np.inf)
        for i, a in enumerate(accs):
            shape = [1] * x.ndim
            shape[i] = x.shape[i]
            low = np.minimum(low, a.reshape(shape))
        acc = x * x + low
        s["acc"] = [acc.max(axis=tuple(d for d in range(x.ndim) if d != i)) for i in range(x.ndim)]
    scaled = np.where(acc > 0, x / np.sqrt(acc + eps), 0.0).reshape(g.shape)
    s["nu"] = nu = (1 - b1) * scaled + b1 * s.get("nu", np.zeros_like(g))
    return p - LR * nu


@_reference
def ref_fromage(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    mult = 1 / np.sqrt(1 + LR**2)
    return p - LR * mult * _ratio(p, g, min_norm=1e-6) * g + (mult - 1) * p


@_reference
def ref_sign_sgd(t: int, p: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    return p - LR * np.sign(g)


def _schedule_free(
    base: Callable[[int, np.ndarray, np.ndarray, dict[str, Any]], np.ndarray],
) -> Callable[[Arrays, list[Arrays]], Arrays]:
    """optax-contrib's schedule_free with a constant learning rate LR and b1 = 0.9."""
    b1 = 0.9

    @_reference
    def ref(t: int, y: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
        z = s.get("z", y.copy())
        weight = LR**2  # max_lr ** weight_lr_power, constant lr
        s["wsum"] = wsum = s.get("wsum", 0.0) + weight
        ck = weight / wsum
        z_new = z + base(t, y, g, s)
        x_prev = (y - (1 - b1) * z) / b1
        x = (1 - ck) * x_prev + ck * z_new
        s["z"] = z_new
        return b1 * x + (1 - b1) * z_new

    return ref


def _sgd_base(t: int, y: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    return -LR * g


def _adamw_base(t: int, y: np.ndarray, g: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    b2, eps, wd = 0.999, 1e-8, 0.01
    s["v"] = v = (1 - b2) * g * g + b2 * s.get("v", np.zeros_like(g))
    return -LR * (g / (np.sqrt(v / (1 - b2**t)) + eps) + wd * y)


CASES: dict[
    str, tuple[Callable[[], fo.GradientTransformation], Callable[[Arrays, list[Arrays]], Arrays]]
] = {
    "lion": (lambda: fo.lion(LR, weight_decay=0.01), ref_lion),
    "lamb": (lambda: fo.lamb(LR, weight_decay=0.01), ref_lamb),
    "lars": (lambda: fo.lars(LR, weight_decay=0.01, trust_coefficient=0.5), ref_lars),
    "nadamw": (lambda: fo.nadamw(LR, weight_decay=0.01), ref_nadamw),
    "amsgrad": (lambda: fo.amsgrad(LR), ref_amsgrad),
    "adabelief": (lambda: fo.adabelief(LR), _belief(False)),
    "adabelief_nesterov": (lambda: fo.adabelief(LR, nesterov=True), _belief(True)),
    "yogi": (lambda: fo.yogi(LR), ref_yogi),
    "novograd": (lambda: fo.novograd(LR, weight_decay=0.01), ref_novograd),
    "adan": (lambda: fo.adan(LR, weight_decay=0.01), ref_adan),
    "sm3": (lambda: fo.sm3(LR), ref_sm3),
    "fromage": (lambda: fo.fromage(LR), ref_fromage),
    "sign_sgd": (lambda: fo.sign_sgd(LR), ref_sign_sgd),
    "noisy_sgd_eta0": (
        lambda: fo.noisy_sgd(LR, eta=0.0),
        _reference(lambda t, p, g, s: p - LR * g),
    ),
    "schedule_free_sgd": (lambda: fo.schedule_free_sgd(LR), _schedule_free(_sgd_base)),
    "schedule_free_adamw": (
        lambda: fo.schedule_free_adamw(LR, weight_decay=0.01),
        _schedule_free(_adamw_base),
    ),
}


def _pure(
    tx: fo.GradientTransformation,
    params: list[Tensor],
    grads: list[list[Tensor]],
    inplace: bool = False,
) -> list[Tensor]:
    """``tx.update`` + ``apply_updates`` (on copies of the grads when ``inplace``)."""
    state = tx.init(params)
    for row in grads:
        row = [g.clone() for g in row] if inplace else row
        updates, state = tx.update(row, state, params, inplace=inplace)
        params = fo.apply_updates(params, updates)
    return params


def _in_place(
    tx: fo.GradientTransformation, params: list[Tensor], grads: list[list[Tensor]]
) -> list[Tensor]:
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = fo.Optimizer(leaves, tx)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g.clone()
        opt.step()
    return [leaf.detach() for leaf in leaves]


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_optax_formula_pure_and_in_place(name: str) -> None:
    factory, reference = CASES[name]
    np_params, np_grads = _data()
    params = [torch.from_numpy(p) for p in np_params]
    grads = [[torch.from_numpy(g) for g in row] for row in np_grads]
    pure = _pure(factory(), params, grads)
    expected = [torch.from_numpy(np.asarray(p)) for p in reference(np_params, np_grads)]
    assert_tensors_equal(pure, expected, rtol=RTOL, atol=ATOL, what=name)
    inplace_update = _pure(factory(), params, grads, inplace=True)
    assert_tensors_equal(inplace_update, pure, what=name + " update(inplace=True)")
    # fo.Optimizer runs the alias's fused step, whose tail applies lr in one op
    # (p.add_(u, alpha=-lr) / addcdiv_ with value=-lr) where the pure path rounds lr * u first:
    # about one ulp apart, so a tight tolerance rather than bitwise (the data are float64).
    in_place = _in_place(factory(), params, grads)
    assert_tensors_equal(in_place, pure, rtol=FUSED_RTOL, atol=FUSED_ATOL, what=name + " step")
    assert not torch.equal(pure[2], params[2])


def test_amsgrad_equals_torch_adam_amsgrad_for_constant_gradients_only() -> None:
    """optax keeps max(v_hat); torch keeps max(v) and divides by the current correction. They
    coincide while v_hat does not change (a constant gradient) and differ otherwise."""
    p0 = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    const = [p0.clone() * 0 + 0.3 for _ in range(5)]
    varying = [torch.full((6,), 2.0 / (i + 1), dtype=torch.float64) for i in range(5)]
    for grads, equal in ((const, True), (varying, False)):
        ours = _pure(fo.amsgrad(0.1), [p0], [[g] for g in grads])[0]
        leaf = p0.clone().requires_grad_(True)
        opt = torch.optim.Adam([leaf], lr=0.1, amsgrad=True, foreach=False)
        for g in grads:
            leaf.grad = g.clone()
            opt.step()
        close = torch.allclose(ours, leaf.detach(), rtol=1e-12, atol=1e-14)
        assert close is equal


def test_optax_adam_chain_matches_torch_adamw() -> None:
    """optax's adamw (scale_by_adam, add_decayed_weights, -lr) is torch's AdamW (eps outside the
    root, decoupled decay) up to the op order."""
    np_params, np_grads = _data(1)
    params = [torch.from_numpy(p) for p in np_params]
    grads = [[torch.from_numpy(g) for g in row] for row in np_grads]
    tx = fo.chain(
        fo.scale_by_optax_adam(), fo.add_decayed_weights(0.1), fo.scale_by_learning_rate(0.01)
    )
    ours = _pure(tx, params, grads)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(leaves, lr=0.01, weight_decay=0.1, foreach=False)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g.clone()
        opt.step()
    assert_tensors_equal(ours, [x.detach() for x in leaves], rtol=1e-12, atol=1e-14)


def test_lars_without_trust_ratio_is_torch_sgd_momentum() -> None:
    np_params, np_grads = _data(2)
    params = [torch.from_numpy(p) for p in np_params]
    grads = [[torch.from_numpy(g) for g in row] for row in np_grads]
    ours = _pure(fo.lars(0.05, weight_decay=0.01, trust_ratio_mask=False), params, grads)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.SGD(leaves, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g.clone()
        opt.step()
    assert_tensors_equal(ours, [x.detach() for x in leaves], rtol=1e-12, atol=1e-14)


def test_noisy_sgd_noise_has_optax_variance_and_replays_from_the_seed() -> None:
    zeros = [torch.zeros(20000, dtype=torch.float64)]
    tx = fo.noisy_sgd(1.0, eta=0.5, gamma=0.55, seed=7)
    state = tx.init(zeros)
    for t in (1, 2, 3):
        updates, state = tx.update(zeros, state, zeros)
        var = float(updates[0].var())
        assert var == pytest.approx(0.5 / t**0.55, rel=0.05)
        assert abs(float(updates[0].mean())) < 0.02
    again = fo.noisy_sgd(1.0, eta=0.5, gamma=0.55, seed=7)
    first, _ = again.update(zeros, again.init(zeros), zeros)
    second, _ = tx.update(zeros, tx.init(zeros), zeros)
    assert torch.equal(first[0], second[0])
    other_tx = fo.noisy_sgd(1.0, eta=0.5, seed=8)
    other, _ = other_tx.update(zeros, other_tx.init(zeros), zeros)
    assert not torch.equal(other[0], first[0])


def test_noisy_sgd_takes_optax_key() -> None:
    # optax 0.2.8: noisy_sgd(learning_rate, eta=0.01, gamma=0.55, key=None, *, seed=None)
    params = inspect.signature(fo.noisy_sgd).parameters
    assert list(params) == ["learning_rate", "eta", "gamma", "key", "seed"]
    assert (params["eta"].default, params["gamma"].default) == (0.01, 0.55)
    assert params["key"].default is None
    assert params["seed"].default is None
    assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY
    zeros = [torch.zeros(256, dtype=torch.float64)]

    def first_update(tx: fo.GradientTransformation) -> Tensor:
        updates, _ = tx.update(zeros, tx.init(zeros), zeros)
        return updates[0]

    by_seed = first_update(fo.noisy_sgd(0.5, seed=7))
    assert torch.equal(first_update(fo.noisy_sgd(0.5, key=7)), by_seed)
    assert torch.equal(first_update(fo.noisy_sgd(0.5, 0.01, 0.55, 7)), by_seed)
    assert torch.equal(first_update(fo.noisy_sgd(0.5)), first_update(fo.noisy_sgd(0.5, key=0)))
    drawn = int(torch.randint(0, 2**62, (), generator=torch.Generator().manual_seed(3)))
    gen = torch.Generator().manual_seed(3)
    assert torch.equal(
        first_update(fo.noisy_sgd(0.5, key=gen)), first_update(fo.noisy_sgd(0.5, seed=drawn))
    )
    with pytest.raises(TypeError, match="not both"):
        fo.noisy_sgd(0.5, key=1, seed=1)


def test_schedule_free_eval_params_recovers_x() -> None:
    params = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}
    tx = fo.schedule_free_sgd(0.1, b1=0.9)
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update({"w": 2 * params["w"]}, state, params)
        params = fo.apply_updates(params, updates)
    x = fo.schedule_free_eval_params(state, params)
    z = state.inner_state.z["w"]
    torch.testing.assert_close(0.9 * x["w"] + 0.1 * z, params["w"], rtol=1e-14, atol=1e-15)
    with pytest.raises(ValueError, match="schedule_free"):
        fo.schedule_free_eval_params(fo.adam().init(params), params)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fo.lion(-1.0), "learning_rate"),
        (lambda: fo.lion(0.1, b1=1.0), "b1"),
        (lambda: fo.lamb(0.1, eps=-1.0), "eps"),
        (lambda: fo.adan(0.1, b3=1.5), "b3"),
        (lambda: fo.lars(0.1, momentum=-0.1), "momentum"),
        (lambda: fo.sm3(0.1, momentum=2.0), "momentum"),
        (lambda: fo.noisy_sgd(0.1, eta=-1.0), "eta"),
        (lambda: fo.fromage(lambda c: 0.1), "schedule"),
        (lambda: fo.schedule_free_sgd(0.1, b1=0.0), "b1"),
        (lambda: fo.schedule_free_adamw(0.1, warmup_steps=-1), "warmup_steps"),
        (lambda: fo.nadamw(0.1, weight_decay=-1e-4), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise_at_construction(call: Callable[[], Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_optimizer_exposes_optax_hyperparameters() -> None:
    """optax's ``learning_rate`` is the param group's ``lr`` (torch's key, which schedulers
    drive); the other hyperparameters keep their names."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = fo.Optimizer([w], fo.lion(0.1, weight_decay=0.0))
    group = opt.param_groups[0]
    assert group["lr"] == 0.1
    assert "learning_rate" not in group
    assert group["b1"] == 0.9
    w.grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    group["lr"] = 0.5
    w.grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((3,), 1 - 0.1 - 0.5, dtype=torch.float64))


def test_lr_scheduler_drives_an_optax_alias() -> None:
    """StepLR on fo.lion halves the step each time (sign updates: the step is the lr)."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = fo.Optimizer([w], fo.lion(0.4, weight_decay=0.0))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        w.grad = torch.ones(2, dtype=torch.float64)
        opt.step()
        sched.step()
    torch.testing.assert_close(
        w.detach(), torch.full((2,), -(0.4 + 0.2 + 0.1), dtype=torch.float64)
    )


def _state_tensors(state: object) -> list[Tensor]:
    from functional_optim._tree import tree_leaves

    return [x.clone() for x in tree_leaves(state) if isinstance(x, Tensor)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_before_the_state_changes(name: str) -> None:
    factory, _ = CASES[name]
    tx = factory()
    params = {"w": torch.ones(3, dtype=torch.float64), "b": torch.ones((), dtype=torch.float64)}
    state = tx.init(params)
    grads = {"w": torch.ones(3, dtype=torch.float64), "b": torch.ones((), dtype=torch.float64)}
    _, state = tx.update(grads, state, params, inplace=True)  # buffers exist, counts are 1
    before = _state_tensors(state)
    with pytest.raises(ValueError, match="structure"):
        tx.update({"w": grads["w"]}, state, params, inplace=True)
    with pytest.raises(ValueError, match="structure"):
        tx.update(grads, state, [params["w"], params["b"]], inplace=True)
    after = _state_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(
    "name", ["lamb", "lars", "nadamw", "adan", "fromage", "schedule_free_adamw"]
)
def test_missing_params_raise_before_the_state_changes(name: str) -> None:
    tx = CASES[name][0]()
    params = [torch.ones(3, dtype=torch.float64)]
    _, state = tx.update(params, tx.init(params), params, inplace=True)
    before = _state_tensors(state)
    with pytest.raises(ValueError, match="params"):
        tx.update([torch.ones(3, dtype=torch.float64)], state, inplace=True)
    assert all(torch.equal(a, b) for a, b in zip(_state_tensors(state), before, strict=True))


@pytest.mark.parametrize("name", ["lion", "nadamw", "amsgrad"])
def test_mu_dtype_stores_the_first_moment_in_that_dtype(name: str) -> None:
    """optax's ``mu_dtype``: the moment is stored in it, the step uses the moment before the
    cast (so the first step equals the float32 run)."""
    factory = getattr(fo, name)
    params = [torch.ones(4)]
    grads = [torch.linspace(-1, 1, 4)]
    low = factory(0.1, mu_dtype=torch.bfloat16)
    state = low.init(params)
    moments = [x for x in _state_tensors(state) if x.dtype == torch.bfloat16]
    assert len(moments) == 1
    first_low, state = low.update(grads, state, params)
    full = factory(0.1)
    first_full, _ = full.update(grads, full.init(params), params)
    assert torch.equal(first_low[0], first_full[0])
    in_place = low.init(params)
    _, in_place = low.update(grads, in_place, params, inplace=True)
    assert_tensors_equal(_state_tensors(in_place), _state_tensors(state))
