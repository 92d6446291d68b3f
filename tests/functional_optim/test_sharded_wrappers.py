"""Wrappers on FSDP2 DTensor params stepped on local shards: MultiSteps, zero_nans,
apply_if_finite, lookahead.

One 2-rank world (FSDP2 on a 1-D mesh, gloo, CPU). Reference: the unsharded single-process
run of the same ``fo.Optimizer`` on the same model and batches, compared bitwise (the maths
is element-wise; the flags are finished with one all-reduce). A NaN is injected into ONE
rank's gradient shard (rank 0, element 0 of its shard of the first weight; in the unsharded
run the same global element), so the flags must be global for the runs to agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import functional_optim as fo
from tests._world import World

WIDTHS = (8, 5, 6)  # odd sizes: FSDP2 shards of unequal length
STEPS = 4
NAN_STEP = 1  # the step whose gradient gets a NaN (on rank 0's shard only)


def _plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS)]
    return torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1])


def _fsdp_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _plain_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _backward(model: torch.nn.Module, step: int) -> None:
    batch = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(100 + step))
    model(batch).square().mean().backward()


def _sgd() -> Any:
    """SGD with momentum in ``_foreach`` ops, whose rounding does not depend on the tensor's
    length (fo.sgd's kernel rounds torch's vectorised body and its tail differently, so a
    shard and the whole tensor can differ by an ulp: not what these tests look at)."""
    return fo.chain(fo.trace(0.9), fo.scale(-0.1))


CASES: dict[str, Callable[[], Any]] = {
    "multi_steps": lambda: fo.MultiSteps(_sgd(), every_k_schedule=2).gradient_transformation(),
    "multi_steps_sum_chain": lambda: fo.MultiSteps(
        fo.chain(fo.trace(0.5), fo.scale(-0.1)), every_k_schedule=3, use_grad_mean=False
    ).gradient_transformation(),
    "multi_steps_skip_not_finite": lambda: fo.MultiSteps(
        _sgd(), every_k_schedule=2, should_skip_update_fn=fo.skip_not_finite
    ).gradient_transformation(),
    "zero_nans": lambda: fo.chain(fo.zero_nans(), _sgd()),
    "zero_nans_adam": lambda: fo.chain(fo.zero_nans(), fo.scale_by_adam(), fo.scale(-1e-2)),
    "apply_if_finite": lambda: fo.apply_if_finite(_sgd(), max_consecutive_errors=3),
    "apply_if_finite_in_chain": lambda: fo.chain(
        fo.apply_if_finite(fo.trace(0.9), max_consecutive_errors=3), fo.scale(-0.1)
    ),
    "apply_if_finite_adam": lambda: fo.apply_if_finite(
        fo.chain(fo.scale_by_adam(), fo.scale(-1e-2)), max_consecutive_errors=1
    ),
    "lookahead": lambda: fo.lookahead(_sgd(), sync_period=2, slow_step_size=0.5),
    "lookahead_reset_adam": lambda: fo.lookahead(
        fo.chain(fo.scale_by_adam(), fo.scale(-1e-2)), 3, 0.25, reset_state=True
    ),
}

#: cases whose gradient at NAN_STEP gets a NaN (the others would carry it into the params)
WITH_NAN = {
    "multi_steps_skip_not_finite",
    "zero_nans",
    "zero_nans_adam",
    "apply_if_finite",
    "apply_if_finite_in_chain",
    "apply_if_finite_adam",
}


def _flags(state: Any) -> list[bool]:
    """The wrappers' flags after a step: zero_nans' per-param found_nan, apply_if_finite's
    last_finite, MultiSteps' skip_not_finite should_skip (in tree order)."""
    leaves: list[bool] = []

    def visit(node: Any) -> None:
        if isinstance(node, fo.ZeroNansState):
            leaves.extend(bool(f) for f in node.found_nan)
        elif isinstance(node, fo.ApplyIfFiniteState):
            leaves.append(bool(node.last_finite))
            visit(node.inner_state)
        elif isinstance(node, fo.MultiStepsState):
            if isinstance(node.skip_state, dict):
                leaves.append(bool(node.skip_state["should_skip"]))
        elif isinstance(node, tuple):
            for child in node:
                visit(child)

    visit(state)
    return leaves


def _run(case: str, sharded: bool, rank: int) -> tuple[list[torch.Tensor], list[list[bool]]]:
    """STEPS steps of ``case``; the params' full tensors and the flags after each step."""
    model = _fsdp_model() if sharded else _plain_model()
    opt = fo.Optimizer(model.parameters(), CASES[case]())
    flags = []
    for step in range(STEPS):
        _backward(model, step)
        if case in WITH_NAN and step == NAN_STEP:
            grad: Any = next(iter(model.parameters())).grad
            if not sharded:
                grad[0, 0] = float("nan")
            elif rank == 0:
                grad._local_tensor[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
        flags.append(_flags(opt._tx_states[0]))
    if sharded:  # the fused step ran on the local shards (no DTensor dispatch in the maths)
        assert opt.transform.step is not None
        assert opt._sharded._caches[0] is not None
    params = [p.full_tensor() if sharded else p.detach() for p in model.parameters()]
    return params, flags


def _check_vs_unsharded(rank: int, world_size: int, case: str) -> list[list[bool]]:
    """The FSDP2 run equals the unsharded one bitwise, flags included; returns the flags."""
    got, got_flags = _run(case, True, rank)
    want, want_flags = _run(case, False, rank)
    assert got_flags == want_flags, (case, got_flags, want_flags)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), (case, k, float((a - b).abs().max().detach()))
    return got_flags


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp2_wrapper_matches_unsharded_bitwise(world2: World, case: str) -> None:
    first, second = world2.run(_check_vs_unsharded, case)
    assert first == second  # every rank took the same branches
    if case.startswith("zero_nans"):  # the NaN of rank 0's shard, seen on every rank
        assert [f[0] for f in first] == [False, True, False, False]
        assert not any(any(f[1:]) for f in first)
    if case.startswith("apply_if_finite"):
        assert [f[0] for f in first] == [True, False, True, True]
    if case == "multi_steps_skip_not_finite":
        assert [f[0] for f in first] == [False, True, False, False]


# -- lookahead's fused step on plain tensors (single process) ----------------------------------


def test_lookahead_step_matches_the_two_loop_algorithm() -> None:
    """fo.Optimizer(lookahead) == the algorithm written out with the same ops (bitwise), and
    its slow weights survive a state_dict round trip."""
    torch.manual_seed(0)
    start = [torch.randn(6, 5), torch.randn(3)]
    params = [torch.nn.Parameter(p.clone()) for p in start]
    opt = fo.Optimizer(params, fo.lookahead(_sgd(), sync_period=3, slow_step_size=0.5))
    fast, slow = [p.clone() for p in start], [p.clone() for p in start]
    bufs = [torch.zeros_like(p) for p in start]
    for step in range(7):
        grads = [torch.randn(p.shape) for p in start]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        for f, b, g in zip(fast, bufs, grads, strict=True):
            b.mul_(0.9).add_(g)
            f.add_(b, alpha=-0.1)  # the fused tail of chain(trace, scale)
        if step % 3 == 2:
            for f, s in zip(fast, slow, strict=True):
                s.add_((f - s) * 0.5)
                f.copy_(s)
        for p, f in zip(params, fast, strict=True):
            assert torch.equal(p.detach(), f), step
    state = opt.transform_states[0]
    assert all(torch.equal(a, b) for a, b in zip(state.slow, slow, strict=True))
    again = fo.Optimizer(
        [torch.nn.Parameter(p.detach().clone()) for p in params],
        fo.lookahead(_sgd(), sync_period=3, slow_step_size=0.5),
    )
    again.load_state_dict(opt.state_dict())
    loaded = again.transform_states[0]
    assert all(torch.equal(a, b) for a, b in zip(loaded.slow, slow, strict=True))
    assert int(loaded.steps_since_sync) == 1


def test_lookahead_plain_tree_update_equals_its_step_to_rounding() -> None:
    """``update`` on a plain tree (slow weights in the state) against ``step``: one rounding
    apart at a sync (``f + (s + d - f)`` against ``s + d``)."""
    torch.manual_seed(1)
    start = [torch.randn(4, 3, dtype=torch.float64)]
    tx = fo.lookahead(_sgd(), sync_period=2, slow_step_size=0.5)
    a, b = [start[0].clone()], [start[0].clone()]
    sa, sb = tx.init(a), tx.init(b)
    for _ in range(5):
        g = [torch.randn(4, 3, dtype=torch.float64)]
        updates, sa = tx.update([g[0].clone()], sa, a)
        a = fo.apply_updates(a, updates)
        assert tx.step is not None
        sb = tx.step(b, [g[0].clone()], sb)
        torch.testing.assert_close(a[0], b[0], rtol=1e-14, atol=1e-15)
        torch.testing.assert_close(sa.slow[0], sb.slow[0], rtol=1e-14, atol=1e-15)
    lp = fo.LookaheadParams.init_synced([start[0].clone()])
    before = lp.fast[0].clone()
    with pytest.raises(TypeError, match="LookaheadParams"):  # before anything changes
        tx.step(start, g, tx.init(lp))
    assert torch.equal(lp.fast[0], before)


def test_lookahead_step_on_lookahead_params_equals_update_to_rounding() -> None:
    """``step`` on :class:`fo.LookaheadParams` (optax's form) against ``update``."""
    torch.manual_seed(2)
    start = [torch.randn(5, dtype=torch.float64)]
    tx = fo.lookahead(_sgd(), sync_period=2, slow_step_size=0.3)
    a = fo.LookaheadParams.init_synced([start[0].clone()])
    b = fo.LookaheadParams.init_synced([start[0].clone()])
    sa, sb = tx.init(a), tx.init(b)
    assert sb.slow is None
    assert tx.step is not None
    for _ in range(5):
        g = [torch.randn(5, dtype=torch.float64)]
        updates, sa = tx.update([g[0].clone()], sa, a)
        a = fo.apply_updates(a, updates)
        sb = tx.step(b, [g[0].clone()], sb)
        for x, y in ((a.fast, b.fast), (a.slow, b.slow)):
            torch.testing.assert_close(x[0], y[0], rtol=1e-14, atol=1e-15)
    assert int(sa.steps_since_sync) == int(sb.steps_since_sync) == 1
