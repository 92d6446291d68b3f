"""FunctionalAdagrad/Adadelta/RMSprop/Rprop: torch's ``_FunctionalX`` API, torch.optim numerics.

One table (``SPECS``) drives every test. Construction is compared with torch's
``torch.distributed.optim._FunctionalX`` (signature, defaults, attributes, state, errors and
their messages); results are compared with ``torch.optim.X`` on the same inputs, with some
gradients None:

* ``foreach=True`` (and ``fused=True`` for Adagrad): BITWISE equal to torch.optim with that flag.
* no flag: our fastest path for the device ("auto"), compared with torch.optim's default within
  ``TOL`` (documented below), since on CPU Adagrad then runs torch's fused kernel instead of
  the per-tensor loop; Adadelta, RMSprop and Rprop run the loop and are in fact bitwise equal.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from functional_optim import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalRMSprop,
    FunctionalRprop,
)
from tests.functional_optim._parity import (
    FLOAT_DTYPES,
    SHAPES,
    assert_states_equal,
    assert_tensors_equal,
    clone_tensors,
    make_grads,
    make_params,
    run_torch,
)

with warnings.catch_warnings():  # torch.distributed.optim warns about TorchScript on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim.functional_adadelta import _FunctionalAdadelta
    from torch.distributed.optim.functional_adagrad import _FunctionalAdagrad
    from torch.distributed.optim.functional_rmsprop import _FunctionalRMSprop
    from torch.distributed.optim.functional_rprop import _FunctionalRprop

# Tolerance of the no-flag ("auto") path against torch.optim's default path, per dtype, for up
# to 30 steps: fused Adagrad rounds differently from the loop (a few ulps per step).
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-6),
    torch.float64: (1e-12, 1e-14),
    torch.complex128: (1e-12, 1e-14),
}


@dataclass(frozen=True)
class Spec:
    """One optimizer: our class, torch's functional class, torch.optim class, configs."""

    name: str
    ours: type
    torch_functional: type
    torch_optim: type[torch.optim.Optimizer]
    flags: tuple[str, ...]  # the implementation flags the class takes
    configs: tuple[dict[str, Any], ...]  # keyword arguments valid for all three classes


SPECS: dict[str, Spec] = {
    s.name: s
    for s in [
        Spec(
            "adagrad",
            FunctionalAdagrad,
            _FunctionalAdagrad,
            torch.optim.Adagrad,
            ("foreach", "fused"),
            (
                {},
                {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1},
                {"lr": 0.05, "initial_accumulator_value": 0.5, "eps": 1e-8, "maximize": True},
                {
                    "lr_decay": 0.01,
                    "weight_decay": 0.2,
                    "initial_accumulator_value": 0.1,
                    "maximize": True,
                },
            ),
        ),
        Spec(
            "adadelta",
            FunctionalAdadelta,
            _FunctionalAdadelta,
            torch.optim.Adadelta,
            ("foreach",),
            (
                {},
                {"lr": 0.5, "rho": 0.5, "weight_decay": 0.1},
                {"eps": 1e-4, "maximize": True},
                {"rho": 0.8, "weight_decay": 0.2, "maximize": True},
            ),
        ),
        Spec(
            "rmsprop",
            FunctionalRMSprop,
            _FunctionalRMSprop,
            torch.optim.RMSprop,
            ("foreach",),
            (
                {},
                {"momentum": 0.9, "centered": True},
                {"lr": 0.05, "alpha": 0.9, "weight_decay": 0.1, "maximize": True},
                {"momentum": 0.5, "weight_decay": 0.1, "maximize": True},
                {"centered": True, "eps": 1e-6},
                {"momentum": 0.9, "centered": True, "weight_decay": 0.1, "maximize": True},
            ),
        ),
        Spec(
            "rprop",
            FunctionalRprop,
            _FunctionalRprop,
            torch.optim.Rprop,
            ("foreach",),
            (
                {},
                {"lr": 0.1, "etas": (0.3, 1.5)},
                {"step_sizes": (1e-3, 0.05), "maximize": True},
                {"lr": 0.2, "etas": (0.4, 1.1), "step_sizes": (1e-4, 1.0), "maximize": True},
            ),
        ),
    ]
}

CONFIG_CASES = [(n, i) for n, s in SPECS.items() for i in range(len(s.configs))]
FLAGGED_CASES = [(n, i, f) for n, i in CONFIG_CASES for f in (None, *SPECS[n].flags)]
SCRIPT_CASES: list[tuple[str, str | None]] = [
    (n, f) for n, s in SPECS.items() for f in (None, *s.flags)
]


def _run_ours(
    opt: Any, grads: list[list[Tensor | None]]
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    for row in grads:
        opt.step(clone_tensors(row))
    params = opt.param_group["params"]
    return params, [dict(opt.state[p]) if p in opt.state else {} for p in params]


def _check(
    spec: Spec,
    kwargs: dict[str, Any],
    flag: str | None,
    params: list[Tensor],
    grads: list[list[Tensor | None]],
) -> None:
    flags = {} if flag is None else {flag: True}
    expected = run_torch(spec.torch_optim, params, grads, **kwargs, **flags)
    opt = spec.ours(clone_tensors(params), **kwargs, **flags)
    got, state = _run_ours(opt, grads)
    rtol, atol = (0.0, 0.0) if flag is not None else TOL[params[0].dtype]
    assert_tensors_equal(got, expected.params, rtol, atol, what=f"{spec.name} {flag} params")
    assert_states_equal(state, expected.states, rtol, atol)


# --- numerics --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("name", "config", "flag"), FLAGGED_CASES)
def test_matches_torch_optim(name: str, config: int, flag: str | None, dtype: torch.dtype) -> None:
    spec = SPECS[name]
    params = make_params(SHAPES, dtype=dtype, seed=config)
    grads = make_grads(params, steps=6 + config, seed=config + 1, none_every=3)
    _check(spec, spec.configs[config], flag, params, grads)


@settings(max_examples=30)
@given(
    case=st.sampled_from(FLAGGED_CASES),
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=4),
    dtype=st.sampled_from(FLOAT_DTYPES),
    steps=st.integers(1, 30),
    none_every=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_steps_and_missing_grads(
    case: tuple[str, int, str | None],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    steps: int,
    none_every: int,
    seed: int,
) -> None:
    name, config, flag = case
    spec = SPECS[name]
    params = make_params(shapes, dtype=dtype, seed=seed)
    grads = make_grads(params, steps, seed=seed + 1, none_every=none_every)
    _check(spec, spec.configs[config], flag, params, grads)


@pytest.mark.parametrize(("name", "config"), CONFIG_CASES)
def test_complex_params_match_torch_optim(name: str, config: int) -> None:
    """Complex params: torch.optim's numerics, including its ``complex(v, v)`` initial fills."""
    spec = SPECS[name]
    params = make_params(((3,), (2, 2), ()), dtype=torch.complex128, seed=config)
    grads = make_grads(params, steps=5, seed=9, none_every=3)
    for flag in (None, "foreach"):
        _check(spec, spec.configs[config], flag, params, grads)


def test_adagrad_skips_params_without_grad() -> None:
    """torch's _FunctionalAdagrad pairs grads with the wrong params when one is None; we don't."""
    params = make_params(((3,), (2,)), dtype=torch.float64)
    grads: list[list[Tensor | None]] = [[None, torch.ones(2, dtype=torch.float64)]]
    _check(SPECS["adagrad"], {"lr": 0.1}, "foreach", params, grads)


# --- construction: torch's signature, attributes, state and errors ---------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_signature_matches_torch(name: str) -> None:
    spec = SPECS[name]

    def shape(cls: type) -> list[tuple[str, Any, Any]]:
        sig = inspect.signature(cls.__init__)  # type: ignore[misc]
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

    assert shape(spec.ours) == shape(spec.torch_functional)


@pytest.mark.parametrize(("name", "config"), CONFIG_CASES)
def test_attributes_and_state_match_torch_functional(name: str, config: int) -> None:
    spec = SPECS[name]
    kwargs = spec.configs[config]
    params = make_params(((3,), (2, 2)), dtype=torch.float32)
    twins = [p.clone() for p in params]
    ours = spec.ours(params, **kwargs)
    theirs = _torch_functional(spec, twins, **kwargs)
    assert ours.defaults == theirs.defaults
    assert ours.param_group.keys() == theirs.param_group.keys()
    assert all(a is b for a, b in zip(ours.param_group["params"], params, strict=True))
    for attr in ("foreach", "fused", "maximize", "coalesce_grad", "centered", "etas", "step_sizes"):
        assert hasattr(ours, attr) == hasattr(theirs, attr), attr
        if hasattr(theirs, attr):
            assert getattr(ours, attr) == getattr(theirs, attr), attr

    def states(opt: Any, keys: list[Tensor]) -> list[dict[str, Tensor]]:
        assert len(opt.state) == sum(1 for p in keys if p in opt.state)
        return [dict(opt.state[p]) if p in opt.state else {} for p in keys]

    # Eager state (Adagrad) or none yet (the others), with torch's keys and values.
    assert_states_equal(states(ours, params), states(theirs, twins))
    ours.step([torch.full_like(p, 0.5) for p in params])
    theirs.step([torch.full_like(p, 0.5) for p in twins])
    rtol, atol = TOL[torch.float32]
    assert_states_equal(states(ours, params), states(theirs, twins), rtol, atol)


def _torch_functional(spec: Spec, *args: Any, **kwargs: Any) -> Any:
    """Construct torch's functional class; it always emits a deprecation warning."""
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        return spec.torch_functional(*args, **kwargs)


@pytest.mark.parametrize("name", list(SPECS))
def test_no_deprecation_warning(name: str) -> None:
    spec = SPECS[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = spec.ours([torch.zeros(2)])
        opt.step([torch.ones(2)])
    assert caught == []


@pytest.mark.parametrize("name", list(SPECS))
def test_empty_param_list_errors_like_torch(name: str) -> None:
    spec = SPECS[name]
    with pytest.raises(ValueError) as theirs:
        _torch_functional(spec, [])
    with pytest.raises(ValueError) as ours:
        spec.ours([])
    assert str(ours.value) == str(theirs.value)
    opt = spec.ours([], _allow_empty_param_list=True)
    opt.step([])
    assert opt.state == {}


@pytest.mark.parametrize("name", list(SPECS))
def test_gradient_count_mismatch_errors_like_torch(name: str) -> None:
    spec = SPECS[name]
    params = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(ValueError) as theirs:
        _torch_functional(spec, params).step([torch.ones(2)])
    opt = spec.ours([p.clone() for p in params])
    with pytest.raises(ValueError) as ours:
        opt.step([torch.ones(2)])
    assert str(ours.value) == str(theirs.value)
    assert all(float(s["step"]) == 0.0 for s in opt.state.values())


# --- TorchScript -----------------------------------------------------------------------------
# Scripted the way torch's DistributedOptimizer uses these classes: from scripted code, which
# compiles the class (and its helpers) recursively. Each function runs several steps in
# TorchScript and returns the state.


def _script_adagrad(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> Dict[Tensor, Dict[str, Tensor]]:
    opt = FunctionalAdagrad(params, 0.1, 0.01, 0.1, 0.5, foreach=foreach, fused=fused)
    for row in grads:
        opt.step(row)
    return opt.state


def _script_adadelta(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> Dict[Tensor, Dict[str, Tensor]]:
    opt = FunctionalAdadelta(params, 0.5, 0.8, 1e-6, 0.1, foreach=foreach, maximize=True)
    for row in grads:
        opt.step(row)
    return opt.state


def _script_rmsprop(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> Dict[Tensor, Dict[str, Tensor]]:
    opt = FunctionalRMSprop(params, 0.01, 0.9, 1e-8, 0.1, 0.9, True, foreach=foreach)
    for row in grads:
        opt.step(row)
    return opt.state


def _script_rprop(
    params: List[Tensor], grads: List[List[Optional[Tensor]]], foreach: bool, fused: bool
) -> Dict[Tensor, Dict[str, Tensor]]:
    opt = FunctionalRprop(params, 0.05, (0.4, 1.3), (1e-4, 1.0), foreach=foreach)
    for row in grads:
        opt.step(row)
    return opt.state


SCRIPT_RUNS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "adagrad": (
        _script_adagrad,
        {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.5},
    ),
    "adadelta": (_script_adadelta, {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1, "maximize": True}),
    "rmsprop": (
        _script_rmsprop,
        {"lr": 0.01, "alpha": 0.9, "weight_decay": 0.1, "momentum": 0.9, "centered": True},
    ),
    "rprop": (_script_rprop, {"lr": 0.05, "etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0)}),
}


@pytest.fixture(scope="module")
def scripted() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        return {name: torch.jit.script(fn) for name, (fn, _) in SCRIPT_RUNS.items()}


@pytest.mark.parametrize(("name", "flag"), SCRIPT_CASES)
def test_scripted_class_matches_torch_optim(
    name: str, flag: str | None, scripted: dict[str, Any]
) -> None:
    spec = SPECS[name]
    kwargs = SCRIPT_RUNS[name][1]
    params = make_params(SHAPES, dtype=torch.float32, seed=4)
    grads = make_grads(params, steps=5, seed=5, none_every=3)
    flags = {} if flag is None else {flag: True}
    expected = run_torch(spec.torch_optim, params, grads, **kwargs, **flags)
    ours = clone_tensors(params)
    state = scripted[name](ours, grads, flag == "foreach", flag == "fused")
    rtol, atol = (0.0, 0.0) if flag is not None else TOL[torch.float32]
    assert_tensors_equal(ours, expected.params, rtol, atol)
    got = [dict(state[p]) if p in state else {} for p in ours]
    assert_states_equal(got, expected.states, rtol, atol)


@pytest.mark.parametrize("name", list(SPECS))
def test_class_scripts_directly(name: str) -> None:
    """``torch.jit.script(cls)`` works from any caller (names resolve in the class's module)."""
    cls: Any = SPECS[name].ours  # Any: torch's stubs make script(<type>) look like NoReturn
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        again = torch.jit.script(cls)
    assert again is cls
    assert torch.jit._state._get_script_class(cls) is not None  # type: ignore[no-untyped-call]
