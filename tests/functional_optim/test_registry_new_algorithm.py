"""Adding an algorithm is one registry entry: a toy (Signum, sign descent with momentum) proves it.

The test declares what a new algorithm brings (a kernel, a transform and its state, a
``torch.optim`` class to match) and ONE ``fo.Algorithm`` entry, registers it, and checks that
every place the package derives from the registry now knows it without another edit: the
generated alias with torch's names, defaults and checks, its fused ``step`` built from the
declared kernel arguments, ``fo.<name>`` (the package's ``__getattr__``: a run-time algorithm
writes into no module namespace and stays out of the static ``__all__``), torch's state names,
``compat_api``'s ``functional_optim_map`` and the parity test tables, which then run it against
the torch class bitwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, List, NamedTuple

import pytest
import torch
from torch import Tensor

import compat_api
import functional_optim as fo
from functional_optim._aliases._common import check_lr, maximize_tx
from functional_optim._aliases._kernel_step import GRADS, IMPL, LR, PARAMS, state
from functional_optim._base import GradientTransformation, chain
from functional_optim._registry import BY_NAME
from functional_optim._torch_state import _TORCH_NAMES
from functional_optim._transforms.scale import scale_by_learning_rate
from functional_optim._tree import PyTree, tree_flatten, tree_leaves

from . import test_registry
from ._alias_registry import entry_for
from ._hyper_strategies import strategies
from ._parity import FLOAT_DTYPES, assert_states_equal, assert_tensors_equal, make_grads, run_torch
from .test_aliases import TOL, run_pure, run_step, torch_states


class Signum(torch.optim.Optimizer):
    """The torch class the toy mirrors: ``m = beta * m + (1 - beta) * g``, ``p -= lr * sign(m)``."""

    def __init__(
        self, params: Any, lr: float = 1e-2, beta: float = 0.9, *, maximize: bool = False
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta value: {beta}")
        super().__init__(params, {"lr": lr, "beta": beta, "maximize": maximize})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["momentum_buffer"] = torch.zeros_like(p)
                st["step"] += 1
                st["momentum_buffer"].mul_(group["beta"]).add_(grad, alpha=1 - group["beta"])
                p.add_(st["momentum_buffer"].sign(), alpha=-group["lr"])


# --- what a new algorithm brings: a kernel (kernels/signum.py), a transform, a FunctionalX ---


def signum(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    beta: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """The toy kernel (per tensor; ``typing.List`` as TorchScript kernels write it)."""
    for i in range(len(params)):
        grad = -grads[i] if maximize else grads[i]
        state_steps[i] += 1
        momentum_buffers[i].mul_(beta).add_(grad, alpha=1 - beta)
        params[i].add_(momentum_buffers[i].sign(), alpha=-lr)


class ScaleBySignumState(NamedTuple):
    count: PyTree
    mu: PyTree


def scale_by_signum(beta: float) -> GradientTransformation:
    """The toy transform: ``sign`` of the momentum (None gradients leave their state alone)."""

    def init(params: PyTree) -> ScaleBySignumState:
        leaves, spec = tree_flatten(params)
        return ScaleBySignumState(
            spec.unflatten([torch.tensor(0.0) for _ in leaves]),
            spec.unflatten([torch.zeros_like(p) for p in leaves]),
        )

    def update(
        updates: PyTree, st: ScaleBySignumState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, ScaleBySignumState]:
        grads, spec = tree_flatten(updates)
        out, counts, mus = [], spec.flatten_up_to(st.count), spec.flatten_up_to(st.mu)
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
                continue
            mus[i] = mus[i].mul(beta).add(g, alpha=1 - beta)
            counts[i] = counts[i] + 1
            out.append(mus[i].sign())
        return spec.unflatten(out), ScaleBySignumState(spec.unflatten(counts), spec.unflatten(mus))

    return GradientTransformation(init, update)


class FunctionalSignum:
    """The toy's functional class (a TorchScript-style ``step(gradients)``)."""

    def __init__(self, params: list[Tensor], lr: float = 1e-2, beta: float = 0.9) -> None:
        self.params, self.lr, self.beta = params, lr, beta


def _check_beta(beta: float) -> None:
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Invalid beta value: {beta}")


def _chain(lr: float, beta: float, maximize: bool) -> GradientTransformation:
    return chain(maximize_tx(maximize), scale_by_signum(beta), scale_by_learning_rate(lr))


# --- the one registry entry ---

SIGNUM = fo.Algorithm(
    name="signum",
    torch_name="Signum",
    transform=scale_by_signum,
    state_type=ScaleBySignumState,
    state_names={ScaleBySignumState: {"count": "step", "mu": "momentum_buffer"}},
    kernel=signum,
    kernel_args=(PARAMS, GRADS, state("mu"), state("count"), LR, "beta", "maximize", IMPL),
    functional=FunctionalSignum,
    hyperparams=(
        fo.Hyperparam("lr", 1e-2, check_lr, cases=(0.1,)),
        fo.Hyperparam("beta", 0.9, _check_beta, cases=(0.0, 0.5)),
        fo.Hyperparam("maximize", False, keyword_only=True),
    ),
    chain=_chain,
    doc="Signum: sign descent with momentum.",
)

NEW_NAMES = ("signum", "scale_by_signum", "ScaleBySignumState", "FunctionalSignum")


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[fo.Algorithm]:
    monkeypatch.setattr(torch.optim, "Signum", Signum, raising=False)
    fo.register_algorithm(SIGNUM)
    try:
        yield SIGNUM
    finally:
        fo.unregister_algorithm("signum")


def test_nothing_knows_the_toy_before_it_is_registered() -> None:
    assert not set(NEW_NAMES) & set(fo.__all__)
    assert not set(NEW_NAMES) & set(dir(fo))
    for name in NEW_NAMES:
        assert not hasattr(fo, name), name
    assert "signum" not in BY_NAME
    assert ScaleBySignumState not in _TORCH_NAMES
    assert FunctionalSignum not in compat_api.functional_optim_map.values()


def test_one_entry_exports_every_part(registered: fo.Algorithm) -> None:
    assert registered in fo.ALGORITHMS
    assert fo.ALGORITHMS[-1] is registered
    assert BY_NAME["signum"] is registered
    for name in NEW_NAMES:
        assert name in dir(fo), name
        assert name not in fo.__all__, name  # __all__ is the static surface
        assert name not in vars(fo), name  # served by __getattr__, not written into the module
    assert fo.__all__ == sorted(fo.__all__)
    assert fo.scale_by_signum is scale_by_signum  # type: ignore[attr-defined]
    assert fo.FunctionalSignum is FunctionalSignum  # type: ignore[attr-defined]
    # the kernel and the FunctionalX class are the entry's; fo.kernels / fo.functional are static
    assert fo.ALGORITHMS[-1].kernel is signum
    assert fo.ALGORITHMS[-1].functional is FunctionalSignum
    assert not hasattr(fo.kernels, "signum")
    assert "signum" not in fo.kernels.__all__
    assert not hasattr(fo.functional, "FunctionalSignum")
    test_registry.assert_reachable_at_run_time(registered)


def test_generated_alias_speaks_torch_names(registered: fo.Algorithm) -> None:
    alias = fo.signum  # type: ignore[attr-defined]
    assert alias is registered.alias
    ours = inspect.signature(alias)
    theirs = inspect.signature(Signum.__init__)
    assert list(ours.parameters) == [n for n in theirs.parameters if n not in ("self", "params")]
    for name, param in ours.parameters.items():
        assert param.default == theirs.parameters[name].default, name
        assert param.kind == theirs.parameters[name].kind, name
    test_registry.test_alias_speaks_torch_names(registered)
    with pytest.raises(ValueError, match=r"Invalid beta value: 1\.5"):
        alias(beta=1.5)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        alias(-1.0)
    tx = alias(0.1, maximize=True)
    assert tx.step is not None
    assert tx.init([torch.zeros(2)]).hyperparams == {"lr": 0.1, "beta": 0.9, "maximize": True}


def test_torch_state_names_and_functional_map(registered: fo.Algorithm) -> None:
    assert _TORCH_NAMES[ScaleBySignumState] == {"count": "step", "mu": "momentum_buffer"}
    test_registry.test_torch_state_names_come_from_the_registry()
    params = [torch.ones(3)]
    per_param, _ = fo.to_torch_state(fo.signum().init(params), params)  # type: ignore[attr-defined]
    assert set(per_param[0]) == {"step", "momentum_buffer"}
    assert compat_api.functional_optim_map[Signum] is FunctionalSignum
    test_registry.test_functional_map_is_the_registry()


def test_unregister_removes_every_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.optim, "Signum", Signum, raising=False)
    fo.register_algorithm(SIGNUM)
    fo.unregister_algorithm("signum")
    test_nothing_knows_the_toy_before_it_is_registered()
    assert not hasattr(fo, "signum")
    assert registered_nowhere("signum")
    with pytest.raises(KeyError, match="not added by register_algorithm"):
        fo.unregister_algorithm("adam")


def registered_nowhere(name: str) -> bool:
    return name not in BY_NAME and all(a.name != name for a in fo.ALGORITHMS)


def test_bad_entries_are_refused_before_anything_changes(registered: fo.Algorithm) -> None:
    before = (tuple(fo.ALGORITHMS), list(fo.__all__), dir(fo))
    with pytest.raises(ValueError, match="already registered"):
        fo.register_algorithm(SIGNUM)
    short = SIGNUM.kernel_args[:-1]
    with pytest.raises(ValueError, match="takes 8 arguments but its entry declares 7"):
        fo.register_algorithm(_renamed(kernel_args=short))
    with pytest.raises(ValueError, match="has no field 'nu'"):
        fo.register_algorithm(_renamed(kernel_args=(*short[:2], state("nu"), *short[3:], IMPL)))
    clash = {ScaleBySignumState: {"count": "step", "mu": "exp_avg"}}
    with pytest.raises(ValueError, match="conflict"):
        fo.register_algorithm(_renamed(state_names=clash))

    # a part named like a static export (another object) is refused
    class ScaleByAdamState(NamedTuple):  # not fo.ScaleByAdamState
        count: PyTree
        mu: PyTree

    taken = {ScaleByAdamState: {"count": "step", "mu": "buf"}}
    with pytest.raises(ValueError, match=r"functional_optim\.ScaleByAdamState is already taken"):
        fo.register_algorithm(_renamed(state_type=ScaleByAdamState, state_names=taken))
    # ... and so is one another run-time algorithm exports
    with pytest.raises(ValueError, match=r"functional_optim\.scale_by_signum is already taken"):
        fo.register_algorithm(_renamed(transform=_other_scale_by_signum()))
    assert (tuple(fo.ALGORITHMS), list(fo.__all__), dir(fo)) == before
    assert registered_nowhere("signum2")


def _other_scale_by_signum() -> Any:
    def scale_by_signum(beta: float) -> GradientTransformation:
        raise NotImplementedError

    return scale_by_signum


def _renamed(**changes: Any) -> fo.Algorithm:
    import dataclasses

    return dataclasses.replace(SIGNUM, name="signum2", torch_name="Signum2", alias=None, **changes)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_parity_tables_run_the_toy_against_torch(
    registered: fo.Algorithm, dtype: torch.dtype
) -> None:
    entry = entry_for(registered)
    combos = entry.combos()
    assert {tuple(sorted(kw.items())) for kw in combos} >= {
        (("beta", 0.5), ("lr", 0.1), ("maximize", True))
    }
    assert len(combos) == 2 * 3 * 2  # lr x beta x maximize, drawn from the declarations
    assert set(strategies("signum")) == set(inspect.signature(registered.alias).parameters)
    params = entry.params(dtype)
    grads = make_grads(params, 5, none_every=3)
    rtol, atol = TOL[dtype]
    for kw in combos:
        expected = run_torch(entry.torch_cls, params, grads, **entry.step_path, **kw)
        p, st_step = run_step(entry.alias(**kw), params, grads)  # the generated fused step
        assert_tensors_equal(tree_leaves(p), expected.params, what="step params")
        assert_states_equal(torch_states(st_step, p), expected.states)
        p, st_pure = run_pure(entry.alias(**kw), params, grads)
        assert_tensors_equal(tree_leaves(p), expected.params, rtol, atol, what="pure params")
        assert_states_equal(torch_states(st_pure, p), expected.states, rtol, atol)
