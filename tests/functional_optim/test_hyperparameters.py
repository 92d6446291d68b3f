"""Every hyperparameter of every registered algorithm, drawn by Hypothesis, against torch.optim.

For each algorithm in ``fo.ALGORITHMS`` a draw sets every argument of its alias (a mutant that
hard-codes ``eps``, ignores ``etas`` or swaps the betas fails here). Float64, several steps,
some ``None`` gradients:

* the fused ``step`` is BITWISE equal to torch (``fused=True`` where torch has a fused CPU
  kernel, else ``foreach=False``), state included;
* the pure ``update`` path matches ``foreach=False`` within the documented tolerance;
* the ``FunctionalX`` class (when scriptable) is bitwise equal to torch on the same
  hyperparameters, on its default path (``fused=True`` / ``foreach=False`` twin) and with
  ``foreach=True``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_optim as fo
from functional_optim._tree import tree_leaves

from ._alias_registry import BY_NAME
from ._hyper_strategies import hyperparameters, strategies
from ._parity import assert_states_equal, assert_tensors_equal, make_grads, run_torch
from .test_aliases import TOL, run_pure, run_step, torch_states

ALGORITHMS = {a.name: a for a in fo.ALGORITHMS}
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: torch's implementation switches: test_optim_db.py crosses them with torch's optim_db configs
#: (here they keep their defaults: the step takes the fastest path, compared with torch's twin).
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_table_draws_every_argument(name: str) -> None:
    arguments = set(inspect.signature(ALGORITHMS[name].alias).parameters)
    assert set(strategies(name)) == arguments - IMPLEMENTATION_FLAGS


def _torch_cls(name: str) -> type[torch.optim.Optimizer]:
    cls: type[torch.optim.Optimizer] = getattr(torch.optim, ALGORITHMS[name].torch_name)
    return cls


def _torch_impl(name: str) -> dict[str, bool]:
    return BY_NAME[name].step_path


def _seen_states(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> tuple[Any, Any]:
    """The state dicts of the params that had a gradient (torch creates state lazily; our
    transforms create it at ``init``)."""
    keep = [i for i, s in enumerate(theirs) if s]
    return [ours[i] for i in keep], [theirs[i] for i in keep]


def _none_every(name: str, kw: dict[str, Any]) -> int:
    # torch's fused SGD fails when only some momentum buffers exist: no None grads there.
    return 0 if name == "sgd" and kw["momentum"] else 3


@pytest.mark.parametrize(
    "name", sorted(n for n, a in ALGORITHMS.items() if not (a.sparse_grads or a.needs_closure))
)
@SETTINGS
@given(data=st.data(), steps=st.integers(4, 12), seed=st.integers(0, 2**16))
def test_every_hyperparameter_matches_torch(
    name: str, data: st.DataObject, steps: int, seed: int
) -> None:
    kw = data.draw(hyperparameters(name), label="hyperparameters")
    params = BY_NAME[name].params(torch.float64, seed=seed)
    grads = make_grads(params, steps, seed=seed + 1, none_every=_none_every(name, kw))
    tx = ALGORITHMS[name].alias(**kw)

    fused = run_torch(_torch_cls(name), params, grads, **_torch_impl(name), **kw)
    p, state = run_step(tx, params, grads)
    assert_tensors_equal(tree_leaves(p), fused.params, what="step params")
    assert_states_equal(*_seen_states(torch_states(state, p), fused.states))

    loop = run_torch(_torch_cls(name), params, grads, **BY_NAME[name].loop, **kw)
    p, state = run_pure(tx, params, grads)
    rtol, atol = TOL[torch.float64]
    assert_tensors_equal(tree_leaves(p), loop.params, rtol, atol, what="pure params")
    assert_states_equal(*_seen_states(torch_states(state, p), loop.states), rtol, atol)


def _functional_kwargs(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    """The alias's hyperparameters as the ``FunctionalX`` constructor takes them."""
    functional = ALGORITHMS[name].functional
    assert functional is not None
    accepted = set(inspect.signature(functional.__init__).parameters)
    return {k: v for k, v in kw.items() if k in accepted}


@pytest.mark.parametrize(
    "name", sorted(n for n, a in ALGORITHMS.items() if a.functional is not None)
)
@SETTINGS
@given(data=st.data(), steps=st.integers(6, 12), seed=st.integers(0, 2**16))
def test_functional_class_every_hyperparameter(
    name: str, data: st.DataObject, steps: int, seed: int
) -> None:
    functional = ALGORITHMS[name].functional
    assert functional is not None
    kw = data.draw(hyperparameters(name), label="hyperparameters")
    accepted = _functional_kwargs(name, kw)
    # torch's _FunctionalX may lack an alias argument: run torch with its default then.
    kw = {k: v for k, v in kw.items() if k in accepted}
    params = BY_NAME[name].params(torch.float64, seed=seed)
    grads = make_grads(params, steps, seed=seed + 1, none_every=_none_every(name, kw))
    for impl in BY_NAME[name].paths:
        expected = run_torch(_torch_cls(name), params, grads, **impl, **kw)
        ours = [p.clone() for p in params]
        opt = functional(ours, **accepted, **impl)
        for row in grads:
            opt.step([None if g is None else g.clone() for g in row])
        assert_tensors_equal(ours, expected.params, what=f"functional params {impl}")
