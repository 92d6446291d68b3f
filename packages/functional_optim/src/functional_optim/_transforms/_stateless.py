"""A transform that maps every update leaf through one function (no state, no params)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, init_empty
from functional_optim._lists import LeafView, ListTransform
from functional_optim._tree import PyTree, tree_flatten

__all__ = ["stateless"]


def stateless(
    fn: Callable[[Tensor], Tensor],
    key: str,
    hyper: dict[str, Any] | None = None,
    list_fn: Callable[[list[Tensor]], list[Tensor]] | None = None,
) -> GradientTransformation:
    """A transform that maps every update leaf through ``fn``; its list maths run ``list_fn``
    (``_foreach`` ops giving the same numbers) or else ``fn`` per tensor (new tensors, the
    inputs only read)."""

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params, inplace
        leaves, spec = tree_flatten(updates)
        return spec.unflatten([None if u is None else fn(u) for u in leaves]), state

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        del view
        if list_fn is not None and updates:
            return list_fn(updates), state
        return [fn(u) for u in updates], state

    lists = ListTransform(key, hyper or {}, apply, writes_updates=False)
    return GradientTransformation(init_empty, update, lists=lists)
