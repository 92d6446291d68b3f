"""The list-level protocol: a transform's maths over flat lists, for fast in-place steps.

A ``GradientTransformation`` may carry ``lists``, a :class:`ListTransform`. With it, ``chain``
gives the chain a ``step`` that flattens the pytrees once, runs every component over flat
lists of the leaves that have a gradient (one ``torch._foreach_*`` call per op, not one op per
leaf) and hands runs of built-in transforms to torch's fused kernels where a rule of
:mod:`functional_optim._fusion` knows them. ``functional_optim.Optimizer`` runs any chain of
such transforms through that ``step``.

To make a new transform fast, give it ``lists=ListTransform(key, hyper, apply,
writes_updates)``; for example ``scale``::

    def apply(updates, state, view):
        foreach_scale(updates, step_size)  # one _foreach_mul_ per device and dtype
        return updates, state

    GradientTransformation(init, update, lists=ListTransform("scale", {"step_size": s}, apply))

* ``apply(updates, state, view) -> (updates, state)`` does the transform's maths in place:
  ``updates`` is the list of update tensors at the positions that have one (possibly empty:
  return early), ``state`` is the transform's own state (pytrees mirroring the params: read
  their leaves at those positions with ``view.gather(tree)``, update the buffers in place and
  return the same state object, or a new one when new buffers appear, as ``trace`` does);
  ``view.params`` are the matching params. Use ``torch._foreach_*`` ops, in the per-leaf op
  order: it must give the same numbers as ``update(..., inplace=True)``, bitwise (test it as
  tests/functional_optim/test_fusion.py does for the built-in ones).
* per-leaf step counters (``_ops.zero_counts``) are incremented with
  ``_ops.increment_counts(view.gather(state.count))``: one op for the whole block of counters
  that ``init`` made (see :mod:`functional_optim._counts`), ``_foreach_add_`` otherwise.
* ``writes_updates=False`` when ``apply`` only reads ``updates`` and returns new tensors (the
  pure path then skips a copy of the caller's gradients).
* ``key`` and ``hyper`` name the maths and its hyperparameters (``"scale_by_adam"``,
  ``{"b1": 0.9, ...}``) so that fusion rules can recognise it; a transform no rule knows just
  keeps its own ``apply``.
* A wrapper that runs an inner transform on a subset of the leaves (``masked``,
  ``multi_transform``) builds a sub-view with ``view.subset(positions)``; when its inner
  transforms have fused ``step`` s, it can offer a ``step`` of its own that calls them (as
  ``multi_transform`` does), and a chain ending in it hands over to that ``step``.

The pure path of a chain whose components all have ``lists`` (:func:`run_pure`) runs the same
``apply`` functions on copies of the state, so a new transform gets a fast pure path too, with
the same numbers as its per-leaf ``update``. It is used when no autograd graph is recorded
(:func:`functional_optim._recording.recording`); a differentiable call (``torch.func``,
``requires_grad`` inputs) takes the per-leaf ``update`` of each component, which never writes
into a tensor autograd saved.

Transforms without ``lists`` still work everywhere: a chain that holds one has no ``step`` and
``Optimizer`` falls back to ``update(inplace=True)`` + ``apply_updates``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from functional_optim._input_checks import GradRules
from functional_optim._tree import (
    NAMESPACE,
    PyTree,
    TreeSpec,
    leaves_like,
    tree_flatten,
)

_DEVICE = attrgetter("device")
_DTYPE = attrgetter("dtype")

__all__ = [
    "FusedTail",
    "LeafView",
    "ListApplyFn",
    "ListTransform",
    "TailCall",
    "by_device_dtype",
    "copy_tensors",
    "foreach_scale",
    "foreach_scaled",
    "pure_apply_all",
    "run_pure",
    "with_active_leaves",
]

#: ``apply(updates, state, view) -> (updates, state)``, in place (see the module docstring).
ListApplyFn = Callable[[list[Tensor], Any, "LeafView"], tuple[list[Tensor], Any]]


class TailCall(NamedTuple):
    """One fused tail's step.

    Attributes:
        view: the step's leaf view.
        updates: the head's output at the view's positions (the kernel's gradients).
        hyper: the scaling transform's hyperparameters.
        state: its state (the kernel writes its lists in place).
        lr: the learning rate.
        weight_decay: the decoupled weight decay (0: none).
        decayed: the positions that take the decay (a masked decay), or None for all.
    """

    view: LeafView
    updates: list[Tensor]
    hyper: Mapping[str, Any]
    state: Any
    lr: float
    weight_decay: float
    decayed: list[int] | None

    def decays(self) -> list[bool]:
        """Per position, whether it takes the decay."""
        flags = [self.decayed is None] * len(self.view.params)  # no Python loop when unmasked
        for j in self.decayed or ():
            flags[j] = True
        return flags


class FusedTail(NamedTuple):
    """How ``chain(<transform>, [add_decayed_weights(wd)], <learning rate>)`` runs as one
    kernel call.

    Attributes:
        name: the rule's name (in plans and messages).
        rules: torch's checks of the gradients for that kernel.
        buffers: ``(hyper) -> [(torch's name, state field)]``: the state lists the kernel
            reads, checked against the params before anything runs (the step counts are
            checked too).
        written: the state fields the kernel writes (``pure_step`` copies the others).
        run: runs the kernel on a :class:`TailCall`.
    """

    name: str
    rules: GradRules
    buffers: Callable[[Mapping[str, Any]], list[tuple[str, str]]]
    written: tuple[str, ...]
    run: Callable[[TailCall], None]


class ListTransform(NamedTuple):
    """A transform's in-place maths over flat lists, plus what fusion rules read.

    Attributes:
        key: names the maths (``"scale_by_adam"``); ``"identity"`` marks a no-op.
        hyper: its hyperparameters by name.
        apply: the in-place list maths (see the module docstring).
        writes_updates: whether ``apply`` may write into the update tensors it is given
            (``False`` when it only reads them and returns new tensors, as ``scale_by_adam``);
            the pure path copies the caller's tensors before a transform that writes.
        apply_pure: optional out-of-place twin of ``apply`` for the pure path: writes into
            neither ``updates`` nor ``state`` and returns a new state (build it with
            :func:`with_active_leaves`), bitwise equal to ``apply``. It saves the copies of the
            state and of the caller's updates that ``run_pure`` makes before ``apply`` (one pass
            over each buffer).
        tail: for a scaling transform, how a chain ending in it, an optional decay and a
            learning rate runs as one kernel (:class:`FusedTail`; the built-in ones are in
            :mod:`functional_optim._tail_kernels`).
    """

    key: str
    hyper: Mapping[str, Any]
    apply: ListApplyFn
    writes_updates: bool = True
    apply_pure: ListApplyFn | None = None
    tail: FusedTail | None = None


class LeafView:
    """Params and grads flattened once; the positions that have a gradient.

    Args:
        params: the params pytree (or, for a sub-view, the full list of param leaves).
        grads: a pytree of the same structure; ``None`` leaves are skipped.

    Raises:
        ValueError: if the structures differ.
    """

    def __init__(self, params: PyTree, grads: PyTree) -> None:
        all_params, spec = tree_flatten(params)
        self.spec: TreeSpec = spec
        self.all_params: list[Any] = all_params
        self.all_grads: list[Any] = leaves_like(spec, grads, "grads")
        if any(g is None for g in self.all_grads):
            self.idx: list[int] = [i for i, g in enumerate(self.all_grads) if g is not None]
            self.params: list[Tensor] = [all_params[i] for i in self.idx]
            self.grads: list[Tensor] = [self.all_grads[i] for i in self.idx]
        else:  # the common case: every leaf has a gradient, nothing to select
            self.idx = list(range(len(all_params)))
            self.params = all_params
            self.grads = list(self.all_grads)

    def gather(self, tree: PyTree) -> list[Any]:
        """The leaves of a state tree (mirroring the params) at the positions with a gradient."""
        leaves = leaves_like(self.spec, tree, "state")
        if len(self.idx) == len(leaves):
            return leaves
        return [leaves[i] for i in self.idx]

    def take(self, leaves: Sequence[Any]) -> list[Any]:
        """The entries of a full-length leaf list at the positions with a gradient."""
        return [leaves[i] for i in self.idx]

    def spec_leaves(self, tree: PyTree) -> list[Any]:
        """Every leaf of a state tree mirroring the params (to rebuild it with new buffers)."""
        return leaves_like(self.spec, tree, "state")

    def subset(self, positions: Sequence[int]) -> LeafView:
        """A view of the entries ``positions`` (indices into this view's active lists)."""
        sub = LeafView.__new__(LeafView)
        sub.spec = self.spec
        sub.all_params = self.all_params
        sub.all_grads = self.all_grads
        sub.idx = [self.idx[j] for j in positions]
        sub.params = [self.params[j] for j in positions]
        sub.grads = [self.grads[j] for j in positions]
        return sub

    def full(self, active: Sequence[Any]) -> list[Any]:
        """A full-length leaf list: ``active`` at this view's positions, ``None`` elsewhere."""
        out: list[Any] = [None] * len(self.all_params)
        for i, x in zip(self.idx, active, strict=True):
            out[i] = x
        return out


def by_device_dtype(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by (device, dtype), in first-seen order."""
    if len(set(map(_DEVICE, tensors))) <= 1 and len(set(map(_DTYPE, tensors))) <= 1:
        return [list(range(len(tensors)))] if tensors else []  # one group: two C-level passes
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def foreach_scale(tensors: list[Tensor], factor: float | Tensor) -> None:
    """``t.mul_(factor)`` for every tensor, one ``_foreach_mul_`` per device and dtype.

    A tensor ``factor`` is cast to each group's dtype and device first, as the per-leaf maths
    (``_ops.like``) does, so the numbers are the same.
    """
    if not tensors:
        return
    if not isinstance(factor, Tensor):
        torch._foreach_mul_(tensors, factor)
        return
    groups = by_device_dtype(tensors)
    for group in groups:
        ts = tensors if len(groups) == 1 else [tensors[i] for i in group]
        first = ts[0]
        torch._foreach_mul_(ts, factor.to(device=first.device, dtype=first.dtype))


def foreach_scaled(tensors: list[Tensor], factor: float | Tensor) -> list[Tensor]:
    """New tensors ``t * factor`` (the numbers of :func:`foreach_scale`, out of place)."""
    if not tensors:
        return []
    if not isinstance(factor, Tensor):
        return list(torch._foreach_mul(tensors, factor))
    out: list[Tensor] = list(tensors)
    for group in by_device_dtype(tensors):
        first = tensors[group[0]]
        cast = factor.to(device=first.device, dtype=first.dtype)
        for i, new in zip(
            group, torch._foreach_mul([tensors[i] for i in group], cast), strict=True
        ):
            out[i] = new
    return out


def copy_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """Fresh copies with the same values (floating tensors in one ``_foreach_mul(x, 1.0)``,
    which is exact, per device and dtype)."""
    out: list[Tensor] = list(tensors)
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point()]
    for group in by_device_dtype([tensors[i] for i in floats]):
        positions = [floats[j] for j in group]
        for i, copy in zip(
            positions, torch._foreach_mul([tensors[i] for i in positions], 1.0), strict=True
        ):
            out[i] = copy
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            out[i] = t.clone()
    return out


def with_active_leaves(view: LeafView, tree: PyTree, active: Sequence[Tensor]) -> PyTree:
    """A new tree mirroring the params: ``active`` at the view's positions, copies elsewhere.

    Args:
        view: the leaf view ``active`` is aligned with.
        tree: the old state tree (mirroring the params).
        active: the new leaves at ``view``'s positions.

    Returns:
        The new tree; it shares no tensor with ``tree``.
    """
    leaves = view.spec_leaves(tree)
    if len(active) != len(leaves):
        kept = set(view.idx)
        rest = [i for i, x in enumerate(leaves) if i not in kept and isinstance(x, Tensor)]
        for i, copy in zip(rest, copy_tensors([leaves[i] for i in rest]), strict=True):
            leaves[i] = copy
    for i, x in zip(view.idx, active, strict=True):
        leaves[i] = x
    return view.spec.unflatten(leaves)


def _copy_state(state: Any) -> Any:
    leaves, spec = optree.tree_flatten(state, none_is_leaf=True, namespace=NAMESPACE)
    where = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]
    if not where:
        return state
    for i, copy in zip(where, copy_tensors([leaves[i] for i in where]), strict=True):
        leaves[i] = copy
    return spec.unflatten(leaves)


def run_pure(
    transforms: Sequence[Any], updates: PyTree, state: Any, params: PyTree
) -> tuple[PyTree, tuple[Any, ...]]:
    """The pure ``update`` of a chain of list transforms, without autograd.

    Flattens once and runs :func:`pure_apply_all`. The inputs are never written to.

    Args:
        transforms: the chain's components (each with ``lists``).
        updates: the incoming updates pytree.
        state: the chain's state (one entry per component).
        params: the params pytree (same structure as ``updates``).

    Returns:
        ``(new updates, new state)`` as the per-leaf ``update`` computes them.
    """
    view = LeafView(params, updates)
    current, new_state = pure_apply_all(transforms, view.grads, state, view)
    return view.spec.unflatten(view.full(current)), new_state


def pure_apply_all(
    transforms: Sequence[Any],
    updates: list[Tensor],
    state: Any,
    view: LeafView,
    owned: bool = False,
) -> tuple[list[Tensor], tuple[Any, ...]]:
    """A chain's list maths without writing into ``updates`` or ``state`` (``apply_pure``).

    Each component runs its ``apply_pure`` when it has one; otherwise its ``apply`` on a copy
    of its state, after copying those of the given ``updates`` it would write into.

    Args:
        transforms: the components (each with ``lists``).
        updates: the update tensors at ``view``'s positions (not written to, unless
            ``owned``).
        state: one state per component (not written to).
        view: the leaf view.
        owned: ``updates`` are the caller's scratch: every component runs its in-place
            ``apply`` on them (on a copy of its state), allocating nothing for the updates.

    Returns:
        ``(new updates, new state per component)``.
    """
    callers = set() if owned else {id(g) for g in updates}
    current: list[Tensor] = updates
    new_state = list(state)
    for i, tx in enumerate(transforms):
        lists: ListTransform = tx.lists
        if lists.key == "identity":
            continue
        if lists.apply_pure is not None and not owned:
            current, new_state[i] = lists.apply_pure(current, new_state[i], view)
            continue
        if lists.writes_updates and current:
            borrowed = [j for j, u in enumerate(current) if id(u) in callers]
            if borrowed:
                current = list(current)
                copies = copy_tensors([current[j] for j in borrowed])
                for j, copy in zip(borrowed, copies, strict=True):
                    current[j] = copy
        current, new_state[i] = lists.apply(current, _copy_state(new_state[i]), view)
    return current, tuple(new_state)
