"""Partitioning wrappers: ``masked``, ``multi_transform`` and ``freeze`` (optax's semantics).

A mask (or a label tree) has the structure of the params or is a prefix of it (``True`` alone
masks everything; ``{"encoder": False, "head": True}`` masks whole subtrees), or is a callable
returning one from the params (at ``init``) or the updates (at ``update``). The inner transform
sees the unselected leaves as ``None`` (so its state holds ``None`` there and global maths such as
a norm only covers the selected leaves); their updates pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._fusion import view_step
from functional_optim._lists import LeafView, ListApplyFn, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._transforms.optax_misc import set_to_zero
from functional_optim._tree import NAMESPACE, NONE_IS_LEAF, PyTree, TreeSpec, tree_flatten

__all__ = [
    "MaskedState",
    "MultiTransformState",
    "freeze",
    "masked",
    "multi_transform",
]

MaskOrFn = Any  # a pytree (prefix) of bools, or a callable returning one


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state (``None`` at unselected leaves)."""

    inner_state: OptState


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`: one :class:`MaskedState` per label."""

    inner_states: dict[Hashable, OptState]


def _broadcast(
    prefix: Any, tree: PyTree, what: str, flat: tuple[list[Any], TreeSpec] | None = None
) -> list[Any]:
    """The leaves of ``prefix`` broadcast to the structure of ``tree``, in ``tree``'s leaf order
    (``flat``: ``tree``'s leaves and spec where the caller has them, saving a flatten)."""
    leaves, spec = tree_flatten(tree) if flat is None else flat
    if not leaves:  # nothing to select (e.g. fo.Optimizer probing its defaults with [])
        return []
    same, same_spec = tree_flatten(prefix)
    if same_spec == spec:  # the common case, a full tree: no per-leaf broadcast (one C++ flatten)
        return same
    try:
        full = optree.tree_broadcast_prefix(
            prefix, tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE
        )
        values: list[Any] = spec.flatten_up_to(full)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what} must have the structure of the params or be a prefix of it "
            f"(params: {spec}); got {optree.tree_structure(prefix, none_is_leaf=True)}: {err}"
        ) from None
    if len(values) != len(leaves):  # pragma: no cover - flatten_up_to guarantees it
        raise ValueError(f"{what} gives {len(values)} values for {len(leaves)} leaves")
    return values


def _flags(
    mask: MaskOrFn, tree: PyTree, flat: tuple[list[Any], TreeSpec] | None = None
) -> list[bool]:
    flat = tree_flatten(tree) if flat is None else flat
    if not flat[0]:
        return []
    values = _broadcast(mask(tree) if callable(mask) else mask, tree, "mask", flat)
    if set(map(type, values)) == {bool}:  # the common case, checked at C speed
        return values
    flags = []
    for v in values:
        if isinstance(v, Tensor) and v.numel() == 1 and v.dtype == torch.bool:
            v = bool(v)
        if not isinstance(v, bool):
            raise TypeError(
                f"mask leaves must be bools (True: apply the inner transform), got "
                f"{type(v).__name__}"
            )
        flags.append(v)
    return flags


def _select(tree: PyTree, flags: list[bool]) -> PyTree:
    """``tree`` with the unselected leaves replaced by None (a None ``tree`` stays None)."""
    if tree is None:
        return None
    leaves, spec = tree_flatten(tree)
    return spec.unflatten([x if f else None for x, f in zip(leaves, flags, strict=True)])


def _run_masked(
    inner: GradientTransformation,
    flags: list[bool],
    updates: PyTree,
    state: OptState,
    params: PyTree,
    inplace: bool,
) -> tuple[list[Any], OptState]:
    """Run ``inner`` on the selected leaves; returns its output leaves (None elsewhere)."""
    out, new_state = inner.update(
        _select(updates, flags), state, _select(params, flags), inplace=inplace
    )
    return tree_flatten(out)[0], new_state


@transform_factory
def masked(inner: GradientTransformation, mask: MaskOrFn) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` is True; other updates pass through unchanged.

    Args:
        inner: the transform to apply to the selected leaves.
        mask: a pytree of bools with the params' structure (or a prefix of it), or a callable
            mapping the params/updates to one.

    Returns:
        A ``GradientTransformation`` with state :class:`MaskedState`.

    Raises:
        TypeError: if ``inner`` is not a ``GradientTransformation`` or a mask leaf is not a bool.
        ValueError: if the mask's structure does not fit the params (before any state changes).

    Example::

        >>> no_decay_on_bias = fo.masked(fo.add_decayed_weights(1e-4), {"w": True, "b": False})
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked() needs a GradientTransformation, got {type(inner).__name__}")

    def init(params: PyTree) -> MaskedState:
        return MaskedState(inner.init(_select(params, _flags(mask, params))))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        leaves, spec = tree_flatten(updates)
        flags = _flags(mask, updates, (leaves, spec))
        inner_out, inner_state = _run_masked(
            inner, flags, updates, state.inner_state, params, inplace
        )
        out = [o if f else u for u, o, f in zip(leaves, inner_out, flags, strict=True)]
        return spec.unflatten(out), MaskedState(inner_state)

    if inner.lists is None:
        return GradientTransformation(init, update)
    inner_apply = inner.lists.apply

    def positions(view: LeafView, updates: list[Tensor]) -> list[int]:
        leaves = view.full(updates)
        flags = _flags(mask, view.spec.unflatten(leaves), (leaves, view.spec))
        return [j for j, i in enumerate(view.idx) if flags[i]]

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        out, inner_state = _run_subset(
            inner_apply, updates, state.inner_state, view, positions(view, updates)
        )
        return out, MaskedState(inner_state)

    hyper = {"inner": inner.lists, "positions": lambda view: positions(view, view.grads)}
    lists = ListTransform("masked", hyper, apply, inner.lists.writes_updates)
    return GradientTransformation(init, update, lists=lists)


def _run_subset(
    apply: ListApplyFn,
    updates: list[Tensor],
    state: OptState,
    view: LeafView,
    positions: list[int],
) -> tuple[list[Tensor], OptState]:
    """Run a list ``apply`` on the entries ``positions`` of ``updates``; merge its output into
    a copy of the list (the list path of the wrappers: a sub-view, no tree rebuilt)."""
    if not positions:
        return updates, state
    sub_out, state = apply([updates[j] for j in positions], state, view.subset(positions))
    out = list(updates)
    for j, x in zip(positions, sub_out, strict=True):
        out[j] = x
    return out, state


@transform_factory
def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation],
    param_labels: PyTree | Callable[[PyTree], PyTree],
) -> GradientTransformation:
    """Apply a different transform to each group of leaves, chosen by a label per leaf.

    Args:
        transforms: label -> transform.
        param_labels: a pytree of labels with the params' structure (or a prefix of it), or a
            callable mapping the params/updates to one.

    Returns:
        A ``GradientTransformation`` with state :class:`MultiTransformState`.

    Raises:
        TypeError: if a value of ``transforms`` is not a ``GradientTransformation``.
        ValueError: if a leaf's label has no transform, or the labels do not fit the params.

    Example::

        >>> tx = fo.multi_transform(
        ...     {"adam": fo.adam(lr=1e-3), "sgd": fo.sgd(lr=1e-2)}, {"w": "adam", "b": "sgd"}
        ... )
    """
    for label, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] is a {type(tx).__name__}, not a "
                "GradientTransformation"
            )

    def labels_of(tree: PyTree, flat: tuple[list[Any], TreeSpec] | None = None) -> list[Hashable]:
        flat = tree_flatten(tree) if flat is None else flat
        if not flat[0]:
            return []
        labels = _broadcast(
            param_labels(tree) if callable(param_labels) else param_labels,
            tree,
            "param_labels",
            flat,
        )
        try:  # the common case: hashable labels, all known (no per-leaf repr every step)
            if set(labels) <= transforms.keys():
                return labels
        except TypeError:
            pass
        missing = sorted({repr(lb) for lb in labels} - {repr(lb) for lb in transforms})
        if missing:
            raise ValueError(
                f"multi_transform: labels {', '.join(missing)} have no transform; add them to "
                f"transforms (known: {', '.join(repr(k) for k in transforms)})"
            )
        return labels

    def init(params: PyTree) -> MultiTransformState:
        labels = labels_of(params)
        return MultiTransformState(
            {
                label: MaskedState(tx.init(_select(params, [lb == label for lb in labels])))
                for label, tx in transforms.items()
            }
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        leaves, spec = tree_flatten(updates)
        labels = labels_of(updates, (leaves, spec))
        if set(state.inner_states) != set(transforms):
            raise ValueError("multi_transform got a state with other labels; pass its own state")
        out = list(leaves)
        new_states: dict[Hashable, OptState] = {}
        for label, tx in transforms.items():
            flags = [lb == label for lb in labels]
            inner_out, inner_state = _run_masked(
                tx, flags, updates, state.inner_states[label].inner_state, params, inplace
            )
            for i, f in enumerate(flags):
                if f:
                    out[i] = inner_out[i]
            new_states[label] = MaskedState(inner_state)
        return spec.unflatten(out), MultiTransformState(new_states)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        """Each label's fused ``step`` on its leaves (the others' gradients set to None)."""
        if set(state.inner_states) != set(transforms):
            raise ValueError("multi_transform got a state with other labels; pass its own state")
        on_views = [view_step(tx.step) for tx in transforms.values()]
        if all(on_views):  # chains: flatten once, hand each label a sub-view
            view = LeafView(params, grads)
            labels = labels_of(params, (view.all_params, view.spec))
            out: dict[Hashable, OptState] = {}
            for label, on_view in zip(transforms, on_views, strict=True):
                assert on_view is not None
                chosen = [j for j, i in enumerate(view.idx) if labels[i] == label]
                inner_state = state.inner_states[label].inner_state
                out[label] = MaskedState(on_view(params, view.subset(chosen), inner_state))
            return MultiTransformState(out)
        grad_leaves, spec = tree_flatten(grads)
        labels = labels_of(params, (grad_leaves, spec))  # grads mirror params (None is a leaf)
        new_states: dict[Hashable, OptState] = {}
        for label, tx in transforms.items():
            assert tx.step is not None
            sub = spec.unflatten(
                [g if lb == label else None for g, lb in zip(grad_leaves, labels, strict=True)]
            )
            inner = tx.step(params, sub, state.inner_states[label].inner_state)
            new_states[label] = MaskedState(inner)
        return MultiTransformState(new_states)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        leaves = view.full(updates)
        labels = labels_of(view.spec.unflatten(leaves), (leaves, view.spec))
        new_states: dict[Hashable, OptState] = {}
        for label, tx in transforms.items():
            assert tx.lists is not None
            chosen = [j for j, i in enumerate(view.idx) if labels[i] == label]
            updates, inner = _run_subset(
                tx.lists.apply, updates, state.inner_states[label].inner_state, view, chosen
            )
            new_states[label] = MaskedState(inner)
        return updates, MultiTransformState(new_states)

    fused = step if all(tx.step is not None for tx in transforms.values()) else None
    lists = None
    if all(tx.lists is not None for tx in transforms.values()):
        writes = any(tx.lists.writes_updates for tx in transforms.values() if tx.lists)
        lists = ListTransform("multi_transform", {"transforms": transforms}, apply, writes)
    return GradientTransformation(init, update, fused, lists)


@transform_factory
def freeze(mask: MaskOrFn) -> GradientTransformation:
    """Zero the updates where ``mask`` is True (``masked(set_to_zero(), mask)``).

    Args:
        mask: True for the leaves to freeze (a pytree or prefix of bools, or a callable).

    Returns:
        A ``GradientTransformation`` with state :class:`MaskedState`.
    """
    return masked(set_to_zero(), mask)
