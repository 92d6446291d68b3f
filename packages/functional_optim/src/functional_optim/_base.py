"""The small contract: ``GradientTransformation``, ``chain``, ``identity``, ``apply_updates``.

A transform is a pair of pure functions, plus an optional in-place fast path:

* ``init(params) -> state``
* ``update(updates, state, params=None, *, inplace=False) -> (updates, state)``. Pure by default:
  no input is mutated and every step is differentiable with ``torch.func``. With ``inplace=True``
  the state buffers are updated in place (the returned state holds the same tensors) and the
  incoming ``updates`` tensors may be overwritten (they are consumed).
* ``step(params, grads, state) -> state`` (optional): update the params and the state buffers
  in place in one pass, through the fused ``functional_optim.kernels`` where torch has them;
  ``grads`` may be overwritten (consumed). The aliases provide it, and ``chain`` builds one
  when every component has ``lists``. ``functional_optim.Optimizer`` uses ``step`` when present
  and otherwise falls back to ``update(inplace=True)`` followed by
  ``apply_updates(inplace=True)``.
* ``lists`` (optional): the transform's in-place maths over flat lists of tensors, a
  :class:`functional_optim._lists.ListTransform`; how a new transform joins the fast path is
  described in :mod:`functional_optim._lists`, how chains fuse in :mod:`functional_optim._fusion`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._fn_types import InitFn, OptState, StepFn, UpdateFn
from functional_optim._fusion import chain_step
from functional_optim._lists import LeafView, ListTransform, pure_apply_all, run_pure
from functional_optim._recipes import recipe_of, remake, transform_factory
from functional_optim._recording import recording
from functional_optim._tree import PyTree, leaves_like, tree_flatten, tree_unflatten

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "InitFn",
    "OptState",
    "StepFn",
    "UpdateFn",
    "apply_updates",
    "chain",
    "identity",
]


class GradientTransformation(NamedTuple):
    """An optimizer building block: ``init``, ``update``, an optional fused in-place ``step``
    and optional list-level maths ``lists`` (see the module docstring).

    Example::

        >>> import torch, functional_optim as fo
        >>> params = {"w": torch.ones(3)}
        >>> tx = fo.chain(fo.clip_by_global_norm(1.0), fo.scale_by_adam(), fo.scale(-1e-3))
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.full((3,), 2.0)}, state, params)
        >>> params = fo.apply_updates(params, updates)
    """

    init: InitFn
    update: UpdateFn
    step: StepFn | None = None
    lists: ListTransform | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as the factory call that made this transform (see ``_recipes``)."""
        return (remake, recipe_of(self))

    def __copy__(self) -> GradientTransformation:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientTransformation:
        """Transforms are immutable (their state is separate): a copy is the same one."""
        return self


class EmptyState(NamedTuple):
    """State of a stateless transform."""


def init_empty(params: PyTree) -> EmptyState:
    """The ``init`` of every stateless transform."""
    del params
    return EmptyState()


@transform_factory
def identity() -> GradientTransformation:
    """Return a transform that leaves updates unchanged.

    Returns:
        A stateless ``GradientTransformation``.
    """

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params, inplace
        return updates, state

    return GradientTransformation(init_empty, update, lists=NO_OP)


def _no_op(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
    del view
    return updates, state


#: The ``lists`` of a transform that changes nothing (``identity``, a zero weight decay).
NO_OP = ListTransform("identity", {}, _no_op)


@transform_factory
def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms: the updates of one are the input of the next.

    The state is the tuple of the components' states. When every component has ``lists``, the
    chain has them too and gets an in-place ``step`` that flattens the trees once, runs the
    components over flat lists and hands its tail to a fused kernel where one fits (see
    :mod:`functional_optim._fusion`); otherwise ``step`` is ``None``.

    Args:
        *transforms: the transforms, applied left to right.

    Returns:
        A ``GradientTransformation``.

    Raises:
        TypeError: if an argument is not a ``GradientTransformation``.
    """
    for i, tx in enumerate(transforms):
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"chain() argument {i} is a {type(tx).__name__}, not a GradientTransformation; "
                "call the factory (e.g. fo.scale_by_adam()) rather than passing it"
            )

    fast = all(tx.lists is not None for tx in transforms)

    def init(params: PyTree) -> tuple[OptState, ...]:
        return tuple(tx.init(params) for tx in transforms)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of length {len(state)}; "
                "pass the state returned by this chain's init/update"
            )
        if fast and not inplace and params is not None and not recording(updates, params):
            out = run_pure(transforms, updates, state, params)
            if not recording(out):  # else a tensor hyperparameter needs a graph: per leaf
                return out
        new_state = []
        for tx, s in zip(transforms, state, strict=True):
            updates, s = tx.update(updates, s, params, inplace=inplace)
            new_state.append(s)
        return updates, tuple(new_state)

    if not fast:
        return GradientTransformation(init, update)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        new_state = list(state)
        for i, tx in enumerate(transforms):
            assert tx.lists is not None
            updates, new_state[i] = tx.lists.apply(updates, new_state[i], view)
        return updates, tuple(new_state)

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        return pure_apply_all(transforms, updates, state, view)

    writes = any(tx.lists.writes_updates for tx in transforms if tx.lists is not None)
    lists = ListTransform("chain", {"transforms": transforms}, apply, writes, apply_pure)
    return GradientTransformation(init, update, chain_step(transforms), lists)


def apply_updates(params: PyTree, updates: PyTree, *, inplace: bool = False) -> PyTree:
    """Return ``params + updates`` leafwise; a ``None`` update leaves its param unchanged.

    Args:
        params: the params pytree.
        updates: a pytree of the same structure (``None`` leaves allowed).
        inplace: add into the params' storage (``param.add_(update)``) instead of building new
            tensors. Pure (differentiable) when False.

    Returns:
        The new params (the same tensor objects when ``inplace``).

    Raises:
        ValueError: if the structures differ.
    """
    leaves, spec = tree_flatten(params)
    ups: Sequence[Tensor | None] = leaves_like(spec, updates, "updates")
    if inplace:
        for p, u in zip(leaves, ups, strict=True):
            if p is not None and u is not None:
                p.add_(u)
        return params
    pairs = [
        (i, p, u)
        for i, (p, u) in enumerate(zip(leaves, ups, strict=True))
        if p is not None and u is not None
    ]
    out = list(leaves)
    ps = [p for _, p, _ in pairs]
    us = [u for _, _, u in pairs]
    if (
        ps
        and all(p.dtype == u.dtype for p, u in zip(ps, us, strict=True))
        and not recording(ps, us)
    ):
        # One _foreach_add (the same numbers as the per-leaf add) when no graph is recorded.
        for (i, _, _), new in zip(pairs, torch._foreach_add(ps, us), strict=True):
            out[i] = new
    else:
        for i, p, u in pairs:
            out[i] = p + u.to(p.dtype)
    return tree_unflatten(spec, out)
