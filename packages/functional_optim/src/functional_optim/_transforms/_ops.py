"""Leaf maths written once for both modes: ``inplace=True`` writes into the first operand.

Each transform spells its per-leaf maths with these helpers, so the pure path (new tensors,
differentiable) and the in-place path (state buffers reused) share one definition and run the
same ops in the same order, hence give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

# the step counters live in _counts; re-exported for the transforms that spell _ops.zero_counts
from functional_optim._counts import increment_counts as increment_counts
from functional_optim._counts import scalar_dtype as scalar_dtype
from functional_optim._counts import zero_counts as zero_counts
from functional_optim._tree import PyTree, TreeSpec, leaves_like, tree_flatten

Scalar = float | Tensor


def like(scalar: Scalar, x: Tensor) -> Scalar:
    """A 0-d tensor scalar cast to ``x``'s dtype (what ops do with a scalar operand anyway), so a
    0-d ``x`` keeps its dtype instead of being promoted to the scalar's; floats pass through."""
    if isinstance(scalar, Tensor) and scalar.dtype != x.dtype:
        return scalar.to(x.dtype)
    return scalar


def mul(x: Tensor, y: Scalar | Tensor, inplace: bool) -> Tensor:
    """``x * y``."""
    return x.mul_(y) if inplace else x.mul(y)


def div(x: Tensor, y: Scalar | Tensor, inplace: bool) -> Tensor:
    """``x / y``."""
    return x.div_(y) if inplace else x.div(y)


def add(x: Tensor, y: Scalar | Tensor, inplace: bool, alpha: float = 1.0) -> Tensor:
    """``x + alpha * y``."""
    if alpha == 1.0:
        return x.add_(y) if inplace else x.add(y)
    return x.add_(y, alpha=alpha) if inplace else x.add(y, alpha=alpha)


def addcmul(x: Tensor, a: Tensor, b: Tensor, value: float, inplace: bool) -> Tensor:
    """``x + value * a * b``."""
    return x.addcmul_(a, b, value=value) if inplace else x.addcmul(a, b, value=value)


def lerp(x: Tensor, end: Tensor, weight: float, inplace: bool) -> Tensor:
    """``x + weight * (end - x)``."""
    return x.lerp_(end, weight) if inplace else x.lerp(end, weight)


def maximum(x: Tensor, y: Tensor, inplace: bool) -> Tensor:
    """Elementwise ``max(x, y)``."""
    return torch.maximum(x, y, out=x) if inplace else torch.maximum(x, y)


def increment(count: Tensor, inplace: bool) -> Tensor:
    """``count + 1`` (a 0-d step counter)."""
    return count.add_(1) if inplace else count + 1


def bias_correction(beta: float, count: Tensor) -> Tensor:
    """``1 - beta ** count`` in float64, as torch computes it from the Python step number."""
    return 1 - beta ** count.to(torch.float64)


def flat(updates: PyTree, *trees: PyTree) -> tuple[list[Any], TreeSpec, list[list[Any]]]:
    """Flatten ``updates`` once and each of ``trees`` against its structure.

    Returns:
        ``(update_leaves, spec, [leaves of each tree])``.
    """
    leaves, spec = tree_flatten(updates)
    return leaves, spec, [leaves_like(spec, t, "state/params") for t in trees]


def map_state(
    updates: PyTree,
    state: Any,
    state_type: Any,
    leaf_fn: Callable[..., tuple[Any, ...]],
    absent: Sequence[str] = (),
) -> tuple[PyTree, Any]:
    """Run a transform's per-leaf maths over ``updates`` and its state, flattening once.

    ``leaf_fn(u, *state_leaves) -> (out, *new_state_leaves)`` runs for every update leaf that
    is not None, with one state leaf per field of ``state_type`` (a NamedTuple class), in field
    order; a leaf whose update is None outputs None and keeps its state.

    Args:
        updates: the incoming updates.
        state: the transform's state (read field by field, by name).
        state_type: the NamedTuple class of the new state.
        leaf_fn: the per-leaf maths.
        absent: fields that hold no tree in this configuration (e.g. ``nu_max`` without
            AMSGrad): ``leaf_fn`` gets None for them and they stay None.

    Returns:
        ``(new updates, state_type(...))``.
    """
    fields = state_type._fields
    trees = [getattr(state, f) for f in fields if f not in absent]
    leaves, spec, lists = flat(updates, *trees)
    stored = iter(lists)
    columns = [[None] * len(leaves) if f in absent else next(stored) for f in fields]
    out: list[Any] = []
    for i, u in enumerate(leaves):
        if u is None:
            out.append(None)
            continue
        result = leaf_fn(u, *[column[i] for column in columns])
        out.append(result[0])
        for column, value in zip(columns, result[1:], strict=True):
            column[i] = value
    new_state = state_type(
        *[None if f in absent else spec.unflatten(c) for f, c in zip(fields, columns, strict=True)]
    )
    return spec.unflatten(out), new_state


def require_params(params: PyTree, name: str) -> None:
    """Raise a clear error when a transform that reads params was given none."""
    if params is None:
        raise ValueError(f"{name} needs the params: call update(updates, state, params)")


def none_or(xs: Sequence[Tensor | None]) -> bool:
    """Whether every entry is None."""
    return all(x is None for x in xs)
