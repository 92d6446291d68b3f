"""Clipping transforms: element-wise (``clip``), per param block (``clip_by_block_rms``) and by
the global norm (``clip_by_global_norm``, ``torch.nn.utils.clip_grad_norm_`` as a transform).

optax's names, defaults and formulas; a ``None`` update stays ``None``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, init_empty
from functional_optim._lists import (
    LeafView,
    ListTransform,
    by_device_dtype,
    foreach_scale,
    foreach_scaled,
)
from functional_optim._recipes import transform_factory
from functional_optim._shard_context import owner_infos, sharded_global_norm, sharded_rms
from functional_optim._transforms import _ops
from functional_optim._transforms._stateless import stateless
from functional_optim._tree import PyTree, global_norm, tree_flatten

__all__ = ["clip", "clip_by_block_rms", "clip_by_global_norm"]

Scalar = float | Tensor


@transform_factory
def clip(max_delta: Scalar) -> GradientTransformation:
    """Clip every update element to ``[-max_delta, max_delta]``.

    Args:
        max_delta: the largest allowed magnitude (>= 0).

    Returns:
        A stateless ``GradientTransformation``.

    Raises:
        ValueError: if ``max_delta`` is negative.
    """
    if not isinstance(max_delta, Tensor) and max_delta < 0:
        raise ValueError(f"Invalid max_delta: {max_delta}; it must be >= 0")

    def fn(u: Tensor) -> Tensor:
        return torch.clamp(u, -max_delta, max_delta)  # type: ignore[arg-type]

    def list_fn(updates: list[Tensor]) -> list[Tensor]:
        out = list(torch._foreach_clamp_min(updates, -max_delta))  # type: ignore[arg-type]
        torch._foreach_clamp_max_(out, max_delta)  # type: ignore[arg-type]
        return out

    tensor_bound = isinstance(max_delta, Tensor)
    return stateless(fn, "clip", {"max_delta": max_delta}, None if tensor_bound else list_fn)


@transform_factory
def clip_by_block_rms(threshold: Scalar) -> GradientTransformation:
    """Divide each update by ``max(1, rms(update) / threshold)`` (per param block).

    Args:
        threshold: the largest allowed root mean square of a block (> 0).

    Returns:
        A stateless ``GradientTransformation``.

    Raises:
        ValueError: if ``threshold`` is not positive.
    """
    if not isinstance(threshold, Tensor) and threshold <= 0:
        raise ValueError(f"Invalid threshold: {threshold}; it must be > 0")

    def fn(u: Tensor) -> Tensor:
        rms = torch.sqrt(torch.mean(u * u))
        return clipped(u, rms)

    def clipped(u: Tensor, rms: Tensor) -> Tensor:
        return u / torch.clamp(rms / threshold, min=1.0)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        rms = sharded_rms(updates, view.params) if updates else None  # DTensor shards
        if rms is None:
            return [fn(u) for u in updates], state
        return [clipped(u, r) for u, r in zip(updates, rms, strict=True)], state

    update = stateless(fn, "clip_by_block_rms").update
    lists = ListTransform("clip_by_block_rms", {"threshold": threshold}, apply, False)
    return GradientTransformation(init_empty, update, lists=lists)


@transform_factory
def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(max_norm / (total_norm + 1e-6), 1)``.

    ``total_norm`` is the 2-norm of all updates seen as one vector, computed as
    ``torch.nn.utils.clip_grad_norm_(..., foreach=False)`` does, so results match it.

    Args:
        max_norm: the largest allowed total norm.

    Returns:
        A stateless ``GradientTransformation``.

    Raises:
        ValueError: if ``max_norm`` is negative.
    """
    if max_norm < 0.0:
        raise ValueError(f"Invalid max_norm value: {max_norm}; it must be >= 0")

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        leaves, spec = tree_flatten(updates)
        if _ops.none_or(leaves):
            return updates, state
        total = global_norm(leaves)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        out = [
            None if u is None else _ops.mul(u, _ops.like(coef.to(u.device), u), inplace)
            for u in leaves
        ]
        return spec.unflatten(out), state

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        total = foreach_global_norm(updates, view.params)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        foreach_scale(updates, coef)
        return updates, state

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        if not updates:
            return updates, state
        total = foreach_global_norm(updates, view.params)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return foreach_scaled(updates, coef), state

    lists = ListTransform(
        "clip_by_global_norm", {"max_norm": max_norm}, apply, apply_pure=apply_pure
    )
    return GradientTransformation(init_empty, update, lists=lists)


def foreach_global_norm(tensors: list[Tensor], owners: list[Tensor] | None = None) -> Tensor:
    """:func:`functional_optim._tree.global_norm` with one ``_foreach_norm`` per device and
    dtype (the same per-tensor norms, so the same number).

    Args:
        tensors: the tensors.
        owners: the param each tensor belongs to; where they are DTensor shards (the shard
            context of ``fo.Optimizer``), the norm is that of the whole DTensors.
    """
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    for group in by_device_dtype(tensors):
        for i, n in zip(group, torch._foreach_norm([tensors[i] for i in group], 2.0), strict=True):
            norms[i] = n
    infos = None if owners is None else owner_infos(owners)
    if infos is not None:
        return sharded_global_norm(norms, infos)
    first = norms[0].device
    if any(n.device != first for n in norms):
        norms = [n.to(first) for n in norms]
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    return total
