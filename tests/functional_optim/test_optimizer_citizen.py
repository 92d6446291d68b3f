"""``fo.Optimizer`` where PyTorch tools plug in: live ``state``, deepcopy and pickle, LR
schedulers on chains and optax-named aliases, DCP's state-dict helpers, ``differentiable``.

Each behaviour is compared with torch.optim's class on the same inputs.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import functional_optim as fo

from ._parity import SHAPES, make_params

Factory = Callable[[list[Tensor]], torch.optim.Optimizer]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
    ).double()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _params(model: torch.nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list[Tensor], b: list[Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- opt.state is live -----------------------------------------------------------------------


def test_state_is_empty_before_the_first_step_and_live_after_it() -> None:
    model, ref = _model(), _model()
    ours = fo.Optimizer(model.parameters(), fo.adamw(lr=1e-2))
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    assert len(ours.state) == 0
    assert not ours.state
    _train(model, ours, 1)
    _train(ref, theirs, 1)
    assert len(ours.state) == len(theirs.state) == 4
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p in ours.state
        assert sorted(ours.state[p]) == sorted(theirs.state[q])
        torch.testing.assert_close(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"])
    _train(model, ours, 2, seed=2)
    _train(ref, theirs, 2, seed=2)
    p, q = next(iter(model.parameters())), next(iter(ref.parameters()))
    assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == 3.0
    torch.testing.assert_close(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"])


def test_state_buffers_are_the_optimizers_own() -> None:
    """Writing into a state tensor changes the next step, as with torch."""
    model = _model()
    opt = fo.Optimizer(model.parameters(), fo.sgd(lr=0.1, momentum=0.9))
    _train(model, opt, 1)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"].zero_()
    before = _params(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    _assert_same(_params(model), before)  # zero momentum and zero gradient: no change


# -- deepcopy and pickle ----------------------------------------------------------------------

TRANSFORMS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "adamw": lambda: fo.adamw(lr=1e-2),
    "sgd-momentum": lambda: fo.sgd(lr=0.05, momentum=0.9, nesterov=True),
    "lion": lambda: fo.lion(1e-3),
    "chain": lambda: fo.chain(fo.clip_by_global_norm(0.5), fo.adamw(lr=1e-2)),
    "optax-chain": lambda: fo.chain(fo.scale_by_adam(), fo.scale(-1e-2)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_steps_on_like_the_original(name: str, how: str) -> None:
    model = _model()
    opt = fo.Optimizer(model.parameters(), TRANSFORMS[name]())
    _train(model, opt, 2)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    else:
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    assert [id(p) for p in opt2.param_groups[0]["params"]] == [id(p) for p in model2.parameters()]
    _train(model, opt, 3, seed=5)
    _train(model2, opt2, 3, seed=5)
    _assert_same(_params(model2), _params(model))


def test_pickling_a_transform_without_a_recorded_factory_says_why() -> None:
    def init(params: Any) -> fo.EmptyState:
        return fo.EmptyState()

    def update(updates: Any, state: Any, params: Any = None, *, inplace: bool = False) -> Any:
        return updates, state

    handmade = fo.GradientTransformation(init, update)
    opt = fo.Optimizer([torch.nn.Parameter(torch.ones(2))], handmade)
    with pytest.raises(pickle.PicklingError, match="transform_factory"):
        pickle.dumps(opt)
    assert copy.deepcopy(opt).transform is handmade  # deepcopy shares the (immutable) transform


# -- LR schedulers ----------------------------------------------------------------------------


def _scheduled(factory: Factory, steps: int = 4) -> list[Tensor]:
    model = _model()
    opt = factory(list(model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return _params(model)


def test_step_lr_drives_an_alias_inside_a_chain() -> None:
    torch_run = _scheduled(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True))
    ours = _scheduled(lambda ps: fo.Optimizer(ps, fo.chain(fo.identity(), fo.adamw(lr=0.1))))
    _assert_same(ours, torch_run)


def test_step_lr_drives_an_injected_factory_that_builds_an_alias() -> None:
    """The README's recipe: ``inject_hyperparams(lambda lr: chain(..., adamw(lr=lr)))``. The
    new lr reaches the AdamW built inside (it was ignored before)."""

    def factory(lr: float) -> fo.GradientTransformation:
        return fo.chain(fo.identity(), fo.adamw(lr=lr))

    torch_run = _scheduled(lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True))
    ours = _scheduled(lambda ps: fo.Optimizer(ps, fo.inject_hyperparams(factory)(lr=0.1)))
    _assert_same(ours, torch_run)
    fixed = _model()
    _train(fixed, fo.Optimizer(fixed.parameters(), fo.adamw(lr=0.1)), 4, seed=3)
    assert any(not torch.equal(a, b) for a, b in zip(ours, _params(fixed), strict=True))


def test_an_ambiguous_lr_is_not_exposed_so_a_scheduler_cannot_half_apply() -> None:
    tx = fo.multi_transform({"a": fo.adamw(lr=0.1), "b": fo.sgd(lr=0.2)}, lambda params: ["a", "b"])
    opt = fo.Optimizer([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))], tx)
    assert "lr" not in opt.param_groups[0]
    with pytest.raises(KeyError, match="lr"):
        torch.optim.lr_scheduler.StepLR(opt, step_size=1)


# -- DCP's state-dict helpers -----------------------------------------------------------------


def test_dcp_get_optimizer_state_dict_leaves_the_run_alone_and_resumes_exactly() -> None:
    """DCP initialises empty optimizer state by stepping with lr=0; after a zero_grad our
    state must already be visible so it does not (torch: no drift either)."""
    plain, probed = _model(), _model()
    opt_plain = fo.Optimizer(plain.parameters(), fo.adamw(lr=1e-2))
    opt_probed = fo.Optimizer(probed.parameters(), fo.adamw(lr=1e-2))
    _train(plain, opt_plain, 3)
    _train(probed, opt_probed, 3)
    opt_probed.zero_grad()
    saved = copy.deepcopy(get_optimizer_state_dict(probed, opt_probed))  # live tensors
    _train(plain, opt_plain, 2, seed=9)
    _train(probed, opt_probed, 2, seed=9)
    _assert_same(_params(probed), _params(plain))

    resumed = _model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), _model().parameters(), strict=True):
            p.copy_(q)
    again = _model()
    opt_again = fo.Optimizer(again.parameters(), fo.adamw(lr=1e-2))
    _train(again, opt_again, 3)
    opt_resumed = fo.Optimizer(resumed.parameters(), fo.adamw(lr=1e-2))
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), again.parameters(), strict=True):
            p.copy_(q)
    set_optimizer_state_dict(resumed, opt_resumed, saved)
    _train(again, opt_again, 2, seed=9)
    _train(resumed, opt_resumed, 2, seed=9)
    _assert_same(_params(resumed), _params(again))


# -- torch's constructor flags reach the step -------------------------------------------------


def test_differentiable_steps_record_a_graph_like_torch() -> None:
    def run(make: Callable[[list[Tensor]], torch.optim.Optimizer]) -> tuple[Tensor, Tensor]:
        leaf = torch.ones(3, dtype=torch.float64, requires_grad=True)
        p = leaf.clone()  # a non-leaf param, as torch's differentiable tests use
        grad = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
        opt = make([p])
        for _ in range(2):
            p.grad = grad.clone()
            opt.step()
        (dgrad,) = torch.autograd.grad(p.sum(), grad)
        return p.detach(), dgrad

    for kwargs in ({"momentum": 0.9}, {"momentum": 0.0, "weight_decay": 0.1}):
        ours = run(
            lambda ps, kw=kwargs: fo.Optimizer(ps, fo.sgd(lr=0.1, differentiable=True, **kw))
        )
        theirs = run(lambda ps, kw=kwargs: torch.optim.SGD(ps, lr=0.1, differentiable=True, **kw))
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b)


def test_param_groups_carry_torchs_keys_and_values() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    for ours, theirs in (
        (fo.adamw(lr=1e-3), torch.optim.AdamW([p], lr=1e-3)),
        (fo.sgd(lr=0.1, momentum=0.9), torch.optim.SGD([p], lr=0.1, momentum=0.9)),
    ):
        group = fo.Optimizer([p], ours).state_dict()["param_groups"][0]
        expected = theirs.state_dict()["param_groups"][0]
        assert {k: v for k, v in group.items() if k != "fo_state"} == expected


def _pickle_cases() -> dict[str, Callable[[], fo.GradientTransformation]]:
    from ._alias_registry import CASE_TABLES
    from .test_optax_aliases import CASES
    from .test_optax_transforms import TRANSFORMS as OPTAX_TRANSFORMS
    from .test_transforms import TRANSFORMS as CORE_TRANSFORMS

    out: dict[str, Callable[[], fo.GradientTransformation]] = {}
    for name, (base, _) in CASE_TABLES.items():
        if hasattr(fo, name):
            out[f"alias:{name}"] = lambda name=name, base=base: getattr(fo, name)(**base)
    out.update({f"optax-alias:{k}": v[0] for k, v in CASES.items()})
    out.update({f"optax:{k}": v for k, v in OPTAX_TRANSFORMS.items()})
    out.update({f"core:{k}": v for k, v in CORE_TRANSFORMS.items()})
    return out


@pytest.mark.parametrize(("name", "make"), sorted(_pickle_cases().items()))
def test_every_factory_pickles_to_the_same_maths(
    name: str, make: Callable[[], fo.GradientTransformation]
) -> None:
    """A transform made again from its recorded call gives the same updates (the recipe key
    tells apart transforms that share an ``init``, as stateless ones do)."""
    tx = make()
    try:
        again = pickle.loads(pickle.dumps(tx))
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        reason = str(err)  # a schedule or a mask given as a closure: that argument cannot pickle
    else:
        reason = ""
    if reason:
        assert "local object" in reason or "lambda" in reason, reason
        return
    # the five shapes the masks are written for; matrices for Muon
    shapes = ((3, 2), (4, 5)) if "muon" in name else SHAPES
    params = make_params(shapes, dtype=torch.float64)
    out = []
    for t in (tx, again):
        state = t.init(params)
        grads = make_params(shapes, dtype=torch.float64, seed=1)
        updates, state = t.update(grads, state, params)
        updates, _ = t.update(grads, state, params)
        out.append(updates)
    _assert_same(out[1], out[0])
