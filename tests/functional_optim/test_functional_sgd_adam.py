"""FunctionalSGD / Adam / AdamW / Adamax against torch.optim and torch's _FunctionalX.

Tolerances: with ``foreach=True`` / ``fused=True`` (and for Adamax, whose default is the
per-tensor kernel) results are BITWISE equal to torch.optim.X with the same flag. With neither
flag our default picks torch's fused kernel on CPU, a different op order than torch's default
loop: compared with ``tolerance(dtype)`` from ``_parity`` (float32 rtol=1e-6/atol=1e-7 scaled
by the step count, float64 rtol=1e-13/atol=1e-15 likewise).
"""

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import functional_optim as fo
from tests.functional_optim._parity import (
    FLOAT_DTYPES,
    assert_states_equal,
    assert_tensors_equal,
    make_grads,
    make_params,
    run_torch,
    tolerance,
)

with warnings.catch_warnings():
    # torch.distributed.optim warns (jit.interface, TorchScript) on import: our reference only.
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim.functional_adam import _FunctionalAdam
    from torch.distributed.optim.functional_adamax import _FunctionalAdamax
    from torch.distributed.optim.functional_adamw import _FunctionalAdamW
    from torch.distributed.optim.functional_sgd import _FunctionalSGD


# torch's twins warn on construction (ours must not: see test_no_deprecation_warning).
_TWIN_WARNING = "`TorchScript` support for functional optimizers is deprecated"


@dataclass(frozen=True)
class Spec:
    """One optimizer: ours, torch.optim's, torch's functional twin, flags and hyperparams."""

    name: str
    ours: type
    optim: type[torch.optim.Optimizer]
    twin: type
    flags: tuple[str, ...]  # subset of ("foreach", "fused")
    configs: tuple[dict[str, Any], ...]
    default_is_exact: bool  # our default path equals torch's default bitwise


def _grid(**axes: tuple[Any, ...]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, v, strict=True)) for v in itertools.product(*axes.values())]


_SGD = tuple(
    {"lr": 0.05, **c}
    for c in _grid(
        momentum=(0.0, 0.9),
        dampening=(0.0, 0.3),
        nesterov=(False, True),
        weight_decay=(0.0, 0.1),
        maximize=(False, True),
    )
    if not (c["nesterov"] and (c["momentum"] == 0 or c["dampening"] != 0))
    and not (c["momentum"] == 0 and c["dampening"] != 0)
)
_ADAM = tuple(
    {"lr": 0.01, "betas": (0.8, 0.99), **c}
    for c in _grid(amsgrad=(False, True), weight_decay=(0.0, 0.1), maximize=(False, True))
)
_ADAMAX = tuple(
    {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, **c}
    for c in _grid(weight_decay=(0.0, 0.1), maximize=(False, True))
)
SPECS = (
    Spec(
        "sgd", fo.FunctionalSGD, torch.optim.SGD, _FunctionalSGD, ("foreach", "fused"), _SGD, False
    ),
    Spec(
        "adam",
        fo.FunctionalAdam,
        torch.optim.Adam,
        _FunctionalAdam,
        ("foreach", "fused"),
        _ADAM,
        False,
    ),
    Spec(
        "adamw",
        fo.FunctionalAdamW,
        torch.optim.AdamW,
        _FunctionalAdamW,
        ("foreach", "fused"),
        _ADAM,
        False,
    ),
    Spec(
        "adamax",
        fo.FunctionalAdamax,
        torch.optim.Adamax,
        _FunctionalAdamax,
        ("foreach",),
        _ADAMAX,
        True,
    ),
)
STEPS = 6


def _run_ours(
    spec: Spec, params: list[Tensor], grads: list[list[Tensor | None]], **kw: Any
) -> tuple[list[Tensor], list[dict[str, Any]], Any]:
    ps = [p.clone() for p in params]
    opt = spec.ours(ps, **kw)
    for row in grads:
        opt.step([None if g is None else g.clone() for g in row])
    states = [dict(opt.state[p]) if p in opt.state else {} for p in ps]
    return ps, states, opt


def _none_every(spec: Spec, hp: dict[str, Any], flag: str | None, wanted: int) -> int:
    # torch's fused SGD crashes when a param gets its first gradient after the others got
    # momentum buffers (None inside the buffer list); ours handles it (see the kernel tests),
    # but torch cannot be the reference there.
    if spec.name == "sgd" and flag == "fused" and hp.get("momentum", 0.0) != 0:
        return 0
    return wanted


def _compare(
    spec: Spec, hp: dict[str, Any], flag: str | None, dtype: torch.dtype, none_every: int
) -> None:
    none_every = _none_every(spec, hp, flag, none_every)
    params = make_params(dtype=dtype, seed=21)
    grads = make_grads(params, STEPS, seed=22, none_every=none_every)
    torch_flags = {flag: True} if flag else {"foreach": False}
    ref = run_torch(spec.optim, params, grads, **hp, **torch_flags)
    ours, states, _ = _run_ours(spec, params, grads, **hp, **({flag: True} if flag else {}))
    if flag or spec.default_is_exact:
        assert_tensors_equal(ours, ref.params, what=f"{spec.name} {flag} {hp}")
        assert_states_equal(states, ref.states)
    else:
        rtol, atol = tolerance(dtype)
        rtol, atol = rtol * STEPS, atol * STEPS
        assert_tensors_equal(ours, ref.params, rtol, atol, what=f"{spec.name} default {hp}")
        assert_states_equal(states, ref.states, rtol, atol)


@pytest.mark.parametrize(
    ("spec", "hp", "flag"),
    [
        pytest.param(s, hp, flag, id=f"{s.name}-{i}-{flag}")
        for s in SPECS
        for i, hp in enumerate(s.configs)
        for flag in (None, *s.flags)
    ],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_step_matches_torch_optim(
    spec: Spec, hp: dict[str, Any], flag: str | None, dtype: torch.dtype
) -> None:
    _compare(spec, hp, flag, dtype, none_every=3)


@settings(max_examples=15)
@given(
    data=st.data(),
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=4),
    n_steps=st.integers(1, 30),
    none_every=st.integers(0, 3),
)
def test_hypothesis_none_grads_and_shapes(
    data: st.DataObject, shapes: list[tuple[int, ...]], n_steps: int, none_every: int
) -> None:
    spec = data.draw(st.sampled_from(SPECS), label="spec")
    hp = data.draw(st.sampled_from(spec.configs), label="hp")
    flag = data.draw(st.sampled_from(spec.flags), label="flag")
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    params = make_params(shapes, dtype=dtype, seed=n_steps)
    none_every = _none_every(spec, hp, flag, none_every)
    grads = make_grads(params, n_steps, seed=n_steps + 1, none_every=none_every)
    ref = run_torch(spec.optim, params, grads, **hp, **{flag: True})
    ours, states, _ = _run_ours(spec, params, grads, **hp, **{flag: True})
    assert_tensors_equal(ours, ref.params, what=f"{spec.name} {flag}")
    assert_states_equal(states, ref.states)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_none_grad_skips_param_and_creates_no_state(spec: Spec) -> None:
    params = make_params(seed=23)
    opt = spec.ours(params)
    before = [p.clone() for p in params]
    opt.step([None, *[torch.ones_like(p) for p in params[1:]]])
    assert params[0] not in opt.state
    assert_tensors_equal(params[:1], before[:1])
    assert all(p in opt.state for p in params[1:])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_attributes_and_state_keys_match_torch_twin(spec: Spec) -> None:
    params = make_params(seed=24)
    grads = [torch.ones_like(p) for p in params]
    hp = spec.configs[-1]
    with pytest.warns(DeprecationWarning, match=_TWIN_WARNING):
        twin = spec.twin([p.clone() for p in params], **hp)
    ours = spec.ours([p.clone() for p in params], **hp)
    assert ours.defaults == twin.defaults
    for attr in ("amsgrad", "maximize", "foreach", "fused", "nesterov"):
        assert getattr(ours, attr, None) == getattr(twin, attr, None), attr
    assert len(ours.param_group["params"]) == len(twin.param_group["params"])
    twin.step(list(grads))
    ours.step(list(grads))
    twin_states = [twin.state[p] for p in twin.param_group["params"]]
    our_states = [ours.state[p] for p in ours.param_group["params"]]
    assert [list(s) for s in our_states] == [list(s) for s in twin_states]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.name != "adamax"], ids=lambda s: s.name)
@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_step_param_matches_step(spec: Spec, flag: str) -> None:
    """step_param on each param in turn equals one step() (same shared update path)."""
    params = make_params(seed=25)
    grads = make_grads(params, 3, seed=26, none_every=2)
    hp = spec.configs[-1]
    ref, ref_states, _ = _run_ours(spec, params, grads, **hp, **{flag: True})
    ps = [p.clone() for p in params]
    opt = spec.ours(ps, **hp, **{flag: True})
    for row in grads:
        for p, g in zip(ps, row, strict=True):
            if g is not None or spec.name != "sgd":
                opt.step_param(p, None if g is None else g.clone())
    assert_tensors_equal(ps, ref)
    # torch's step_param creates state for a None grad (except SGD, where torch fails).
    states = [dict(opt.state[p]) for p in ps]
    for s, r in zip(states, ref_states, strict=True):
        if r:
            assert_states_equal([s], [r])


def test_step_param_none_grad_creates_state_like_torch() -> None:
    p = torch.randn(3)
    with pytest.warns(DeprecationWarning, match=_TWIN_WARNING):
        twin = _FunctionalAdam([p.clone()], amsgrad=True)
    twin.step_param(twin.param_group["params"][0], None)
    ours = fo.FunctionalAdam([p], amsgrad=True)
    ours.step_param(p, None)
    assert list(ours.state[p]) == list(next(iter(twin.state.values())))
    assert float(ours.state[p]["step"]) == 0.0


_BAD_ARGS = [
    {"lr": -1.0},
    {"eps": -1e-9},
    {"betas": (1.0, 0.5)},
    {"betas": (-0.1, 0.5)},
    {"betas": (0.5, 1.5)},
    {"weight_decay": -0.1},
    {"lr": float("nan")},
]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.name != "sgd"], ids=lambda s: s.name)
@pytest.mark.parametrize("bad", _BAD_ARGS, ids=str)
def test_validation_errors_match_torch(spec: Spec, bad: dict[str, Any]) -> None:
    with (
        pytest.warns(DeprecationWarning, match=_TWIN_WARNING),
        pytest.raises(ValueError) as torch_err,
    ):
        spec.twin([torch.zeros(2)], **bad)
    with pytest.raises(ValueError) as our_err:
        spec.ours([torch.zeros(2)], **bad)
    assert str(our_err.value) == str(torch_err.value)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_empty_list_and_length_errors_match_torch(spec: Spec) -> None:
    with (
        pytest.warns(DeprecationWarning, match=_TWIN_WARNING),
        pytest.raises(ValueError) as torch_err,
    ):
        spec.twin([])
    with pytest.warns(DeprecationWarning, match=_TWIN_WARNING):
        twin = spec.twin([torch.zeros(2)])
    with pytest.raises(ValueError) as torch_len:
        twin.step([None, None])
    with pytest.raises(ValueError) as our_err:
        spec.ours([])
    assert str(our_err.value) == str(torch_err.value)
    ours = spec.ours([torch.zeros(2)])
    with pytest.raises(ValueError) as our_len:
        ours.step([None, None])
    assert str(our_len.value) == str(torch_len.value)
    empty = spec.ours([], _allow_empty_param_list=True)
    empty.step([])
    assert empty.state == {}


def test_fused_rejects_complex_like_torch() -> None:
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params"):
        fo.FunctionalAdam([torch.zeros(2, dtype=torch.complex64)], fused=True)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_no_deprecation_warning(spec: Spec) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = spec.ours([torch.zeros(2)])
        opt.step([torch.ones(2)])


# --- TorchScript ---------------------------------------------------------------------------
# torch.jit.script(cls) compiles a class but hands back the Python class, so instances made from
# Python run eagerly. The drivers below construct and step the optimizers INSIDE TorchScript.

_SCRIPT_HP: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.1, "maximize": True},
    "adam": {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": True},
    "adamw": {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": True},
    "adamax": {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
}


def _drive_sgd(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> None:
    opt = fo.FunctionalSGD(params, 0.05, 0.9, 0.3, 0.1, False, True, foreach, fused)
    for k in range(len(grads) - 1):
        opt.step(grads[k])
    last = grads[len(grads) - 1]
    for i in range(len(params)):
        g = last[i]
        if g is not None:
            opt.step_param(params[i], g)


def _drive_adam(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> None:
    opt = fo.FunctionalAdam(params, 0.01, (0.8, 0.99), 1e-8, 0.1, True, False, foreach, fused)
    for k in range(len(grads) - 1):
        opt.step(grads[k])
    last = grads[len(grads) - 1]
    for i in range(len(params)):
        opt.step_param(params[i], last[i])


def _drive_adamw(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> None:
    opt = fo.FunctionalAdamW(params, 0.01, (0.8, 0.99), 1e-8, 0.1, True, False, foreach, fused)
    for k in range(len(grads) - 1):
        opt.step(grads[k])
    last = grads[len(grads) - 1]
    for i in range(len(params)):
        opt.step_param(params[i], last[i])


def _drive_adamax(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> None:
    opt = fo.FunctionalAdamax(params, 0.02, (0.8, 0.99), 1e-6, 0.1, foreach, False)
    for row in grads:
        opt.step(row)


_DRIVERS = {"sgd": _drive_sgd, "adam": _drive_adam, "adamw": _drive_adamw, "adamax": _drive_adamax}


@pytest.fixture(scope="module")
def scripted_drivers() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        for s in SPECS:
            assert torch.jit.script(s.ours) is s.ours  # compiles (from any caller frame)
        return {name: torch.jit.script(fn) for name, fn in _DRIVERS.items()}


@pytest.mark.parametrize(
    ("spec", "flag"),
    [(s, f) for s in SPECS for f in (None, *s.flags)],
    ids=lambda v: v.name if isinstance(v, Spec) else str(v),
)
def test_scripted_class_matches_torch(
    scripted_drivers: dict[str, Any], spec: Spec, flag: str | None
) -> None:
    params = make_params(seed=27)
    hp = _SCRIPT_HP[spec.name]
    grads = make_grads(params, 4, seed=28, none_every=_none_every(spec, hp, flag, 3))
    ref = run_torch(spec.optim, params, grads, **hp, **({flag: True} if flag else {}))
    ps = [p.clone() for p in params]
    scripted_drivers[spec.name](ps, grads, flag == "foreach", flag == "fused")
    if flag or spec.default_is_exact:
        assert_tensors_equal(ps, ref.params, what=f"scripted {spec.name} {flag}")
    else:
        rtol, atol = tolerance(torch.float32)
        assert_tensors_equal(ps, ref.params, rtol * 4, atol * 4, what=f"scripted {spec.name}")
