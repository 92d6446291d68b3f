"""``lookahead``: fast weights stepped by an inner optimizer, slow weights synced every few.

optax decides with ``lax.cond``; here the decision is a Python branch on a 0-d state tensor
(one host read per step), which gives the same numbers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._tree import PyTree, tree_clone, tree_flatten

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
    """State of :func:`lookahead`: the fast optimizer's state and the steps since the last sync
    (0-d int64)."""

    fast_state: OptState
    steps_since_sync: Tensor


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
    those of the fast weights (a tree like ``params.fast``).

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

    def check(params: Any) -> LookaheadParams:
        if not isinstance(params, LookaheadParams):
            raise TypeError(
                "lookahead needs params as fo.LookaheadParams(fast, slow); start from "
                "fo.LookaheadParams.init_synced(params)"
            )
        return params

    def init(params: PyTree) -> LookaheadState:
        return LookaheadState(
            fast_optimizer.init(check(params).fast), torch.zeros((), dtype=torch.int64)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        lp = check(params)
        fast_updates, fast_state = fast_optimizer.update(
            updates, state.fast_state, lp.fast, inplace=inplace
        )
        leaves, spec = tree_flatten(fast_updates)
        if int(state.steps_since_sync) == sync_period - 1:
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
        out = LookaheadParams(spec.unflatten(fast_out), spec.unflatten(slow_out))
        return out, LookaheadState(fast_state, steps)

    return GradientTransformation(init, update)
