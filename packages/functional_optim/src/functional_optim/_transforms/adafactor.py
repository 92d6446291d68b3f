"""``scale_by_adafactor``: Adafactor's factored second moments and relative step size."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._shard_context import ShardInfo, owner_infos
from functional_optim._sharded_adafactor import sharded_directions
from functional_optim._sharded_state import state_zeros
from functional_optim._transforms import _ops
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._tree import PyTree, tree_flatten

__all__ = [
    "ScaleByAdafactorState",
    "check_real",
    "col_var_shape",
    "row_var_shape",
    "scale_by_adafactor",
    "variance_shape",
]


class ScaleByAdafactorState(NamedTuple):
    """State of :func:`scale_by_adafactor`; torch's ``step``, ``row_var``, ``col_var``
    (params with ``dim() > 1``; None leaves otherwise) and ``variance`` (the others)."""

    count: PyTree
    row_var: PyTree
    col_var: PyTree
    variance: PyTree


def row_var_shape(shape: torch.Size) -> tuple[int, ...] | None:
    """The shape of a param's ``row_var`` (torch's: the last dimension reduced), None for a
    param of one dimension or none (it keeps a full ``variance`` instead)."""
    return (*shape[:-1], 1) if len(shape) > 1 else None


def col_var_shape(shape: torch.Size) -> tuple[int, ...] | None:
    """The shape of a param's ``col_var`` (the second-to-last dimension reduced), or None."""
    return (*shape[:-2], 1, shape[-1]) if len(shape) > 1 else None


def variance_shape(shape: torch.Size) -> tuple[int, ...] | None:
    """The shape of a param's full ``variance``: its own for one dimension or none, else None."""
    return None if len(shape) > 1 else tuple(shape)


def _factors(params: PyTree) -> tuple[PyTree, PyTree, PyTree]:
    leaves, spec = tree_flatten(params)
    rows: list[Tensor | None] = []
    cols: list[Tensor | None] = []
    full: list[Tensor | None] = []
    for p in leaves:
        row = None if p is None else row_var_shape(p.shape)
        col = None if p is None else col_var_shape(p.shape)
        rows.append(None if row is None else state_zeros(p, row, {0: 0}))
        last = {1: 1} if p.dim() == 2 else {0: 0}  # a matrix's columns; else the batch dim
        cols.append(None if col is None else state_zeros(p, col, last))
        full.append(None if p is None or row is not None else torch.zeros_like(p))
    return spec.unflatten(rows), spec.unflatten(cols), spec.unflatten(full)


def check_real(params: list[Tensor], grads: list[Tensor | None]) -> None:
    """torch's errors for what Adafactor does not take, raised before anything changes.

    Raises:
        RuntimeError: for a complex param or a sparse gradient (torch's messages).
    """
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if torch.is_complex(p):
            raise RuntimeError("Adafactor does not support complex parameters")
        if g.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")


def _sharded_leaves(ps: list[Tensor], grads: list[Tensor | None]) -> dict[int, ShardInfo]:
    """The leaves with a gradient whose params are DTensor shards in ``fo.Optimizer``'s local
    step (the shard context), with their :class:`ShardInfo`; empty outside it."""
    active = [i for i, g in enumerate(grads) if g is not None]
    infos = owner_infos([ps[i] for i in active])
    if infos is None:
        return {}
    return {i: info for i, info in zip(active, infos, strict=True) if info.shard_dims}


def _lerp(x: Tensor, end: Tensor, weight: Tensor, inplace: bool) -> Tensor:
    """``x + weight * (end - x)`` with a 0-d tensor weight."""
    return x.lerp_(end, weight) if inplace else x.lerp(end, weight)


def _machine_eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@transform_factory
def scale_by_adafactor(
    lr: float | Tensor = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
) -> GradientTransformation:
    """Adafactor (``torch.optim.Adafactor``) without weight decay: the whole update.

    Second moment ``v`` (factored as ``row_var @ col_var / mean(row_var)`` for params with
    more than one dimension) decays with ``1 - t ** beta2_decay``; the update
    ``g / sqrt(max(v, eps1**2))`` is clipped to RMS ``d`` and scaled by
    ``-max(eps2, rms(param)) * min(lr, 1 / sqrt(t))``, as ``torch.optim.Adafactor``. ``eps1``
    None is the machine epsilon of each param's dtype. A 0-d tensor ``lr`` enters by tensor
    ops (never read as a number), so ``update`` works under ``torch.func.grad`` and ``vmap``.

    Args:
        lr: caps the relative step size (a float or a 0-d tensor).
        beta2_decay: exponent of the second-moment decay (<= 0).
        eps: ``(eps1, eps2)``: second-moment floor and param-RMS floor.
        d: clipping threshold of the update's RMS.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAdafactorState`; ``update``
        needs the params (the step size is relative to their RMS).
    """
    eps1, eps2 = eps

    def init(params: PyTree) -> ScaleByAdafactorState:
        rows, cols, full = _factors(params)
        return ScaleByAdafactorState(_ops.zero_counts(params), rows, cols, full)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        _ops.require_params(params, "scale_by_adafactor")
        leaves, spec, (ps, counts, rows, cols, full) = _ops.flat(
            updates, params, state.count, state.row_var, state.col_var, state.variance
        )
        check_real(ps, leaves)
        sharded = _sharded_leaves(ps, leaves)
        out: list[Tensor | None] = []
        for i, g in enumerate(leaves):
            if g is None or i in sharded:  # FSDP2 shards: below, with collectives
                out.append(None)
                continue
            p = ps[i]
            counts[i] = count = _ops.increment(counts[i], inplace)
            step = count.to(torch.float64)
            weight = (step**beta2_decay).to(g.dtype)
            rho = torch.clamp(step.rsqrt(), max=lr)
            rms = torch.linalg.vector_norm(p).to(torch.float64) / p.numel() ** 0.5
            alpha = torch.clamp(rms, min=eps2) * rho
            floor = _machine_eps(p.dtype) if eps1 is None else eps1
            if g.dim() > 1:
                row_mean = torch.linalg.vector_norm(g, 2, [-1], True).square() / g.size(-1)
                col_mean = torch.linalg.vector_norm(g, 2, [-2], True).square() / g.size(-2)
                rows[i] = row = _lerp(rows[i], row_mean, weight, inplace)
                cols[i] = col = _lerp(cols[i], col_mean, weight, inplace)
                estimate = (row @ col) / row.mean(dim=-2, keepdim=True).clamp(min=floor)
            else:
                full[i] = estimate = _lerp(full[i], g * g, weight, inplace)
            direction = estimate.clamp(min=floor * floor).rsqrt() * g
            ratio = torch.linalg.vector_norm(direction).to(torch.float64) / (
                direction.numel() ** 0.5 * d
            )
            scale = -alpha / torch.clamp(ratio, min=1.0)
            out.append(direction * _ops.like(scale, direction))
        if sharded:
            for column in (counts, rows, cols, full):  # sharded_directions writes in place
                for i in sharded:
                    buf = column[i]
                    if buf is not None and not inplace:
                        column[i] = buf.clone()
            k = list(sharded)
            floors = [_machine_eps(ps[i].dtype) if eps1 is None else eps1 for i in k]
            directions, sizes = sharded_directions(
                [ps[i] for i in k], [leaves[i] for i in k], [rows[i] for i in k],
                [cols[i] for i in k], [full[i] for i in k], [counts[i] for i in k],
                list(sharded.values()), d, float(lr), beta2_decay, floors, eps2,
            )  # fmt: skip
            for i, direction, size in zip(k, directions, sizes, strict=True):
                out[i] = direction * size
        columns = (counts, rows, cols, full)
        return spec.unflatten(out), ScaleByAdafactorState(*(spec.unflatten(c) for c in columns))

    lists = leafwise_lists("scale_by_adafactor", {"lr": lr, "d": d}, update)
    return GradientTransformation(init, update, lists=lists)
