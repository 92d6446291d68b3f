"""The one place that fixes how pytrees are read, plus the tree maths built on it.

Policy (used by every transform, alias and the ``Optimizer`` adapter):

* ``NAMESPACE = "functional_optim"``: register custom containers with
  ``optree.register_pytree_node(cls, flatten, unflatten, namespace="functional_optim")``.
* ``NONE_IS_LEAF = True``: ``None`` is a leaf, so a gradient tree with ``None`` where a param has
  no gradient keeps the params' structure. Transforms treat a ``None`` gradient as torch treats a
  missing ``.grad``: the param is skipped, its update is ``None`` and its state is left alone.

Transforms flatten a pytree once at their boundary (optree's C++ flatten), work on flat lists and
unflatten once; nothing calls a Python function per leaf through ``tree_map`` on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import optree
import torch
from torch import Tensor

__all__ = [
    "NAMESPACE",
    "NONE_IS_LEAF",
    "PyTree",
    "TreeSpec",
    "global_norm",
    "leaves_like",
    "tree_add",
    "tree_clone",
    "tree_flatten",
    "tree_full_like",
    "tree_global_norm",
    "tree_leaves",
    "tree_map",
    "tree_scale",
    "tree_structure",
    "tree_sub",
    "tree_unflatten",
    "tree_zeros_like",
]

NAMESPACE = "functional_optim"
NONE_IS_LEAF = True

#: Any nesting of dicts, lists, tuples and namedtuples with tensor (or ``None``) leaves.
PyTree: TypeAlias = Any
TreeSpec: TypeAlias = optree.PyTreeSpec


#: Leaf types of a flat list that :func:`tree_flatten` reads without optree's walk.
_FLAT_LEAF_TYPES = frozenset({Tensor, torch.nn.Parameter, type(None)})


#: list length -> its treespec (a plain dict, not ``functools.lru_cache``: torch.compile
#: traces a dict lookup, and warns on an lru_cache wrapper)
_LIST_SPECS: dict[int, TreeSpec] = {}


def _list_spec(length: int) -> TreeSpec:
    spec = _LIST_SPECS.get(length)
    if spec is None:
        leaves: Any = [None] * length
        spec = optree.tree_structure(leaves, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
        if len(_LIST_SPECS) < 64:
            _LIST_SPECS[length] = spec
    return spec


def tree_flatten(tree: PyTree) -> tuple[list[Any], TreeSpec]:
    """Flatten ``tree`` under the package policy.

    A plain list of tensors (a param list, the common case) skips optree's walk, which costs
    about 0.5 ms per 1000 leaves: its structure depends on its length only.

    Args:
        tree: a pytree.

    Returns:
        ``(leaves, treespec)``; ``None`` entries are leaves.
    """
    if type(tree) is list and set(map(type, tree)) <= _FLAT_LEAF_TYPES:
        return list(tree), _list_spec(len(tree))
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    return leaves, spec


def tree_unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Rebuild a pytree of structure ``spec`` from ``leaves``."""
    return optree.tree_unflatten(spec, leaves)


def tree_leaves(tree: PyTree) -> list[Any]:
    """Return the leaves of ``tree`` (``None`` entries included)."""
    leaves: list[Any] = optree.tree_leaves(tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    return leaves


def tree_structure(tree: PyTree) -> TreeSpec:
    """Return the structure of ``tree`` under the package policy."""
    return optree.tree_structure(tree, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)


def leaves_like(spec: TreeSpec, tree: PyTree, what: str = "tree") -> list[Any]:
    """Flatten ``tree``, which must have the structure ``spec``, into its leaves.

    Args:
        spec: the reference structure (usually that of the gradients or params).
        tree: a tree mirroring it (state buffers, params).
        what: a name for ``tree`` used in the error message.

    Returns:
        The leaves of ``tree`` in ``spec`` order.

    Raises:
        ValueError: if the structures differ.
    """
    if type(tree) is list and _LIST_SPECS.get(len(tree)) is spec:
        return list(tree)  # a flat list against a flat list's spec (as flatten_up_to gives)
    try:
        leaves: list[Any] = spec.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"{what} does not have the structure of the gradients/params ({spec}); pass trees "
            f"with the same nesting (use None for a missing gradient): {err}"
        ) from None
    if len(leaves) != spec.num_leaves:  # pragma: no cover - flatten_up_to guarantees this
        raise ValueError(f"{what} has {len(leaves)} leaves, expected {spec.num_leaves}")
    return leaves


def tree_map(fn: Callable[..., Any], tree: PyTree, *rests: PyTree) -> PyTree:
    """Map ``fn`` over the leaves of ``tree`` (and matching leaves of ``rests``)."""
    return optree.tree_map(fn, tree, *rests, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)


def _map2(fn: Callable[[Tensor, Tensor], Tensor], a: PyTree, b: PyTree) -> PyTree:
    leaves, spec = tree_flatten(a)
    others = leaves_like(spec, b, "second tree")
    out = [
        None if x is None or y is None else fn(x, y) for x, y in zip(leaves, others, strict=True)
    ]
    return tree_unflatten(spec, out)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a + b``; a ``None`` leaf on either side gives ``None``."""
    return _map2(torch.add, a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``a - b``; a ``None`` leaf on either side gives ``None``."""
    return _map2(torch.sub, a, b)


def tree_scale(tree: PyTree, scalar: float | Tensor) -> PyTree:
    """Leafwise ``leaf * scalar`` (``None`` leaves kept)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [None if x is None else x * scalar for x in leaves])


def tree_zeros_like(tree: PyTree) -> PyTree:
    """Zeros shaped like each leaf (``None`` leaves kept)."""
    return tree_full_like(tree, 0.0)


def tree_full_like(tree: PyTree, value: float) -> PyTree:
    """Tensors filled with ``value`` shaped like each leaf (``None`` leaves kept)."""
    leaves, spec = tree_flatten(tree)
    out = [
        None if x is None else torch.full_like(x, value, memory_format=torch.preserve_format)
        for x in leaves
    ]
    return tree_unflatten(spec, out)


def tree_clone(tree: PyTree) -> PyTree:
    """Clone every tensor leaf (``None`` leaves kept)."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [None if x is None else x.clone() for x in leaves])


def global_norm(leaves: Sequence[Tensor | None]) -> Tensor:
    """2-norm of all tensors in ``leaves`` seen as one vector, as ``torch.nn.utils`` computes it.

    Per-tensor norms first, then the norm of their stack (``None`` entries skipped); 0 for none.
    """
    norms = [torch.linalg.vector_norm(x, 2.0) for x in leaves if x is not None]
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    total: Tensor = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
    return total


def tree_global_norm(tree: PyTree) -> Tensor:
    """2-norm of all leaves of ``tree`` seen as one vector (see :func:`global_norm`)."""
    return global_norm(tree_leaves(tree))
