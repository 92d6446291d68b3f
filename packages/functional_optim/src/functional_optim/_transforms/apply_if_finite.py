"""``apply_if_finite``: skip the steps whose updates hold a NaN or an infinity.

optax decides with ``lax.cond``; here the decision is a Python branch on a 0-d state tensor
(one host read per step), which gives the same numbers and keeps the in-place path from touching
the inner state when a step is rejected. ``apply_if_finite`` also works under
``torch.func.vmap`` when the finiteness differs across the batch: the pure path then selects
between the inner result and the old state with ``torch.where``. On DTensor shards (FSDP2,
tensor parallel) the in-place paths decide for the whole tensors: one all-reduce of the flag,
so a NaN on one rank's shard makes every rank skip.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, StepFn
from functional_optim._fusion import view_step
from functional_optim._lists import (
    LeafView,
    ListTransform,
    _copy_state,
    by_device_dtype,
    pure_apply_all,
)
from functional_optim._recipes import transform_factory
from functional_optim._sharded_flags import any_over_shards
from functional_optim._transforms._leaf import is_traced
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

#: dtypes torch's AMP finiteness check takes.
_AMP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`: consecutive and total non-finite steps (0-d int64),
    whether the last step was finite (0-d bool) and the inner state."""

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: OptState


def _all_finite(updates: PyTree) -> Tensor:
    checks = [torch.isfinite(u).all() for u in tree_flatten(updates)[0] if u is not None]
    if not checks:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([c.to(checks[0].device) for c in checks]).all()


def all_finite_lists(tensors: list[Tensor], consumed: bool) -> Tensor:
    """Whether every tensor is free of NaN and infinity (a 0-d bool).

    With ``consumed`` (the tensors may be written), floating tensors are checked by torch's AMP
    check (``_amp_foreach_non_finite_check_and_unscale_`` with scale 1, which leaves every
    value as it is) in one call per device and dtype; other tensors one by one.
    """
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    fast = [i for i, t in enumerate(tensors) if consumed and t.dtype in _AMP_DTYPES]
    flags: list[Tensor] = []
    for group in by_device_dtype([tensors[i] for i in fast]):
        ts = [tensors[fast[j]] for j in group]
        found = torch.zeros(1, dtype=torch.float32, device=ts[0].device)
        one = torch.ones(1, dtype=torch.float32, device=ts[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        flags.append(found[0] == 0)
    chosen = set(fast)
    rest = [t for i, t in enumerate(tensors) if i not in chosen]
    flags.extend(torch.isfinite(t).all() for t in rest)
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).all()


def _on_every_rank(finite: Tensor, view: LeafView) -> Tensor:
    """``finite`` for the whole DTensors when the params are local shards (one all-reduce of
    the flag, so that every rank takes or skips the step together); else ``finite`` itself."""
    anywhere = any_over_shards(~finite, view.params)
    return finite if anywhere is None else ~anywhere


def _zeros(updates: PyTree) -> PyTree:
    return tree_zeros_like(updates)


def _where_tree(pred: Tensor, a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``where(pred, a, b)`` over two states of the same structure."""
    la, spec = tree_flatten(a)
    lb: list[Any] = spec.flatten_up_to(b)
    out = []
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            out.append(torch.where(pred, x, y))
        elif not isinstance(x, Tensor) and not isinstance(y, Tensor) and x == y:
            out.append(x)
        else:
            raise ValueError(
                "apply_if_finite under vmap needs an inner state whose leaves are all created at "
                "init (a lazily created buffer, e.g. trace's first momentum, cannot be selected)"
            )
    return spec.unflatten(out)


@transform_factory
def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """Skip steps whose incoming updates hold a NaN or an infinity (zero updates, state kept).

    After more than ``max_consecutive_errors`` consecutive non-finite steps the update is applied
    anyway (as optax does), so a persistent problem shows up instead of silently freezing.

    Args:
        inner: the optimizer to protect.
        max_consecutive_errors: how many consecutive non-finite steps to skip.

    Returns:
        A ``GradientTransformation`` with state :class:`ApplyIfFiniteState`.

    Raises:
        ValueError: if ``max_consecutive_errors`` is negative.
    """
    if max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be >= 0, got {max_consecutive_errors}")

    def init(params: PyTree) -> ApplyIfFiniteState:
        zero = torch.zeros((), dtype=torch.int64)
        return ApplyIfFiniteState(
            zero, torch.ones((), dtype=torch.bool), zero.clone(), inner.init(params)
        )

    def decide(finite: Tensor, state: OptState) -> tuple[Tensor, Tensor, Tensor]:
        """``(notfinite_count, total_notfinite, accept)`` after a step of finiteness ``finite``."""
        count = torch.where(
            finite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1
        )
        total = torch.where(finite, state.total_notfinite, state.total_notfinite + 1)
        return count, total, torch.logical_or(finite, count > max_consecutive_errors)

    def store(state: OptState, count: Tensor, finite: Tensor, total: Tensor) -> None:
        state.notfinite_count.copy_(count)
        state.last_finite.copy_(finite)
        state.total_notfinite.copy_(total)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        finite = _all_finite(updates).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        if is_traced(accept) and not inplace:
            new_updates, new_inner = inner.update(updates, state.inner_state, params)
            out = _where_tree(accept, new_updates, _zeros(updates))
            inner_state = _where_tree(accept, new_inner, state.inner_state)
        elif bool(accept):
            out, inner_state = inner.update(updates, state.inner_state, params, inplace=inplace)
        else:
            out, inner_state = _zeros(updates), state.inner_state
        if inplace:
            store(state, count, finite, total)
            count, finite, total = state.notfinite_count, state.last_finite, state.total_notfinite
        return out, ApplyIfFiniteState(count, finite, total, inner_state)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        """The inner ``step`` when the gradients are finite (or too many steps were skipped);
        otherwise params and inner state stay as they are."""
        assert inner.step is not None
        view = LeafView(params, grads)
        finite = all_finite_lists(view.grads, consumed=True)
        finite = _on_every_rank(finite, view).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        inner_state = state.inner_state
        if bool(accept):
            on_view = view_step(inner.step)
            if on_view is not None:
                inner_state = on_view(params, view, inner_state)
            else:
                inner_state = inner.step(params, grads, inner_state)
        store(state, count, finite, total)
        return state._replace(inner_state=inner_state)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        assert inner.lists is not None
        finite = all_finite_lists(updates, consumed=True)
        finite = _on_every_rank(finite, view).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        inner_state = state.inner_state
        if bool(accept):
            updates, inner_state = inner.lists.apply(updates, inner_state, view)
        elif updates:
            torch._foreach_zero_(updates)
        store(state, count, finite, total)
        return updates, state._replace(inner_state=inner_state)

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        finite = all_finite_lists(updates, consumed=False).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        if bool(accept):
            out, (inner_state,) = pure_apply_all((inner,), updates, (state.inner_state,), view)
        else:
            out = [torch.zeros_like(u) for u in updates]
            inner_state = _copy_state(state.inner_state)
        return out, ApplyIfFiniteState(count, finite, total, inner_state)

    fused: StepFn | None = step if inner.step is not None else None
    lists = None
    if inner.lists is not None:
        hyper = {"inner": inner.lists, "max_consecutive_errors": max_consecutive_errors}
        lists = ListTransform("apply_if_finite", hyper, apply, True, apply_pure)
    return GradientTransformation(init, update, fused, lists)
