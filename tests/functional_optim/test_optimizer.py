"""fo.Optimizer: torch parity, fallback path, state_dict round trip, LR schedulers, groups."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo

from ._alias_registry import REGISTRY, Entry
from ._parity import assert_states_equal, assert_tensors_equal, make_grads, make_params

TOL64 = (1e-12, 1e-14)


def leaves_of(params: list[Tensor]) -> list[Tensor]:
    return [p.detach().clone().requires_grad_(True) for p in params]


def drive(opt: torch.optim.Optimizer, leaves: list[Tensor], grads: list[list[Any]]) -> None:
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        opt.step()


def drive_with_step_lr(
    pairs: list[tuple[torch.optim.Optimizer, list[Tensor]]],
    grads: list[list[Any]],
    step_size: int,
) -> list[list[float]]:
    """Step every ``(optimizer, leaves)`` on each row of ``grads``, then its ``StepLR(step_size,
    gamma=0.5)``; return the learning rates of all optimizers after each step."""
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=step_size, gamma=0.5) for o, _ in pairs]
    lrs = []
    for row in grads:
        for o, leaves in pairs:
            drive(o, leaves, [row])
        for s in scheds:
            s.step()
        lrs.append([o.param_groups[0]["lr"] for o, _ in pairs])
    return lrs


def states(opt: torch.optim.Optimizer, leaves: list[Tensor]) -> list[dict[str, Any]]:
    sd = opt.state_dict()["state"]
    return [dict(sd.get(i, {})) for i in range(len(leaves))]


def example(entry: Entry) -> dict[str, Any]:
    return entry.combos()[-1]  # every flag at its last value (e.g. weight decay, maximize)


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_matches_torch_bitwise(entry: Entry) -> None:
    kw = example(entry)
    params = entry.params(torch.float32)
    none_every = 0 if entry.name == "sgd" else 3  # see test_aliases: torch's fused SGD limit
    grads = make_grads(params, 6, none_every=none_every)
    impl = entry.step_path
    ours, theirs = leaves_of(params), leaves_of(params)
    opt = fo.Optimizer(ours, entry.alias(**kw))
    ref = entry.torch_cls(theirs, **impl, **kw)
    drive(opt, ours, grads)
    drive(ref, theirs, grads)
    assert_tensors_equal(ours, theirs)
    assert_states_equal(states(opt, ours), states(ref, theirs))
    for name in kw:
        assert opt.param_groups[0][name] == ref.param_groups[0][name]


def test_generic_chain_uses_fallback_and_leaves_grads() -> None:
    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 5, none_every=2)
    # add_noise without its list maths: this chain has no step and runs the fallback.
    noise = fo.add_noise(0.01, 0.55, 0)._replace(lists=None)
    tx = fo.chain(fo.clip_by_global_norm(1.0), noise, fo.scale(-0.01))
    assert tx.step is None
    leaves = leaves_of(params)
    opt = fo.Optimizer(leaves, tx)
    p, state = [x.clone() for x in params], tx.init(params)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.clone()
        opt.step()
        for leaf, g in zip(leaves, row, strict=True):
            assert (leaf.grad is None) == (g is None)
            if g is not None:
                assert torch.equal(leaf.grad, g), "the fallback consumed p.grad"
        updates, state = tx.update(row, state, p)
        p = fo.apply_updates(p, updates)
    assert_tensors_equal(leaves, p, *TOL64)


def _round_trip(make_tx: Any, params: list[Tensor], grads: list[list[Any]]) -> None:
    first, rest = grads[:4], grads[4:]
    leaves = leaves_of(params)
    opt = fo.Optimizer(leaves, make_tx())
    drive(opt, leaves, first)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    resumed_leaves = leaves_of([x.detach() for x in leaves])
    resumed = fo.Optimizer(resumed_leaves, make_tx())
    resumed.load_state_dict(loaded)
    drive(opt, leaves, rest)
    drive(resumed, resumed_leaves, rest)
    assert_tensors_equal(resumed_leaves, leaves)
    assert_states_equal(states(resumed, resumed_leaves), states(opt, leaves))
    assert resumed.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_state_dict_round_trip_is_bit_identical(entry: Entry, dtype: torch.dtype) -> None:
    params = entry.params(dtype)
    grads = make_grads(params, 8, none_every=3)
    _round_trip(lambda: entry.alias(**example(entry)), params, grads)


def test_round_trip_with_schedule_and_generic_chain() -> None:
    params = make_params(dtype=torch.float32)
    grads = make_grads(params, 8, none_every=3)
    sched = fo.warmup_cosine_decay_schedule(0.0, 0.1, 2, 8)
    _round_trip(lambda: fo.adam(lr=sched), params, grads)
    _round_trip(
        lambda: fo.chain(fo.trace(0.9, 0.1), fo.scale_by_rms(), fo.scale_by_learning_rate(sched)),
        params,
        grads,
    )
    opt = fo.Optimizer(leaves_of(params), fo.adam(lr=sched))
    assert "fo_state" in opt.state_dict()["param_groups"][0]


def test_load_torch_state_dict_and_continue() -> None:
    params = make_params(dtype=torch.float32)
    grads = make_grads(params, 8)
    theirs = leaves_of(params)
    ref = torch.optim.Adam(theirs, lr=0.01, amsgrad=True, fused=True)
    drive(ref, theirs, grads[:4])
    ours = leaves_of([x.detach() for x in theirs])
    opt = fo.Optimizer(ours, fo.adam(lr=0.01, amsgrad=True))
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # live tensors would be shared
    drive(ref, theirs, grads[4:])
    drive(opt, ours, grads[4:])
    assert_tensors_equal(ours, theirs)


def test_step_lr_scheduler_reaches_the_transform() -> None:
    params = make_params(dtype=torch.float32)
    grads = make_grads(params, 7)
    ours, theirs = leaves_of(params), leaves_of(params)
    opt = fo.Optimizer(ours, fo.sgd(lr=0.1, momentum=0.9))
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, fused=True)
    for our_lr, torch_lr in drive_with_step_lr([(opt, ours), (ref, theirs)], grads, 2):
        assert our_lr == torch_lr
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert_tensors_equal(ours, theirs)


def test_step_lr_with_user_transform_through_inject_hyperparams() -> None:
    def my_sgd(lr: float) -> fo.GradientTransformation:
        return fo.chain(fo.trace(0.9), fo.scale_by_learning_rate(lr))

    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 5)
    ours, theirs = leaves_of(params), leaves_of(params)
    opt = fo.Optimizer(ours, fo.inject_hyperparams(my_sgd)(lr=0.1))
    ref = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=False)
    drive_with_step_lr([(opt, ours), (ref, theirs)], grads, 1)
    assert_tensors_equal(ours, theirs, *TOL64)


def test_param_groups_with_overrides() -> None:
    params = make_params(dtype=torch.float32)
    grads = make_grads(params, 4)
    ours, theirs = leaves_of(params), leaves_of(params)

    def groups(leaves: list[Tensor]) -> list[dict[str, Any]]:
        return [{"params": leaves[:2], "lr": 0.1, "betas": (0.5, 0.6)}, {"params": leaves[2:]}]

    opt = fo.Optimizer(groups(ours), fo.adam(lr=0.01))
    ref = torch.optim.Adam(groups(theirs), lr=0.01, fused=True)
    drive(opt, ours, grads)
    drive(ref, theirs, grads)
    assert_tensors_equal(ours, theirs)
    assert opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)


def test_closure_zero_grad_and_bad_transform() -> None:
    w = torch.ones(3, requires_grad=True)
    opt = fo.Optimizer([w], fo.sgd(lr=0.5))

    def closure() -> float:
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == 3.0
    assert torch.equal(w.detach(), torch.zeros(3))
    opt.zero_grad()
    assert w.grad is None
    assert isinstance(opt, torch.optim.Optimizer)
    with pytest.raises(TypeError, match="GradientTransformation"):
        fo.Optimizer([w], fo.sgd)
