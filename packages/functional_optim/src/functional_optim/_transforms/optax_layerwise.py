"""optax's layer-wise scalings: ``scale_by_novograd`` (a second moment per param) and
``scale_by_sm3`` (one accumulator per dimension), with optax's names, defaults and maths."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._shard_context import owner_infos, sharded_norms
from functional_optim._sharded_state import all_reduce_max, state_zeros
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import moment, store
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._tree import PyTree, leaves_like, tree_flatten, tree_zeros_like

__all__ = ["ScaleByNovogradState", "ScaleBySM3State", "scale_by_novograd", "scale_by_sm3"]

Scalar = float | Tensor


class ScaleByNovogradState(NamedTuple):
    """State of :func:`scale_by_novograd`: counts, momentum, per-param squared norm (0-d)."""

    count: PyTree
    mu: PyTree
    nu: PyTree


class ScaleBySM3State(NamedTuple):
    """State of :func:`scale_by_sm3`: one accumulator per dimension of each param (``mu``, a list
    per param) and the momentum ``nu``."""

    mu: PyTree
    nu: PyTree


def _shard_norms(active: list[tuple[Tensor, Tensor | None]]) -> Iterator[Tensor] | None:
    """The whole-tensor 2-norms of the gradients of DTensor shards in ``fo.Optimizer``'s local
    step (FSDP2), with one collective; None outside it (the local norm is the whole one)."""
    if not active or any(p is None for _, p in active):
        return None
    norms = sharded_norms([g for g, _ in active], [p for _, p in active if p is not None])
    return None if norms is None else iter(norms)


@transform_factory
def scale_by_novograd(
    b1: Scalar = 0.9,
    b2: Scalar = 0.25,
    eps: Scalar = 1e-8,
    eps_root: Scalar = 0.0,
    weight_decay: Scalar = 0.0,
) -> GradientTransformation:
    """NovoGrad: a per-param (layer-wise) second moment of ``||g||**2``.

    First step: ``nu = ||g||**2``, ``mu = g / (sqrt(nu + eps_root) + eps) + wd * p``; then
    ``nu = b2 * nu + (1 - b2) * ||g||**2`` and ``mu = b1 * mu + (same addition)``; output ``mu``.

    Args:
        b1: decay of the momentum.
        b2: decay of the squared norm.
        eps: added to the denominator outside the root.
        eps_root: added inside the root.
        weight_decay: weight decay added inside the momentum (needs ``params`` when non-zero).

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByNovogradState`.
    """

    def init(params: PyTree) -> ScaleByNovogradState:
        leaves, spec = tree_flatten(params)
        nu = [
            None if p is None else torch.zeros((), dtype=p.dtype, device=p.device) for p in leaves
        ]
        return ScaleByNovogradState(
            _ops.zero_counts(params), tree_zeros_like(params), spec.unflatten(nu)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        decays = isinstance(weight_decay, Tensor) or weight_decay != 0
        if decays:
            _ops.require_params(params, "scale_by_novograd with weight_decay")
        leaves, spec = tree_flatten(updates)
        ps = leaves_like(spec, params, "params") if params is not None else [None] * len(leaves)
        active = [(g, p) for g, p in zip(leaves, ps, strict=True) if g is not None]
        it = iter([p for _, p in active])
        norm_it = _shard_norms(active)

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            p = next(it)
            count = _ops.increment(count, inplace)
            first = count == 1
            squared = (torch.linalg.vector_norm(g) if norm_it is None else next(norm_it)) ** 2
            new_nu = torch.where(first, squared, moment(squared, nu, b2))
            addition = g / (torch.sqrt(new_nu + eps_root) + eps)
            if decays:
                addition = addition + weight_decay * p
            new_mu = torch.where(first, addition, b1 * mu + addition)
            return new_mu, count, store(mu, new_mu, inplace), store(nu, new_nu, inplace)

        return _ops.map_state(updates, state, ScaleByNovogradState, leaf)

    lists = leafwise_lists("scale_by_novograd", {}, update)
    return GradientTransformation(init, update, lists=lists)


def _sm3_view(x: Tensor) -> Tensor:
    return x.reshape(1) if x.ndim == 0 else x


def _amax(acc: Tensor, dims: list[int]) -> Tensor:
    """``amax`` over ``dims``; zeros (``acc >= 0``) where they are empty (an empty row shard)."""
    if any(acc.shape[d] == 0 for d in dims):
        return acc.new_zeros([s for d, s in enumerate(acc.shape) if d not in dims])
    return torch.amax(acc, dim=dims)


def _sm3_row_shards(active: list[tuple[Tensor, Tensor | None]]) -> tuple[Any, set[int]]:
    """The mesh and the positions (among ``active``) of the gradients of 2+ dims whose params
    are FSDP2 row shards in ``fo.Optimizer``'s local step; ``(None, set())`` outside it."""
    if not active or any(p is None for _, p in active):
        return None, set()
    infos = owner_infos([p for _, p in active if p is not None])
    if infos is None:
        return None, set()
    rows = {
        k
        for k, ((g, _), f) in enumerate(zip(active, infos, strict=True))
        if f.shard_dims and g.dim() > 1
    }
    return infos[0].mesh, rows


@transform_factory
def scale_by_sm3(b1: Scalar = 0.9, b2: Scalar = 1.0, eps: Scalar = 1e-8) -> GradientTransformation:
    """SM3: one accumulator per dimension, their minimum as the second moment, then momentum.

    ``acc = c * g**2 + b2 * min_i(mu_i)`` (``c = 1 - b2``, or 1 when ``b2 == 1``), output
    ``nu = ema(g * rsqrt(acc + eps), b1)`` (``g * 0`` where ``acc == 0``), and each ``mu_i`` becomes
    the maximum of ``acc`` over the other dimensions. A 0-d param is treated as shape ``(1,)``
    (optax rejects it).

    Args:
        b1: decay of the momentum.
        b2: decay of the accumulators (1: plain sums).
        eps: added inside the root.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleBySM3State`.
    """
    coeff = 1.0 if not isinstance(b2, Tensor) and b2 == 1.0 else 1 - b2

    def init(params: PyTree) -> ScaleBySM3State:
        leaves, spec = tree_flatten(params)
        mu = [  # one per dimension; on an FSDP2 row shard the first is split, the others whole
            None
            if p is None
            else [state_zeros(p, (s,), {0: d}) for d, s in enumerate(_sm3_view(p).shape)]
            for p in leaves
        ]
        return ScaleBySM3State(spec.unflatten(mu), tree_zeros_like(params))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        leaves, spec = tree_flatten(updates)
        ps = leaves_like(spec, params, "params") if params is not None else [None] * len(leaves)
        mesh, sharded = _sm3_row_shards(
            [(g, p) for g, p in zip(leaves, ps, strict=True) if g is not None]
        )
        ordinal = iter(range(len(leaves)))
        partial: list[Tensor] = []  # mu_i (i > 0) of row shards: maxima over the local rows

        def leaf(g: Tensor, mu: list[Tensor], nu: Tensor) -> tuple[object, ...]:
            split = next(ordinal) in sharded
            x = _sm3_view(g)
            ndim = x.ndim
            views = [
                m.reshape([1] * i + [x.shape[i]] + [1] * (ndim - i - 1)) for i, m in enumerate(mu)
            ]
            low = views[0] if ndim < 2 else functools.reduce(torch.minimum, views)
            acc = coeff * x * x + b2 * low
            scale = torch.where(acc > 0, torch.rsqrt(acc + eps), torch.zeros_like(acc))
            new_nu = moment((x * scale).reshape(g.shape), nu, b1)
            if ndim < 2:
                new_mu = [acc]
            else:
                others = [[d for d in range(ndim) if d != i] for i in range(ndim)]
                new_mu = [_amax(acc, dims) for dims in others]
            mu = [store(m, n, inplace) for m, n in zip(mu, new_mu, strict=True)]
            if split:
                partial.extend(mu[1:])
            return new_nu, mu, store(nu, new_nu, inplace)

        out = _ops.map_state(updates, state, ScaleBySM3State, leaf)
        if partial:  # one all-reduce (max) over the mesh for every row shard's mu_i, i > 0
            flat = torch.cat([m.reshape(-1).to(torch.float64) for m in partial])
            pieces = torch.split_with_sizes(
                all_reduce_max(flat, mesh), [m.numel() for m in partial]
            )
            for m, piece in zip(partial, pieces, strict=True):
                m.copy_(piece.view(m.shape))
        return out

    lists = leafwise_lists("scale_by_sm3", {}, update)
    return GradientTransformation(init, update, lists=lists)
