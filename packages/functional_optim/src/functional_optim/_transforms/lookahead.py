"""``lookahead``: fast weights stepped by an inner optimizer, slow weights synced every few.

optax decides with ``lax.cond``; here the decision is a Python branch on a 0-d state tensor
(one host read per step), which gives the same numbers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._lists import LeafView
from functional_optim._recipes import transform_factory
from functional_optim._tree import PyTree, tree_clone, tree_flatten, tree_map

__all__ = ["LookaheadParams", "LookaheadState", "lookahead"]


class LookaheadParams(NamedTuple):
    """The two parameter sets of :func:`lookahead`: the fast weights (where gradients are taken)
    and the slow weights."""

    fast: PyTree
    slow: PyTree

    @classmethod
    def init_synced(cls, params: PyTree) -> LookaheadParams:
        """Fast and slow weights both equal to ``params`` (the slow ones are a copy)."""
        return cls(params, tree_clone(params))


class LookaheadState(NamedTuple):
    """State of :func:`lookahead`: the fast optimizer's state, the steps since the last sync
    (0-d int64) and, when the params are a plain tree (``fo.Optimizer``), the slow weights
    (else None: they are ``params.slow``)."""

    fast_state: OptState
    steps_since_sync: Tensor
    slow: PyTree = None


@transform_factory
def lookahead(
    fast_optimizer: GradientTransformation,
    sync_period: int,
    slow_step_size: float | Tensor,
    reset_state: bool = False,
) -> GradientTransformation:
    """Lookahead: ``sync_period`` fast steps, then the slow weights move ``slow_step_size`` of
    the way to the fast ones and the fast weights restart from there.

    Params and updates are :class:`LookaheadParams`; the gradients passed to ``update`` are
    those of the fast weights (a tree like ``params.fast``). ``init`` on a plain tree (as
    ``fo.Optimizer`` calls it) keeps the slow weights in the state instead: the params are
    the fast weights and the updates are theirs.

    ``step`` (in place, what ``fo.Optimizer`` runs) steps the fast weights with the fast
    optimizer's own ``step`` and syncs with ``_foreach`` ops; its maths is element-wise, so
    on DTensor params it runs on the local shards. It rounds the sync once less than
    ``update`` + ``apply_updates`` (which add ``s + step - f`` to ``f``): the fast weights
    become exactly the new slow ones.

    Args:
        fast_optimizer: the inner optimizer run on the fast weights.
        sync_period: fast steps between two synchronisations (>= 1).
        slow_step_size: interpolation factor of the slow weights (in [0, 1]).
        reset_state: re-initialise the fast optimizer's state at each synchronisation.

    Returns:
        A ``GradientTransformation`` with state :class:`LookaheadState`.

    Raises:
        ValueError: if ``sync_period < 1`` or ``slow_step_size`` is outside [0, 1].
    """
    if sync_period < 1:
        raise ValueError(f"sync_period must be >= 1, got {sync_period}")
    if not isinstance(slow_step_size, Tensor) and not 0.0 <= slow_step_size <= 1.0:
        raise ValueError(f"slow_step_size must be in [0, 1], got {slow_step_size}")

    def check(params: Any, state: OptState) -> LookaheadParams:
        """``params`` as fast and slow weights (the slow ones from ``state`` for a plain tree)."""
        if isinstance(params, LookaheadParams):
            return params
        if state.slow is None:
            raise TypeError(
                "lookahead needs params as fo.LookaheadParams(fast, slow); start from "
                "fo.LookaheadParams.init_synced(params)"
            )
        return LookaheadParams(params, state.slow)

    def init(params: PyTree) -> LookaheadState:
        steps = torch.zeros((), dtype=torch.int64)
        if isinstance(params, LookaheadParams):
            return LookaheadState(fast_optimizer.init(params.fast), steps)
        slow = tree_map(lambda p: None if p is None else p.detach().clone(), params)
        return LookaheadState(fast_optimizer.init(params), steps, slow)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        lp = check(params, state)
        fast_updates, fast_state = fast_optimizer.update(
            updates, state.fast_state, lp.fast, inplace=inplace
        )
        leaves, spec = tree_flatten(fast_updates)
        synced = int(state.steps_since_sync) == sync_period - 1
        if synced:
            fast: list[Any] = spec.flatten_up_to(lp.fast)
            slow: list[Any] = spec.flatten_up_to(lp.slow)
            fast_out: list[Any] = []
            slow_out: list[Any] = []
            for u, f, s in zip(leaves, fast, slow, strict=True):
                if u is None:
                    fast_out.append(None)
                    slow_out.append(None)
                    continue
                step = slow_step_size * (f + u - s)
                slow_out.append(step)
                fast_out.append(s + step - f)
            if reset_state:
                fast_state = fast_optimizer.init(lp.fast)
        else:
            fast_out = list(leaves)
            slow_out = [None if u is None else torch.zeros_like(u) for u in leaves]
        steps = (state.steps_since_sync + 1) % sync_period
        if inplace:
            steps = state.steps_since_sync.copy_(steps)
        if state.slow is None or isinstance(params, LookaheadParams):
            out = LookaheadParams(spec.unflatten(fast_out), spec.unflatten(slow_out))
            return out, LookaheadState(fast_state, steps, state.slow)
        if not synced:  # the slow weights in the state stay as they are
            return spec.unflatten(fast_out), LookaheadState(fast_state, steps, state.slow)
        slow_leaves: list[Any] = spec.flatten_up_to(state.slow)
        new_slow = [
            s if d is None else (s.add_(d) if inplace else s + d)
            for s, d in zip(slow_leaves, slow_out, strict=True)
        ]
        return spec.unflatten(fast_out), LookaheadState(fast_state, steps, spec.unflatten(new_slow))

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        """In place: the fast optimizer's step on the fast weights; at a sync, ``slow +=
        slow_step_size * (fast - slow)`` and ``fast = slow`` (positions with a gradient)."""
        lp = check(params, state)
        fast_state = state.fast_state
        if fast_optimizer.step is not None:
            fast_state = fast_optimizer.step(lp.fast, grads, fast_state)
        else:
            clones = tree_map(lambda g: None if g is None else g.clone(), grads)
            updates, fast_state = fast_optimizer.update(clones, fast_state, lp.fast, inplace=True)
            apply_updates(lp.fast, updates, inplace=True)
        if int(state.steps_since_sync) == sync_period - 1:
            view = LeafView(lp.fast, grads)
            slow = view.gather(lp.slow)
            if view.params:
                delta = torch._foreach_sub(view.params, slow)
                torch._foreach_mul_(delta, slow_step_size)
                torch._foreach_add_(slow, delta)
                torch._foreach_copy_(view.params, slow)
            if reset_state:
                fast_state = fast_optimizer.init(lp.fast)
        state.steps_since_sync.copy_((state.steps_since_sync + 1) % sync_period)
        return LookaheadState(fast_state, state.steps_since_sync, state.slow)

    return GradientTransformation(init, update, step)
