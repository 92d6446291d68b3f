"""``fo.Optimizer.load_state_dict`` checks the whole dict before it changes anything (issue 25,
item 2).

Before, a state dict of another algorithm (torch's SGD into ``fo.adam``) loaded as step 0 with
zero moments and replaced the group's hyperparameters, a missing ``exp_avg`` was zero-filled,
``step="abc"`` was taken and failed later, and a moment of the wrong size reached the fused
kernel (heap corruption at the next ``step()``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import NAMESPACE

from ._alias_registry import BY_NAME, REGISTRY, Entry
from ._parity import assert_tensors_equal

Mutation = Callable[[dict[str, Any]], None]
#: torch's SGD with momentum: a per-param ``momentum_buffer``, no ``step``
SGD = BY_NAME["sgd"]._replace(base={"lr": 0.1, "momentum": 0.9})


def state_tensors(state: Any) -> list[Tensor]:
    """Every tensor of a transform state but its hyperparameters."""
    if isinstance(state, fo.InjectHyperparamsState):
        state = state.inner_state
    leaves = optree.tree_leaves(state, none_is_leaf=True, namespace=NAMESPACE)
    return [x for x in leaves if isinstance(x, Tensor)]


def _stepped(tx: fo.GradientTransformation, n: int = 2) -> tuple[fo.Optimizer, list[Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen).requires_grad_() for _ in range(n)]
    opt = fo.Optimizer(params, tx)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt, params


#: flags under which an algorithm keeps every per-param buffer it has
FULL_STATE: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0.9},
    "rmsprop": {"momentum": 0.9, "centered": True},
    "adam": {"amsgrad": True},
    "adamw": {"amsgrad": True},
}


def _hyper(entry: Entry) -> dict[str, Any]:
    return {**entry.base, **FULL_STATE.get(entry.name, {})}


def _torch_state_dict(entry: Entry, params: list[Tensor]) -> dict[str, Any]:
    """torch's own optimizer's state dict after one step from ``params``."""
    leaves = [p.detach().clone().requires_grad_() for p in params]
    opt = entry.torch_cls(leaves, **_hyper(entry))
    gen = torch.Generator().manual_seed(1)
    for p in leaves:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return copy.deepcopy(opt.state_dict())


class Unchanged:
    """Everything ``load_state_dict`` could change, to compare after a refused load."""

    def __init__(self, opt: fo.Optimizer, params: list[Tensor]) -> None:
        self.opt, self.params = opt, params
        self.tensors = self._tensors()
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        self.state_keys = {id(p): sorted(opt.state.get(p, {})) for p in params}

    def _tensors(self) -> list[Tensor]:
        live = [t for s in self.opt.transform_states for t in state_tensors(s)]
        return [t.detach().clone() for t in [*self.params, *live]]

    def check(self) -> None:
        assert_tensors_equal(self._tensors(), self.tensors, what="params and state")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        assert groups == self.groups
        assert {id(p): sorted(self.opt.state.get(p, {})) for p in self.params} == self.state_keys


def _refused(
    opt: fo.Optimizer,
    params: list[Tensor],
    state_dict: dict[str, Any],
    error: type[Exception],
    match: str | None = None,
) -> None:
    before = Unchanged(opt, params)
    with pytest.raises(error, match=match):
        opt.load_state_dict(state_dict)
    before.check()
    opt.step()  # and it still steps


def test_torch_sgd_state_into_adam_raises_torchs_key_error() -> None:
    opt, params = _stepped(fo.adam(lr=0.1))
    _refused(opt, params, _torch_state_dict(SGD, params), KeyError, match="'step'")


def _mutated(state_dict: dict[str, Any], mutate: Mutation) -> dict[str, Any]:
    out = copy.deepcopy(state_dict)
    mutate(out["state"][1])
    return out


#: (what, mutation of param 1's entry, error, message)
ADAM_CASES: list[tuple[str, Mutation, type[Exception], str]] = [
    ("missing exp_avg", lambda s: s.pop("exp_avg"), KeyError, "'exp_avg'"),
    ("missing step", lambda s: s.pop("step"), KeyError, "'step'"),
    ("step 'abc'", lambda s: s.update(step="abc"), ValueError, "must be a number"),
    ("step of 2 values", lambda s: s.update(step=torch.ones(2)), RuntimeError, "one number"),
    ("exp_avg a list", lambda s: s.update(exp_avg=[0.0] * 12), TypeError, "not a tensor"),
    ("exp_avg too small", lambda s: s.update(exp_avg=torch.zeros(2)), RuntimeError, "size of"),
    ("exp_avg_sq too big", lambda s: s.update(exp_avg_sq=torch.zeros(13)), RuntimeError, "size"),
    ("exp_avg reshaped", lambda s: s.update(exp_avg=torch.zeros(3, 4)), RuntimeError, "size of"),
]


@pytest.mark.parametrize(
    ("what", "mutate", "error", "match"), ADAM_CASES, ids=[c[0] for c in ADAM_CASES]
)
def test_a_bad_adam_entry_is_refused_before_anything_changes(
    what: str, mutate: Mutation, error: type[Exception], match: str
) -> None:
    opt, params = _stepped(fo.adam(lr=0.1))
    good = copy.deepcopy(opt.state_dict())
    _refused(opt, params, _mutated(good, mutate), error, match)


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_every_algorithm_refuses_a_missing_or_resized_entry_of_torchs_state(entry: Entry) -> None:
    """torch's own state dict, one entry removed or resized, into the alias.

    A buffer the transform creates lazily (a momentum buffer) may be absent: it is created as
    on a param's first step (torch's SGD does the same; its RMSprop raises a KeyError there).
    """
    gen = torch.Generator().manual_seed(2)
    shapes = entry.shapes[-2:]
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    opt = fo.Optimizer(params, entry.alias(**_hyper(entry)))
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    theirs = _torch_state_dict(entry, params)
    opt.load_state_dict(copy.deepcopy(theirs))  # torch's own state loads
    entry_1 = theirs["state"][1]
    fresh = fo.to_torch_state(entry.alias(**_hyper(entry)).init(params), params)[0][1]
    assert entry_1
    for key, value in entry_1.items():
        missing = _mutated(theirs, lambda s, k=key: s.pop(k))
        if key in fresh and len(entry_1) > 1:  # else lazy, or no entry left (never stepped)
            _refused(opt, params, missing, KeyError, match=repr(key))
        if isinstance(value, Tensor) and value.dim() > 0:
            resized = _mutated(theirs, lambda s, k=key: s.update({k: torch.zeros(1, 1, 1)}))
            _refused(opt, params, resized, RuntimeError, match="size of")


def test_a_numeric_step_loads_as_torch_takes_it() -> None:
    opt, params = _stepped(fo.adam(lr=0.1))
    state_dict = _mutated(opt.state_dict(), lambda s: s.update(step=3))
    opt.load_state_dict(state_dict)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()["state"]
    assert float(saved[1]["step"]) == 4.0
    assert float(saved[0]["step"]) == 2.0


def test_params_without_state_load_as_never_stepped() -> None:
    """torch creates state at a param's first step: an entry-less param is fine."""
    opt, _ = _stepped(fo.adam(lr=0.1))
    state_dict = copy.deepcopy(opt.state_dict())
    del state_dict["state"][1]
    opt.load_state_dict(state_dict)
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0


def test_a_lazily_created_buffer_may_be_absent_but_not_resized() -> None:
    opt, params = _stepped(fo.sgd(lr=0.1, momentum=0.9))
    good = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(_mutated(good, lambda s: s.pop("momentum_buffer")))
    bad = _mutated(good, lambda s: s.update(momentum_buffer=torch.zeros(2)))
    _refused(opt, params, bad, RuntimeError, match="size of state 'momentum_buffer'")


def test_mismatched_groups_raise_torchs_value_error_untouched() -> None:
    opt, params = _stepped(fo.adam(lr=0.1))
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["param_groups"][0]["params"] = [0]
    _refused(opt, params, state_dict, ValueError, match="doesn't match the size")


def test_missing_hyperparameters_keep_the_current_values() -> None:
    """torch SGD's groups have no ``betas``: the loaded group keeps Adam's."""
    opt, params = _stepped(fo.adam(lr=0.1, betas=(0.8, 0.9)))
    sgd = torch.optim.SGD([p.detach().clone().requires_grad_() for p in params], lr=0.5)
    opt.load_state_dict(sgd.state_dict())  # no momentum: no per-param state
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.9)
    assert group["lr"] == 0.5
    opt.step()


def test_the_check_sees_what_the_pre_hooks_return() -> None:
    """torch checks a state dict after its load pre-hooks; so does the validation."""
    opt, _ = _stepped(fo.adam(lr=0.1))
    good = copy.deepcopy(opt.state_dict())
    renamed = _mutated(good, lambda s: s.update(m=s.pop("exp_avg")))

    def rename(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        entry = state_dict["state"][1]
        entry["exp_avg"] = entry.pop("m")

    handle = opt.register_load_state_dict_pre_hook(rename)
    opt.load_state_dict(renamed)
    handle.remove()
    assert_tensors_equal([opt.state_dict()["state"][1]["exp_avg"]], [good["state"][1]["exp_avg"]])
