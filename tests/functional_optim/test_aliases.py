"""The eight aliases against torch.optim, table-driven (one registry, every flag combination).

Three paths per case, on a nested pytree (dict / list / tuple / namedtuple) with some ``None``
gradients, float32 and float64:

* pure ``update`` + ``apply_updates``: matches ``torch.optim.X(foreach=False)`` within
  ``TOL`` (same ops in the same order up to where the learning rate is applied, so rounding
  differs by a few ulps), and never mutates its inputs;
* ``update(inplace=True)`` + ``apply_updates(inplace=True)``: the same numbers, state buffers
  reused;
* the fused ``step``: within ``TOL`` of ``foreach=False``, and BITWISE equal to torch's fused
  CPU kernel (``fused=True``) where torch has
  one (sgd, adam, adamw, adagrad), else to ``foreach=False``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import tree_leaves

from ._alias_registry import BY_NAME, REGISTRY, all_cases, case_id
from ._parity import (
    FLOAT_DTYPES,
    assert_states_equal,
    assert_tensors_equal,
    clone_tensors,
    make_grads,
    make_params,
    run_torch,
)

#: Documented tolerance of the pure / in-place paths against torch (rtol, atol).
TOL = {torch.float32: (2e-6, 1e-7), torch.float64: (1e-12, 1e-14)}

Point = namedtuple("Point", ["x", "y"])
CASES = all_cases()
IDS = [case_id(n, kw) for n, kw in CASES]


def to_tree(leaves: list[Any]) -> Any:
    """Five leaves as a nested pytree (leaf order = list order)."""
    return {"a": [leaves[0], (leaves[1], leaves[2])], "b": Point(leaves[3], leaves[4])}


def run_pure(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Any]) -> Any:
    p = to_tree(clone_tensors(params))
    state = tx.init(p)
    for row in grads:
        g = to_tree(row)
        inputs = [x for x in tree_leaves((p, g, state)) if isinstance(x, Tensor)]
        before = [x.clone() for x in inputs]
        updates, state_new = tx.update(g, state, p)
        assert_tensors_equal(inputs, before, what="pure-path input")
        p = fo.apply_updates(p, updates)
        state = state_new
    return p, state


def run_inplace(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Any]) -> Any:
    p = to_tree(clone_tensors(params))
    p_ids = [id(x) for x in tree_leaves(p)]
    state = tx.init(p)
    for step, row in enumerate(grads):
        old = {id(x) for x in tree_leaves(state) if isinstance(x, Tensor)}
        updates, state = tx.update(to_tree(clone_tensors(row)), state, p, inplace=True)
        out = fo.apply_updates(p, updates, inplace=True)
        assert [id(x) for x in tree_leaves(out)] == p_ids
        new = {id(x) for x in tree_leaves(state) if isinstance(x, Tensor)}
        if step >= 3:  # every param has had a gradient by now: no new buffers
            assert new == old, "in-place update created new state tensors"
    return p, state


def run_step(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Any]) -> Any:
    assert tx.step is not None
    p = to_tree(clone_tensors(params))
    state = tx.init(p)
    for row in grads:
        state = tx.step(p, to_tree(clone_tensors(row)), state)
    return p, state


def torch_states(state: Any, p: Any) -> list[dict[str, Any]]:
    per_param, _ = fo.to_torch_state(state, p)
    return per_param


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("name", "kw"), CASES, ids=IDS)
def test_pure_and_inplace_match_torch(name: str, kw: dict[str, Any], dtype: torch.dtype) -> None:
    entry = BY_NAME[name]
    params = entry.params(dtype)
    grads = make_grads(params, 7, none_every=3)
    expected = run_torch(entry.torch_cls, params, grads, **entry.loop, **kw)
    rtol, atol = TOL[dtype]
    tx = entry.alias(**kw)
    for run in (run_pure, run_inplace, run_step):
        p, state = run(tx, params, grads)
        assert_tensors_equal(tree_leaves(p), expected.params, rtol, atol, what=run.__name__)
        assert_states_equal(torch_states(state, p), expected.states, rtol, atol)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(("name", "kw"), CASES, ids=IDS)
def test_fused_step_bitwise_equal_to_torch(
    name: str, kw: dict[str, Any], dtype: torch.dtype
) -> None:
    entry = BY_NAME[name]
    params = entry.params(dtype)
    # torch's fused SGD fails when only some momentum buffers exist (None grads): no None there.
    none_every = 0 if name == "sgd" and kw["momentum"] else 3
    grads = make_grads(params, 7, none_every=none_every)
    impl = entry.step_path
    expected = run_torch(entry.torch_cls, params, grads, **impl, **kw)
    p, state = run_step(entry.alias(**kw), params, grads)
    assert_tensors_equal(tree_leaves(p), expected.params, what="step params")
    assert_states_equal(torch_states(state, p), expected.states)


@settings(max_examples=16)
@given(
    index=st.integers(0, len(REGISTRY) - 1),
    steps=st.integers(1, 30),
    none_every=st.sampled_from([0, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_any_step_count(index: int, steps: int, none_every: int, seed: int) -> None:
    entry = REGISTRY[index]
    kw = entry.combos()[seed % len(entry.combos())]
    params = entry.params(torch.float64, seed=seed)
    grads = make_grads(params, steps, seed=seed + 1, none_every=none_every)
    expected = run_torch(entry.torch_cls, params, grads, **entry.loop, **kw)
    p, _ = run_pure(entry.alias(**kw), params, grads)
    rtol, atol = TOL[torch.float64]
    assert_tensors_equal(tree_leaves(p), expected.params, rtol, atol)


# --- validation: same exception types and messages as torch -----------------------------------

BAD_HYPERPARAMETERS = [
    ("sgd", {"lr": -1}),
    ("sgd", {"momentum": -0.5}),
    ("sgd", {"weight_decay": -1.0}),
    ("sgd", {"nesterov": True}),
    ("sgd", {"nesterov": True, "momentum": 0.9, "dampening": 0.1}),
    ("sgd", {"lr": torch.tensor([0.1, 0.2])}),
    ("adam", {"lr": -1e-3}),
    ("adam", {"eps": -1.0}),
    ("adam", {"betas": (1.0, 0.999)}),
    ("adam", {"betas": (0.9, -0.1)}),
    ("adam", {"weight_decay": -1}),
    ("adam", {"betas": (0, 0.999)}),
    ("adamw", {"betas": (torch.tensor(0.9), 0.999)}),
    ("adagrad", {"lr_decay": -1}),
    ("adagrad", {"initial_accumulator_value": -1}),
    ("adagrad", {"eps": -1}),
    ("adadelta", {"rho": 1.5}),
    ("adadelta", {"lr": -0.1}),
    ("adamax", {"betas": (0.9, 1.0)}),
    ("adamax", {"eps": -1}),
    ("rmsprop", {"alpha": -1}),
    ("rmsprop", {"momentum": -1}),
    ("rmsprop", {"eps": -1}),
    ("rprop", {"etas": (1.5, 1.2)}),
    ("rprop", {"lr": -2}),
    ("nadam", {"momentum_decay": -1}),
    ("nadam", {"betas": (0.9, 1.0)}),
    ("nadam", {"eps": -1}),
    ("radam", {"betas": (-0.1, 0.9)}),
    ("radam", {"weight_decay": -1}),
    ("asgd", {"lr": -1}),
    ("muon", {"lr": -1}),
    ("muon", {"momentum": -0.1}),
    ("muon", {"weight_decay": -1}),
    ("muon", {"adjust_lr_fn": "rms"}),
    ("adafactor", {"lr": -1}),
    ("adafactor", {"beta2_decay": 0.5}),
    ("adafactor", {"eps": (-1.0, 1e-3)}),
    ("adafactor", {"eps": (None, -1.0)}),
    ("adafactor", {"d": 0.5}),
    ("adafactor", {"weight_decay": -1}),
    ("asgd", {"weight_decay": -0.5}),
]


@pytest.mark.parametrize(("name", "bad"), BAD_HYPERPARAMETERS)
def test_validation_matches_torch(name: str, bad: dict[str, Any]) -> None:
    entry = BY_NAME[name]
    with pytest.raises(Exception) as torch_err:
        entry.torch_cls([torch.zeros(2, requires_grad=True)], **bad)
    with pytest.raises(type(torch_err.value)) as ours:
        entry.alias(**bad)
    assert str(ours.value) == str(torch_err.value)


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_defaults_match_torch(entry: Any) -> None:
    import inspect

    ours = inspect.signature(entry.alias).parameters
    theirs = inspect.signature(entry.torch_cls.__init__).parameters
    for name, param in ours.items():
        assert name in theirs, f"{entry.name}: torch has no argument {name!r}"
        assert param.default == theirs[name].default, f"{entry.name}.{name}"
    params = entry.params(torch.float32)[:1]
    state = entry.alias().init(params)
    # torch's param-group keys: its arguments, and AdamW's decoupled_weight_decay=True
    groups = entry.torch_cls([p.clone() for p in params]).param_groups
    assert set(state.hyperparams) == set(groups[0]) - {"params"}


def test_schedule_lr_in_alias_matches_manual_lr() -> None:
    """A schedule as lr: pure path and fused step agree with per-step torch lr changes."""
    sched = fo.linear_schedule(0.1, 0.01, 5)
    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 6)
    tx = fo.sgd(lr=sched, momentum=0.9)
    p_pure, _ = run_pure(tx, params, grads)
    p_step, _ = run_step(tx, params, grads)
    leaves = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.SGD(leaves, lr=0.1, momentum=0.9, foreach=False)
    for t, row in enumerate(grads):
        opt.param_groups[0]["lr"] = float(sched(t))
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g
        opt.step()
    expected = [x.detach() for x in leaves]
    assert_tensors_equal(tree_leaves(p_step), expected)
    assert_tensors_equal(tree_leaves(p_pure), expected, *TOL[torch.float64])
