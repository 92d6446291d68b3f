"""Kernels adagrad, adadelta, rmsprop, rprop: bitwise parity with torch.optim, per path.

One table (``ALGOS``) drives every test: for each algorithm, every flag combination torch
supports is run for several steps on params of several shapes (0-d and empty included) in
float32 and float64, and each kernel path must equal ``torch.optim.X`` with the matching flag
(``single`` <-> ``foreach=False``, ``foreach`` <-> ``foreach=True``, ``fused`` <-> ``fused=True``)
BITWISE, params and state alike. Every exported function must compile with ``torch.jit.script``
and the scripted functions give the same bits as the eager ones.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.optim.adagrad import adagrad as torch_adagrad

from functional_optim import kernels
from tests.functional_optim._parity import (
    FLOAT_DTYPES,
    SHAPES,
    assert_states_equal,
    assert_tensors_equal,
    make_grads,
    make_params,
    run_torch,
)

State = dict[str, list[Tensor]]


def _full(p: Tensor, value: float) -> Tensor:
    """torch's fill for a new buffer: ``complex(value, value)`` for complex params."""
    if torch.is_complex(p):
        return torch.full_like(p, complex(value, value))
    return torch.full_like(p, value)


def _steps(params: list[Tensor]) -> list[Tensor]:
    return [torch.zeros((), dtype=torch.float32) for _ in params]


# --- per-algorithm state set-up and kernel call (torch's state keys) -----------------------------


def _caller(
    state_keys: tuple[str, ...], hyper_keys: tuple[str, ...], optional: tuple[str, ...] = ()
) -> Callable[..., None]:
    """A call ``fn(p, g, *state lists, *hyperparameters, *impl)`` in the given key order.

    ``optional`` state keys may be missing from the state (an empty list is passed, as torch's
    layout for e.g. RMSprop's ``grad_avg`` without ``centered``).
    """

    def call(
        fn: Callable[..., None],
        p: list[Tensor],
        g: list[Tensor],
        s: State,
        h: dict[str, Any],
        *impl: str,
    ) -> None:
        lists = [s.get(k, []) if k in optional else s[k] for k in state_keys]
        fn(p, g, *lists, *[h[k] for k in hyper_keys], *impl)

    return call


_adagrad_call = _caller(("sum", "step"), ("lr", "weight_decay", "lr_decay", "eps", "maximize"))
_adadelta_call = _caller(
    ("square_avg", "acc_delta", "step"), ("lr", "rho", "eps", "weight_decay", "maximize")
)
_rmsprop_call = _caller(
    ("square_avg", "grad_avg", "momentum_buffer", "step"),
    ("lr", "alpha", "eps", "weight_decay", "momentum", "centered", "maximize"),
    optional=("grad_avg", "momentum_buffer"),
)


def _adagrad_init(params: list[Tensor], h: dict[str, Any]) -> State:
    return {
        "step": _steps(params),
        "sum": [_full(p, h["initial_accumulator_value"]) for p in params],
    }


def _adadelta_init(params: list[Tensor], h: dict[str, Any]) -> State:
    return {
        "step": _steps(params),
        "square_avg": [torch.zeros_like(p) for p in params],
        "acc_delta": [torch.zeros_like(p) for p in params],
    }


def _rmsprop_init(params: list[Tensor], h: dict[str, Any]) -> State:
    state: State = {"step": _steps(params), "square_avg": [torch.zeros_like(p) for p in params]}
    if h["momentum"] > 0:
        state["momentum_buffer"] = [torch.zeros_like(p) for p in params]
    if h["centered"]:
        state["grad_avg"] = [torch.zeros_like(p) for p in params]
    return state


def _rprop_init(params: list[Tensor], h: dict[str, Any]) -> State:
    return {
        "step": _steps(params),
        "prev": [torch.zeros_like(p) for p in params],
        "step_size": [_full(p, h["lr"]) for p in params],
    }


def _rprop_call(
    fn: Callable[..., None],
    p: list[Tensor],
    g: list[Tensor],
    s: State,
    h: dict[str, Any],
    *impl: str,
) -> None:
    (etaminus, etaplus), (smin, smax) = h["etas"], h["step_sizes"]
    fn(
        p,
        g,
        s["prev"],
        s["step_size"],
        s["step"],
        smin,
        smax,
        etaminus,
        etaplus,
        h["maximize"],
        *impl,
    )


def _grid(**axes: list[Any]) -> list[dict[str, Any]]:
    """Every combination of the given hyperparameter values."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


@dataclass(frozen=True)
class Algo:
    """One algorithm: torch class, our kernel paths, state set-up, call, flag grid."""

    name: str
    torch_cls: type[torch.optim.Optimizer]
    paths: dict[str, Callable[..., None]]
    dispatch: Callable[..., None]
    init: Callable[[list[Tensor], dict[str, Any]], State]
    call: Callable[..., None]
    configs: list[dict[str, Any]]


ALGOS: dict[str, Algo] = {
    a.name: a
    for a in [
        Algo(
            "adagrad",
            torch.optim.Adagrad,
            {
                "single": kernels.adagrad_single,
                "foreach": kernels.adagrad_foreach,
                "fused": kernels.adagrad_fused,
            },
            kernels.adagrad,
            _adagrad_init,
            _adagrad_call,
            _grid(
                lr=[0.1],
                lr_decay=[0.0, 0.05],
                weight_decay=[0.0, 0.1],
                initial_accumulator_value=[0.0, 0.5],
                eps=[1e-10],
                maximize=[False, True],
            ),
        ),
        Algo(
            "adadelta",
            torch.optim.Adadelta,
            {"single": kernels.adadelta_single, "foreach": kernels.adadelta_foreach},
            kernels.adadelta,
            _adadelta_init,
            _adadelta_call,
            _grid(
                lr=[1.0, 0.3],
                rho=[0.9, 0.5],
                eps=[1e-6],
                weight_decay=[0.0, 0.1],
                maximize=[False, True],
            ),
        ),
        Algo(
            "rmsprop",
            torch.optim.RMSprop,
            {"single": kernels.rmsprop_single, "foreach": kernels.rmsprop_foreach},
            kernels.rmsprop,
            _rmsprop_init,
            _rmsprop_call,
            _grid(
                lr=[0.01],
                alpha=[0.99],
                eps=[1e-8],
                weight_decay=[0.0, 0.1],
                momentum=[0.0, 0.9],
                centered=[False, True],
                maximize=[False, True],
            ),
        ),
        Algo(
            "rprop",
            torch.optim.Rprop,
            {"single": kernels.rprop_single, "foreach": kernels.rprop_foreach},
            kernels.rprop,
            _rprop_init,
            _rprop_call,
            _grid(
                lr=[0.01, 0.2],
                etas=[(0.5, 1.2), (0.3, 1.7)],
                step_sizes=[(1e-6, 50.0), (1e-3, 0.05)],
                maximize=[False, True],
            ),
        ),
    ]
}

TORCH_FLAGS: dict[str, dict[str, bool]] = {
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}

CASES = [
    (name, path, i)
    for name, algo in ALGOS.items()
    for path in algo.paths
    for i in range(len(algo.configs))
]


def _run_ours(
    algo: Algo,
    fn: Callable[..., None],
    params: list[Tensor],
    grads: list[list[Tensor | None]],
    hyper: dict[str, Any],
    *impl: str,
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Run ``fn`` for every step of ``grads`` on clones of ``params``; return params and state."""
    ours = [p.clone() for p in params]
    state = algo.init(ours, hyper)
    for row in grads:
        given = [t for t in row if t is not None]
        g = [t.clone() for t in given]
        algo.call(fn, ours, g, state, hyper, *impl)
        dense = [t.to_dense() if t.is_sparse else t for t in g]
        assert_tensors_equal(
            dense,
            [t.to_dense() if t.is_sparse else t for t in given],
            what="grads must not be mutated",
        )
    per_param = [{k: v[i] for k, v in state.items()} for i in range(len(ours))]
    return ours, per_param


def _check_parity(
    algo: Algo,
    path: str,
    hyper: dict[str, Any],
    params: list[Tensor],
    steps: int,
    fn: Callable[..., None] | None = None,
    seed: int = 1,
) -> None:
    grads = make_grads(params, steps, seed=seed)
    expected = run_torch(algo.torch_cls, params, grads, **TORCH_FLAGS[path], **hyper)
    got, state = _run_ours(algo, fn or algo.paths[path], params, grads, hyper)
    assert_tensors_equal(got, expected.params, what=f"{algo.name}/{path} params")
    assert_states_equal(state, expected.states)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("name", "path", "config"), CASES)
def test_path_matches_torch_bitwise(name: str, path: str, config: int, dtype: torch.dtype) -> None:
    algo = ALGOS[name]
    params = make_params(SHAPES, dtype=dtype, seed=config)
    _check_parity(algo, path, algo.configs[config], params, steps=3 + config % 5)


@pytest.mark.parametrize("name", list(ALGOS))
def test_auto_on_cpu_matches_fastest_path(name: str) -> None:
    """``impl="auto"`` on CPU is the fused path where torch has one, else the per-tensor loop."""
    algo = ALGOS[name]
    path = "fused" if "fused" in algo.paths else "single"
    hyper = algo.configs[-1]
    params = make_params(SHAPES, dtype=torch.float32)
    grads = make_grads(params, 4)
    expected = run_torch(algo.torch_cls, params, grads, **TORCH_FLAGS[path], **hyper)
    got, state = _run_ours(algo, algo.dispatch, params, grads, hyper, "auto")
    assert_tensors_equal(got, expected.params)
    assert_states_equal(state, expected.states)


@pytest.mark.parametrize(("name", "path"), [(n, p) for n, a in ALGOS.items() for p in a.paths])
def test_dispatch_impl_matches_path(name: str, path: str) -> None:
    algo = ALGOS[name]
    hyper = algo.configs[5]
    params = make_params(SHAPES, dtype=torch.float64, seed=3)
    grads = make_grads(params, 3)
    expected = run_torch(algo.torch_cls, params, grads, **TORCH_FLAGS[path], **hyper)
    got, _ = _run_ours(algo, algo.dispatch, params, grads, hyper, path)
    assert_tensors_equal(got, expected.params)


@pytest.mark.parametrize(
    ("name", "path"), [(n, p) for n, a in ALGOS.items() for p in a.paths if p != "fused"]
)
def test_complex_params_match_torch(name: str, path: str) -> None:
    algo = ALGOS[name]
    params = make_params(((3,), (2, 2), ()), dtype=torch.complex64, seed=5)
    for hyper in (algo.configs[0], algo.configs[-1]):
        _check_parity(algo, path, hyper, params, steps=4)


@pytest.mark.parametrize(("name", "path"), [(n, p) for n, a in ALGOS.items() for p in a.paths])
def test_mixed_dtypes_are_grouped(name: str, path: str) -> None:
    """One call over float32 and float64 params (several (device, dtype) groups)."""
    _check_parity(ALGOS[name], path, ALGOS[name].configs[-1], _mixed_params(), steps=3)


# --- TorchScript -----------------------------------------------------------------------------

EXPORTED = [n for n in kernels.__all__ if n.split("_")[0] in ALGOS]


@pytest.fixture(scope="module")
def scripted() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        return {n: torch.jit.script(getattr(kernels, n)) for n in EXPORTED}


def test_every_exported_function_is_listed() -> None:
    expected = {f"{n}{s}" for n, a in ALGOS.items() for s in ["", *(f"_{p}" for p in a.paths)]}
    assert set(EXPORTED) == expected


def _mixed_params() -> list[Tensor]:
    """float32 and float64 params interleaved: several (device, dtype) groups in one call."""
    params = make_params(((3,), (2, 2)), torch.float32) + make_params(((4,), ()), torch.float64)
    return params + make_params(((5,),), torch.float32, seed=7)


@pytest.mark.parametrize("fn_name", EXPORTED)
def test_scripted_kernel_matches_torch(fn_name: str, scripted: dict[str, Any]) -> None:
    """Scripted kernels give torch's bits too, with one group, several groups and complex params.

    (TorchScript's alias analysis can drop in-place foreach ops on lists built inside a script;
    the multi-group and complex cases catch that.)
    """
    name, _, path = fn_name.partition("_")
    algo = ALGOS[name]
    fn = scripted[fn_name]
    assert isinstance(fn, torch.jit.ScriptFunction)
    if not path:  # the dispatcher: auto on CPU
        path = "fused" if "fused" in algo.paths else "single"
    cases = [make_params(SHAPES, dtype=torch.float32, seed=2), _mixed_params()]
    if path != "fused":
        cases.append(make_params(((3,), (2, 2), ()), dtype=torch.complex64, seed=3))
    for params in cases:
        _check_parity(algo, path, algo.configs[-1], params, steps=3, fn=fn)


# --- Hypothesis: random shapes, dtypes, step counts -------------------------------------------

_shape = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=100)
@given(
    case=st.sampled_from(CASES),
    shapes=st.lists(_shape, min_size=1, max_size=4),
    dtype=st.sampled_from(FLOAT_DTYPES),
    steps=st.integers(1, 30),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_and_steps(
    case: tuple[str, str, int],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    steps: int,
    seed: int,
) -> None:
    name, path, config = case
    algo = ALGOS[name]
    params = make_params(shapes, dtype=dtype, seed=seed)
    _check_parity(algo, path, algo.configs[config], params, steps=steps, seed=seed + 1)


# --- Adagrad: sparse gradients -----------------------------------------------------------------


def _sparse_grads(steps: int) -> list[list[Tensor | None]]:
    gen = torch.Generator().manual_seed(11)
    rows: list[list[Tensor | None]] = []
    for _ in range(steps):
        idx = torch.tensor([[0, 2, 2, 4]])  # repeated index: the kernel must coalesce
        vals = torch.randn(4, 3, generator=gen, dtype=torch.float64)
        rows.append(
            [
                torch.sparse_coo_tensor(idx, vals, (5, 3), check_invariants=True),
                torch.randn(2, generator=gen, dtype=torch.float64),
            ]
        )
    return rows


@pytest.mark.parametrize("impl", ["single", "foreach", "auto"])
@pytest.mark.parametrize("maximize", [False, True])
def test_adagrad_sparse_grads_match_torch(impl: str, maximize: bool) -> None:
    algo = ALGOS["adagrad"]
    hyper = {**algo.configs[0], "lr_decay": 0.05, "maximize": maximize}
    params = make_params(((5, 3), (2,)), dtype=torch.float64)
    grads = _sparse_grads(3)
    foreach = impl == "foreach"
    with torch.sparse.check_sparse_tensor_invariants():  # type: ignore[no-untyped-call]  # else torch's adagrad warns
        expected = run_torch(torch.optim.Adagrad, params, grads, foreach=foreach, **hyper)
    got, state = _run_ours(algo, kernels.adagrad, params, grads, hyper, impl)
    assert_tensors_equal(got, expected.params)
    assert_states_equal(state, expected.states)


# --- errors --------------------------------------------------------------------------------


def _one_param_state(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    algo = ALGOS[name]
    params = [torch.ones(3, dtype=dtype)]
    grads = [torch.ones(3, dtype=dtype)]
    return algo, params, grads, algo.init(params, algo.configs[-1]), algo.configs[-1]


@pytest.mark.parametrize("name", list(ALGOS))
def test_unknown_impl_and_missing_fused_raise(name: str) -> None:
    algo, params, grads, state, hyper = _one_param_state(name)
    before = params[0].clone()
    with pytest.raises(ValueError, match="impl must be one of"):
        algo.call(algo.dispatch, params, grads, state, hyper, "fast")
    if "fused" not in algo.paths:
        with pytest.raises(ValueError, match="has no fused kernel"):
            algo.call(algo.dispatch, params, grads, state, hyper, "fused")
    assert torch.equal(params[0], before)
    assert float(state["step"][0]) == 0.0


@pytest.mark.parametrize(("name", "path"), [(n, p) for n, a in ALGOS.items() for p in a.paths])
def test_list_length_mismatch_raises_before_mutation(name: str, path: str) -> None:
    algo, params, grads, state, hyper = _one_param_state(name)
    state["step"].append(torch.zeros(()))
    with pytest.raises(ValueError, match=rf"{name}: expected one tensor per param in state_steps"):
        algo.call(algo.paths[path], params, grads, state, hyper)
    assert torch.equal(params[0], torch.ones(3))
    assert all(float(s) == 0.0 for s in state["step"])


def test_rmsprop_missing_optional_buffers_raise() -> None:
    algo = ALGOS["rmsprop"]
    hyper = {**algo.configs[0], "momentum": 0.9, "centered": True}
    params, grads = [torch.ones(2)], [torch.ones(2)]
    state = algo.init(params, hyper)
    state["grad_avg"] = []
    with pytest.raises(ValueError, match=r"grad_avgs \(centered=True\)"):
        algo.call(kernels.rmsprop, params, grads, state, hyper)


def test_adagrad_fused_rejects_complex_like_torch() -> None:
    algo, params, grads, state, hyper = _one_param_state("adagrad", torch.complex64)
    with pytest.raises(RuntimeError, match="`fused` does not support sparse grad or complex param"):
        algo.call(kernels.adagrad_fused, params, grads, state, hyper)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating"):
        algo.call(kernels.adagrad, params, grads, state, hyper, "fused")
    assert float(state["step"][0]) == 0.0


def test_adagrad_sparse_grad_with_weight_decay_raises_like_torch() -> None:
    params = [torch.ones(4)]
    grads = [
        torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1), (4,), check_invariants=True)
    ]
    sums, steps = [torch.zeros(4)], [torch.zeros(())]
    with pytest.raises(RuntimeError) as torch_err, torch.sparse.check_sparse_tensor_invariants():  # type: ignore[no-untyped-call]
        torch_adagrad(
            [p.clone() for p in params],
            grads,
            [torch.zeros(4)],
            [torch.zeros(())],
            lr=0.1,
            weight_decay=0.1,
            lr_decay=0.0,
            eps=1e-10,
            maximize=False,
        )
    for fn in (kernels.adagrad_single, kernels.adagrad_foreach):
        with pytest.raises(RuntimeError) as ours:
            fn(params, grads, sums, steps, 0.1, 0.1, 0.0, 1e-10, False)
        assert str(ours.value) == str(torch_err.value)
    assert float(steps[0]) == 0.0
    assert torch.equal(params[0], torch.ones(4))


# --- CUDA (skipped without a GPU) --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "path"), [(n, p) for n, a in ALGOS.items() for p in a.paths])
def test_cuda_path_matches_torch_bitwise(name: str, path: str) -> None:
    """On CUDA each path equals torch.optim with the matching flag (fused steps on the device)."""
    algo = ALGOS[name]
    hyper = algo.configs[-1]
    for dtype in FLOAT_DTYPES:
        params = [p.cuda() for p in make_params(SHAPES, dtype=dtype, seed=6)]
        grads: list[list[Tensor | None]] = [
            [None if g is None else g.cuda() for g in row] for row in make_grads(params, 4)
        ]
        expected = run_torch(algo.torch_cls, params, grads, **TORCH_FLAGS[path], **hyper)
        ours = [p.clone() for p in params]
        state = algo.init(ours, hyper)
        if path == "fused":
            state["step"] = [s.to(p.device) for s, p in zip(state["step"], ours, strict=True)]
        for row in grads:
            algo.call(
                algo.paths[path], ours, [g.clone() for g in row if g is not None], state, hyper
            )
        assert_tensors_equal(ours, expected.params, what=f"{name}/{path} cuda params")
        got = [{k: v[i] for k, v in state.items()} for i in range(len(ours))]
        assert_states_equal(got, expected.states)
