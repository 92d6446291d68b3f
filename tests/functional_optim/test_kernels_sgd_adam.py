"""Parity of the sgd / adam / adamw / adamax kernels with torch.optim, path by path.

Every path is compared BITWISE (params and state) with torch.optim.X run with the matching flag:
``single`` <-> ``foreach=False``, ``foreach`` <-> ``foreach=True``, ``fused`` <-> ``fused=True``.
One table drives the four algorithms over every flag combination torch supports.
"""

import importlib
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, List, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from functional_optim import kernels
from functional_optim.kernels._dispatch import resolve_impl
from functional_optim.kernels.sgd import sgd_foreach, sgd_fused, sgd_single
from tests.functional_optim._parity import (
    FLOAT_DTYPES,
    assert_states_equal,
    assert_tensors_equal,
    make_grads,
    make_params,
    run_torch,
)

KernelFn = Callable[..., None]
STEPS = 6


def _module(name: str) -> Any:
    # kernels/__init__ re-exports functions named like their modules, which shadow them.
    return importlib.import_module(f"functional_optim.kernels.{name}")


# --- how to drive each kernel with torch-style hyperparameters -------------------------------


def _steps(params: list[Tensor], fused: bool) -> list[Tensor]:
    # torch: float32 on the param's device when fused, else CPU with the default float dtype.
    if fused:
        return [torch.zeros((), dtype=torch.float32, device=p.device) for p in params]
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return [torch.zeros((), dtype=dtype) for _ in params]


def _run_adam(
    fn: KernelFn, params: list[Tensor], grads: list[list[Tensor]], hp: dict[str, Any], fused: bool
) -> list[dict[str, Any]]:
    amsgrad = hp.get("amsgrad", False)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    maxs = [torch.zeros_like(p) for p in params] if amsgrad else []
    steps = _steps(params, fused)
    beta1, beta2 = hp.get("betas", (0.9, 0.999))
    for row in grads:
        fn(
            params,
            row,
            exp_avgs,
            exp_avg_sqs,
            maxs,
            steps,
            amsgrad,
            beta1,
            beta2,
            hp["lr"],
            hp["weight_decay"],
            hp.get("eps", 1e-8),
            hp.get("maximize", False),
        )
    states = []
    for i in range(len(params)):
        s = {"step": steps[i], "exp_avg": exp_avgs[i], "exp_avg_sq": exp_avg_sqs[i]}
        if amsgrad:
            s["max_exp_avg_sq"] = maxs[i]
        states.append(s)
    return states


def _run_adamax(
    fn: KernelFn, params: list[Tensor], grads: list[list[Tensor]], hp: dict[str, Any], fused: bool
) -> list[dict[str, Any]]:
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_infs = [torch.zeros_like(p) for p in params]
    steps = _steps(params, fused)
    beta1, beta2 = hp.get("betas", (0.9, 0.999))
    for row in grads:
        fn(
            params,
            row,
            exp_avgs,
            exp_infs,
            steps,
            hp.get("eps", 1e-8),
            beta1,
            beta2,
            hp["lr"],
            hp.get("weight_decay", 0.0),
            hp.get("maximize", False),
        )
    return [
        {"step": steps[i], "exp_avg": exp_avgs[i], "exp_inf": exp_infs[i]}
        for i in range(len(params))
    ]


def _run_sgd(
    fn: KernelFn, params: list[Tensor], grads: list[list[Tensor]], hp: dict[str, Any], fused: bool
) -> list[dict[str, Any]]:
    bufs: list[Tensor | None] = [None] * len(params)
    momentum = hp.get("momentum", 0.0)
    for row in grads:
        fn(
            params,
            row,
            bufs,
            hp["lr"],
            momentum,
            hp.get("dampening", 0.0),
            hp.get("weight_decay", 0.0),
            hp.get("nesterov", False),
            hp.get("maximize", False),
        )
    return [{"momentum_buffer": b} if momentum != 0 else {} for b in bufs]


@dataclass(frozen=True)
class Algo:
    """One row of the table: torch's class, our paths, a driver and the flag grid."""

    name: str
    optim: type[torch.optim.Optimizer]
    run: Callable[..., list[dict[str, Any]]]
    paths: tuple[str, ...]
    configs: tuple[dict[str, Any], ...]

    def fn(self, path: str) -> KernelFn:
        mod = _module(self.name)
        return getattr(mod, self.name if path == "auto" else f"{self.name}_{path}")  # type: ignore[no-any-return]


def _grid(**axes: tuple[Any, ...]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*axes.values())]


def _sgd_configs() -> tuple[dict[str, Any], ...]:
    out = []
    for c in _grid(
        momentum=(0.0, 0.9),
        dampening=(0.0, 0.5),
        nesterov=(False, True),
        weight_decay=(0.0, 0.1),
        maximize=(False, True),
    ):
        if c["nesterov"] and (c["momentum"] == 0 or c["dampening"] != 0):
            continue  # torch rejects these
        if c["momentum"] == 0 and c["dampening"] != 0:
            continue  # dampening is unused without momentum
        out.append({"lr": 0.05, **c})
    return tuple(out)


_ADAM_GRID = tuple(
    {"lr": 0.01, "betas": (0.8, 0.99), **c}
    for c in _grid(amsgrad=(False, True), weight_decay=(0.0, 0.1), maximize=(False, True))
)

ALGOS = (
    Algo("sgd", torch.optim.SGD, _run_sgd, ("single", "foreach", "fused"), _sgd_configs()),
    Algo("adam", torch.optim.Adam, _run_adam, ("single", "foreach", "fused"), _ADAM_GRID),
    Algo("adamw", torch.optim.AdamW, _run_adam, ("single", "foreach", "fused"), _ADAM_GRID),
    Algo(
        "adamax",
        torch.optim.Adamax,
        _run_adamax,
        ("single", "foreach"),
        tuple(
            {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, **c}
            for c in _grid(weight_decay=(0.0, 0.1), maximize=(False, True))
        ),
    ),
)
_BY_NAME = {a.name: a for a in ALGOS}
_FLAG = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _check(
    algo: Algo,
    path: str,
    hp: dict[str, Any],
    params: list[Tensor],
    grads: list[list[Tensor]],
    fn: KernelFn | None = None,
) -> None:
    fn = fn or algo.fn(path)
    torch_path = path
    if path == "auto":
        torch_path = "fused" if "fused" in algo.paths else "single"
    expected = run_torch(algo.optim, params, grads, **hp, **_FLAG[torch_path])
    ours = [p.clone() for p in params]
    our_grads = [[g.clone() for g in row] for row in grads]
    states = algo.run(fn, ours, our_grads, hp, torch_path == "fused")
    for row, our_row in zip(grads, our_grads, strict=True):
        assert_tensors_equal(our_row, row, what="grads must not be mutated")
    assert_tensors_equal(ours, expected.params, what=f"{algo.name}/{path} {hp} params")
    assert_states_equal(states, expected.states)


_CASES = [
    pytest.param(a, path, hp, id=f"{a.name}-{path}-{i}")
    for a in ALGOS
    for path in a.paths
    for i, hp in enumerate(a.configs)
]


@pytest.mark.parametrize(("algo", "path", "hp"), _CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_path_bitwise_equals_torch(
    algo: Algo, path: str, hp: dict[str, Any], dtype: torch.dtype
) -> None:
    params = make_params(dtype=dtype, seed=3)
    grads = make_grads(params, STEPS, seed=4)
    _check(algo, path, hp, params, grads)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ALGOS, ids=lambda a: a.name)
@pytest.mark.parametrize("path", ["single", "foreach"])
def test_complex_params_bitwise_equal_torch(algo: Algo, path: str) -> None:
    params = make_params(dtype=torch.complex64, seed=5)
    grads = make_grads(params, STEPS, seed=6)
    hp = algo.configs[-1]  # every flag on
    _check(algo, path, hp, params, grads)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ALGOS, ids=lambda a: a.name)
def test_auto_on_cpu_is_fused_or_single(algo: Algo) -> None:
    params = make_params(dtype=torch.float32, seed=7)
    expected = "fused" if "fused" in algo.paths else "single"
    assert resolve_impl("auto", params, "fused" in algo.paths) == expected
    grads = make_grads(params, 3, seed=8)
    hp = algo.configs[-1]
    torch_hp = {**hp, **_FLAG[expected]}
    ref = run_torch(algo.optim, params, grads, **torch_hp)
    ours = [p.clone() for p in params]
    algo.run(algo.fn("auto"), ours, grads, hp, expected == "fused")
    assert_tensors_equal(ours, ref.params, what=f"{algo.name}/auto")


@settings(max_examples=20)
@given(
    data=st.data(),
    n_steps=st.integers(1, 30),
    shapes=st.lists(
        st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
    ),
    dtype=st.sampled_from(FLOAT_DTYPES),
)
def test_hypothesis_random_shapes_steps_flags(
    data: st.DataObject, n_steps: int, shapes: list[tuple[int, ...]], dtype: torch.dtype
) -> None:
    algo = data.draw(st.sampled_from(ALGOS), label="algo")
    path = data.draw(st.sampled_from(algo.paths), label="path")
    hp = data.draw(st.sampled_from(algo.configs), label="hp")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    params = make_params(shapes, dtype=dtype, seed=seed)
    grads = make_grads(params, n_steps, seed=seed + 1)
    _check(algo, path, hp, params, grads)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["single", "foreach", "fused"])
def test_sgd_sparse_or_mixed_buffers(path: str) -> None:
    """Params that first get a gradient on a later step start their momentum buffer then."""
    params = make_params(seed=9)
    grads = make_grads(params, 4, seed=10)
    hp = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True}
    fn = _BY_NAME["sgd"].fn(path)
    ours = [p.clone() for p in params]
    bufs: list[Tensor | None] = [None] * len(params)
    late = [0, 2]  # these params get no gradient on step 0
    for step, row in enumerate(grads):
        idx = [i for i in range(len(params)) if step > 0 or i not in late]
        sub_bufs = [bufs[i] for i in idx]
        fn(
            [ours[i] for i in idx],
            [row[i] for i in idx],
            sub_bufs,
            hp["lr"],
            0.9,
            0.0,
            0.0,
            True,
            False,
        )
        for j, i in enumerate(idx):
            bufs[i] = sub_bufs[j]
    # Each param evolves on its own: compare with torch run on that param's own grads.
    for i in range(len(params)):
        own = [[row[i]] for step, row in enumerate(grads) if step > 0 or i not in late]
        ref = run_torch(torch.optim.SGD, [params[i]], own, **hp, **_FLAG[path])
        assert_tensors_equal([ours[i], bufs[i]], [ref.params[0], ref.states[0]["momentum_buffer"]])


def test_sgd_sparse_grads_take_single_path() -> None:
    params = [torch.randn(5, 3)]
    dense = torch.zeros(5, 3)
    dense[1] = 1.0
    sparse = dense.to_sparse()
    ref = run_torch(torch.optim.SGD, params, [[sparse]], lr=0.1, foreach=False)
    ours = [params[0].clone()]
    kernels.sgd(ours, [sparse], [None], 0.1, 0.0, 0.0, 0.0, False, False)
    assert_tensors_equal(ours, ref.params)
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        _module("sgd").sgd_fused(ours, [sparse], [None], 0.1, 0.0, 0.0, 0.0, False, False)


def test_resolve_impl_errors_match_torch() -> None:
    p = torch.zeros(2, dtype=torch.complex64, requires_grad=True)
    p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError) as torch_err:
        torch.optim.Adam([p], fused=True).step()
    with pytest.raises(RuntimeError) as our_err:
        resolve_impl("fused", [p.detach()], True)
    assert str(our_err.value) == str(torch_err.value)
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.adam([], [], [], [], [], [], False, 0.9, 0.99, 0.1, 0.0, 1e-8, False, "fast")
    with pytest.raises(ValueError, match="no fused kernel"):
        kernels.adamax([], [], [], [], [], 1e-8, 0.9, 0.99, 0.1, 0.0, False, "fused")
    assert resolve_impl("auto", [], True) == "single"
    assert resolve_impl("auto", [p.detach()], True) == "single"  # complex: no fused


_OURS = [
    name
    for name in kernels.__all__
    if name.split("_")[0] in {"sgd", "adam", "adamw", "adamax"} or name == "resolve_impl"
]
_ALL_PATH_FNS = [f"{a.name}_{p}" for a in ALGOS for p in a.paths] + [a.name for a in ALGOS]


@pytest.fixture(scope="module")
def scripted() -> dict[str, Any]:
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        for name in _ALL_PATH_FNS:
            out[name] = torch.jit.script(getattr(_module(name.split("_")[0]), name))
        out["resolve_impl"] = torch.jit.script(resolve_impl)
        driver = torch.jit.script(_sgd_scripted_driver)
    for path in ("single", "foreach", "fused", "auto"):
        out[f"sgd_{path}" if path != "auto" else "sgd"] = _scripted_sgd(driver, path)
    return out


def _sgd_scripted_driver(
    path: str,
    params: List[Tensor],
    grads: List[Tensor],
    bufs: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> List[Optional[Tensor]]:
    # Lists passed from Python into TorchScript are copies: return the buffers the kernel
    # stored so the Python caller sees them (scripted callers share the list directly).
    if path == "single":
        sgd_single(params, grads, bufs, lr, momentum, dampening, weight_decay, nesterov, maximize)
    elif path == "foreach":
        sgd_foreach(params, grads, bufs, lr, momentum, dampening, weight_decay, nesterov, maximize)
    elif path == "fused":
        sgd_fused(params, grads, bufs, lr, momentum, dampening, weight_decay, nesterov, maximize)
    else:
        kernels.sgd(params, grads, bufs, lr, momentum, dampening, weight_decay, nesterov, maximize)
    return bufs


def _scripted_sgd(driver: Any, path: str) -> KernelFn:
    def call(
        params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], *hp: Any
    ) -> None:
        bufs[:] = driver(path, params, grads, bufs, *hp)

    return call


def test_exports_are_scriptable(scripted: dict[str, Any]) -> None:
    missing = [n for n in _OURS if n not in scripted]
    assert not missing, f"exported but not scripted here: {missing}"
    assert isinstance(scripted["adam"], torch.jit.ScriptFunction)
    assert isinstance(scripted["resolve_impl"], torch.jit.ScriptFunction)


@pytest.mark.parametrize(
    ("algo", "path"),
    [(a, p) for a in ALGOS for p in (*a.paths, "auto")],
    ids=lambda v: v.name if isinstance(v, Algo) else v,
)
def test_scripted_paths_bitwise_equal_torch(
    scripted: dict[str, Any], algo: Algo, path: str
) -> None:
    name = algo.name if path == "auto" else f"{algo.name}_{path}"
    params = make_params(seed=11)
    grads = make_grads(params, 4, seed=12)
    _check(algo, path, algo.configs[-1], params, grads, fn=scripted[name])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("algo", "path"),
    [(a, p) for a in ALGOS for p in a.paths if p != "single"],
    ids=lambda v: v.name if isinstance(v, Algo) else v,
)
def test_scripted_multi_group_bitwise_equal_torch(
    scripted: dict[str, Any], algo: Algo, path: str
) -> None:
    """float32 and float64 params in one call: several (device, dtype) groups in TorchScript."""
    params = make_params(dtype=torch.float32, seed=15) + make_params(dtype=torch.float64, seed=16)
    grads = make_grads(params, 3, seed=17)
    _check(algo, path, algo.configs[-1], params, grads, fn=scripted[f"{algo.name}_{path}"])  # type: ignore[arg-type]


@pytest.mark.compile
def test_torch_compile_smoke_sgd_foreach() -> None:
    """One torch.compile run (7-36 s on CPU): the foreach SGD kernel compiles and matches."""
    fn: KernelFn = torch.compile(_module("sgd").sgd_foreach, fullgraph=False)
    params = make_params(seed=13)
    grads = make_grads(params, 3, seed=14)
    hp = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.1, "nesterov": True}
    ref = run_torch(torch.optim.SGD, params, grads, **hp, foreach=True)
    ours = [p.clone() for p in params]
    bufs: list[Tensor | None] = [None] * len(params)
    for row in grads:
        fn(ours, row, bufs, 0.1, 0.9, 0.0, 0.1, True, False)
    # Inductor may fuse the elementwise ops differently: float32 rounding tolerance.
    assert_tensors_equal(ours, ref.params, rtol=1e-6, atol=1e-7, what="compiled sgd")
