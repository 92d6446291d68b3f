"""Adafactor on FSDP2 shards: factored statistics finished with collectives over the mesh.

``fo.adafactor``'s kernel is wrapped (:func:`shards_adafactor`) so that, inside
``fo.Optimizer``'s local step of DTensor params (the shard context of
:mod:`functional_optim._shard_context` is installed), sharded params go through
:func:`adafactor_on_shards`, replicated ones through the kernel.

On a row shard of a matrix ``(m, n)`` the row statistics are local (``row_var`` is split like
the param: local ``(m_local, 1)``), while the column statistics (a sum over the rows) and the
mean of ``row_var`` over the rows are partial sums; ``col_var`` is the full ``(1, n)`` on every
rank (a replicated DTensor outwardly). A param of 3+ dims is split along its leading (batch)
dim, so both factors are local (``col_var`` split like the param too); a vector keeps its
element-wise ``variance``. The param RMS (the relative step size) is a sum of squares over the
whole tensor. All of those partial sums, for every param of the step, travel in ONE float64
all-reduce; the RMS of the update (its clipping, which reads the reduced ``col_var``) needs a
second one. The collectives go through ``torch.ops._c10d_functional`` (this package never
imports ``torch.distributed``). The sums are added in another order than the unsharded kernel's
norms, so results agree with it to float rounding, not bitwise.

A matrix also split along its columns (tensor parallelism, any mesh) has its block's row sums
of the squared gradient added up too: the row and column sums go, at their positions in vectors
of the whole dims, into the same first all-reduce; ``row_var`` is then whole along the columns
(replicated over those mesh dims) and ``col_var`` split like them, and the sum of the new
``row_var`` over all rows takes one more all-reduce (only when such a matrix is stepped).

``scale_by_adafactor`` (the transform, e.g. in a chain run by ``fo.Optimizer``'s local step)
goes through the same :func:`sharded_directions`; ``_sharded_state.state_zeros`` lays out
the state buffers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from functional_optim._matrix_layout import Region, split_dims
from functional_optim._owner_compute import outer_of
from functional_optim._shard_context import ShardInfo, _all_reduce_sum, owner_infos
from functional_optim._sharded_state import matrix_region
from functional_optim.kernels.adafactor import dtype_eps

if TYPE_CHECKING:  # the alias builds the spec; importing it here would be circular
    from functional_optim._aliases._kernel_spec import KernelSpec

__all__ = ["adafactor_on_shards", "sharded_directions", "shards_adafactor"]

#: ``(base spec, its wrapped copy)`` by ``id(base spec)``
_SPECS: dict[int, tuple[KernelSpec, KernelSpec]] = {}


def _squares(t: Tensor) -> Tensor:
    """The sum of squares of ``t`` in float64 (a 1-element tensor)."""
    squares: Tensor = torch.linalg.vector_norm(t, 2.0, dtype=torch.float64).square()
    return squares.reshape(1)


def sharded_directions(
    params: list[Tensor],
    grads: list[Tensor],
    row_vars: list[Tensor | None],
    col_vars: list[Tensor | None],
    variances: list[Tensor | None],
    state_steps: list[Tensor],
    infos: Sequence[ShardInfo],
    d: float,
    lr: float,
    beta2_decay: float,
    floors: Sequence[float],
    eps2: float,
) -> tuple[list[Tensor], list[float]]:
    """Adafactor's (``torch.optim.Adafactor``'s) update directions and step sizes on the local
    ``Shard(0)`` shards of DTensors of one 1-D mesh, with two all-reduces (see the module).
    The state lists are updated in place; the params are only read.

    Args:
        params: the local shards.
        grads, row_vars, col_vars, variances, state_steps: as ``kernels.adafactor`` (local
            tensors; ``col_vars`` of matrices are whole).
        infos: each param's :class:`ShardInfo` (its mesh and global size).
        d, lr, beta2_decay, eps2: as ``kernels.adafactor``.
        floors: each param's second-moment floor (``eps1``, or its dtype's epsilon).

    Returns:
        Each param's direction and the (negative) step size to add it with.
    """
    mesh = infos[0].mesh
    dims = tuple(sorted(frozenset().union(*(info.shard_dims for info in infos))))
    coordinate = mesh.get_coordinate()
    # a tensor replicated over one of ``dims`` adds its sums from coordinate 0 of it only
    keep = [
        1.0 if all(coordinate[d] == 0 for d in dims if d not in info.shard_dims) else 0.0
        for info in infos
    ]
    outer = outer_of(params)
    regions: dict[int, Region] = {}  # matrices split along their columns: this rank's block
    weights: list[float] = []
    rhos: list[float] = []
    scalars: list[Tensor] = []  # per param: its sum of squares; per matrix: its row_var sum
    columns: list[Tensor] = []  # per matrix: the column sums of its squared gradient
    by_rows: list[Tensor] = []  # per column-split matrix: the row sums of its squared gradient
    for j, (p, g) in enumerate(zip(params, grads, strict=True)):
        step_t = state_steps[j]
        step_t += 1
        step = float(step_t.item())
        weights.append(step**beta2_decay)
        rhos.append(min(lr, 1 / (step**0.5)))
        scalars.append(_squares(p) * keep[j])  # the param RMS, before any decay
        row, col = row_vars[j], col_vars[j]
        if g.dim() == 2 and outer[j] is not None and _splits_columns(outer[j]):
            region = regions[j] = matrix_region(outer[j])
            squares = g.to(torch.float64).square()
            columns.append(_placed(squares.sum(0), region.cols, outer[j].shape[1]) * keep[j])
            by_rows.append(_placed(squares.sum(1), region.rows, outer[j].shape[0]) * keep[j])
        elif g.dim() > 1:
            assert row is not None
            assert col is not None
            row_mean = torch.linalg.vector_norm(g, 2.0, [-1], True).square_()
            row.lerp_(row_mean.div_(g.size(-1)), weights[j])
            if g.dim() == 2:  # rows are split: column sums and the row_var sum are partial
                columns.append(g.to(torch.float64).square().sum(0) * keep[j])
                scalars.append(row.sum(dtype=torch.float64).reshape(1) * keep[j])
            else:
                col_mean = torch.linalg.vector_norm(g, 2.0, [-2], True).square_()
                col.lerp_(col_mean.div_(g.size(-2)), weights[j])
        else:
            variance = variances[j]
            assert variance is not None
            variance.lerp_(g * g, weights[j])
    total = _all_reduce_sum(torch.cat(scalars + columns + by_rows), mesh, dims)
    at = len(scalars) + sum(c.numel() for c in columns)
    sums = iter(total[: len(scalars)].tolist())
    col_sums = iter(torch.split_with_sizes(total[len(scalars) : at], [c.numel() for c in columns]))
    row_sums = iter(torch.split_with_sizes(total[at:], [r.numel() for r in by_rows]))
    row_totals = iter(_finish_rows(row_vars, weights, regions, row_sums, keep, mesh, dims, outer))

    updates: list[Tensor] = []
    alphas: list[float] = []
    for j, g in enumerate(grads):
        rms = next(sums) ** 0.5 / infos[j].numel ** 0.5
        alphas.append(max(eps2, rms) * rhos[j])
        row, col, floor = row_vars[j], col_vars[j], floors[j]
        if g.dim() == 2:
            assert row is not None
            assert col is not None
            rows = int(outer[j].shape[0]) if outer[j] is not None else infos[j].numel // g.size(-1)
            col_mean = next(col_sums) / rows
            row_total = next(row_totals) if j in regions else next(sums)
            if j in regions:
                col_mean = _picked(col_mean, regions[j].cols)
            col.lerp_(col_mean.to(col.dtype).view(col.shape), weights[j])
            estimate = (row @ col).div_(max(row_total / rows, floor))
        elif g.dim() > 2:
            assert row is not None
            assert col is not None
            estimate = row @ col
            estimate.div_(row.mean(dim=-2, keepdim=True).clamp_(min=floor))
        else:
            variance = variances[j]
            assert variance is not None
            estimate = variance.clone()
        updates.append(estimate.clamp_(min=floor * floor).rsqrt_().mul_(g))
    squared = [_squares(u) * k for u, k in zip(updates, keep, strict=True)]
    norms = _all_reduce_sum(torch.cat(squared), mesh, dims).tolist()
    sizes = [
        -alphas[j] / max(1.0, norms[j] ** 0.5 / ((infos[j].numel ** 0.5) * d))
        for j in range(len(updates))
    ]
    return updates, sizes


def _splits_columns(p: Any) -> bool:
    """Whether some placement of the DTensor ``p`` splits its dim 1."""
    return any(split is not None and split[0] == 1 for split in map(split_dims, p.placements))


def _placed(local: Tensor, span: Any, size: int) -> Tensor:
    """``local`` (sums over a block's rows or columns) at its positions in a zero vector of the
    whole dim's ``size``."""
    out = local.new_zeros(size)
    if isinstance(span, Tensor):
        out.index_copy_(0, span.to(out.device), local)
    else:
        out[span[0] : span[1]] = local
    return out


def _picked(whole: Tensor, span: Any) -> Tensor:
    """The entries of ``whole`` (a whole dim) at a block's positions."""
    if isinstance(span, Tensor):
        return whole.index_select(0, span.to(whole.device))
    return whole[span[0] : span[1]]


def _finish_rows(
    row_vars: list[Tensor | None],
    weights: list[float],
    regions: dict[int, Region],
    row_sums: Iterator[Tensor],
    keep: list[float],
    mesh: Any,
    dims: tuple[int, ...],
    outer: list[Any],
) -> list[float]:
    """``row_var`` of the column-split matrices from their reduced row sums, then each one's
    sum over the whole matrix (one more all-reduce; none when there are no such matrices)."""
    if not regions:
        return []
    coordinate = mesh.get_coordinate()
    local = []
    for j, region in regions.items():
        row = row_vars[j]
        assert row is not None
        mean = _picked(next(row_sums), region.rows) / int(outer[j].shape[1])
        row.lerp_(mean.to(row.dtype).view(row.shape), weights[j])
        # row_var is whole along the columns: the ranks holding other columns repeat it
        first = all(
            coordinate[d] == 0
            for d, split in enumerate(map(split_dims, outer[j].placements))
            if split is not None and split[0] == 1
        )
        local.append(row.sum(dtype=torch.float64).reshape(1) * (keep[j] if first else 0.0))
    return list(_all_reduce_sum(torch.cat(local), mesh, dims).tolist())


def adafactor_on_shards(
    params: list[Tensor],
    grads: list[Tensor],
    row_vars: list[Tensor | None],
    col_vars: list[Tensor | None],
    variances: list[Tensor | None],
    state_steps: list[Tensor],
    infos: Sequence[ShardInfo],
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    floor: float,
    eps2: float,
    maximize: bool,
) -> None:
    """``kernels.adafactor`` on the local ``Shard(0)`` shards of DTensors of one 1-D mesh
    (:func:`sharded_directions`, then the decay and the step, in place).

    Args:
        params: the local shards (updated in place).
        grads, ...: as :func:`sharded_directions`; ``weight_decay`` and ``maximize`` as
            ``kernels.adafactor``; ``floor``: ``eps1`` resolved to the dtype's epsilon.
    """
    if maximize:
        grads = [-g for g in grads]
    updates, sizes = sharded_directions(
        params, grads, row_vars, col_vars, variances, state_steps, infos,
        d, lr, beta2_decay, [floor] * len(params), eps2,
    )  # fmt: skip
    for p, u, size in zip(params, updates, sizes, strict=True):
        if weight_decay != 0:
            p.mul_(1 - lr * weight_decay)
        p.add_(u, alpha=size)


def _pick(xs: Sequence[Any], keep: list[int]) -> list[Any]:
    return [xs[k] for k in keep]


def shards_adafactor(spec: KernelSpec) -> KernelSpec:
    """``spec`` (Adafactor's kernel declaration) with a kernel that steps row-sharded DTensor
    params through :func:`adafactor_on_shards` and the others through ``spec.kernel``.

    Args:
        spec: the registered declaration (its kernel takes ``kernels.adafactor``'s arguments).

    Returns:
        The declaration with the wrapped kernel (cached per ``spec``).
    """
    cached = _SPECS.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    base: Callable[..., None] = spec.kernel

    def adafactor(
        params: list[Tensor],
        grads: list[Tensor],
        row_vars: list[Tensor | None],
        col_vars: list[Tensor | None],
        variances: list[Tensor | None],
        state_steps: list[Tensor],
        d: float,
        lr: float,
        beta2_decay: float,
        weight_decay: float,
        eps1: float | None,
        eps2: float,
        maximize: bool,
        impl: str = "auto",
    ) -> None:
        infos = owner_infos(params)
        sharded = [] if infos is None else [k for k, f in enumerate(infos) if f.shard_dims]
        if infos is None or not sharded:
            base(
                params, grads, row_vars, col_vars, variances, state_steps,
                d, lr, beta2_decay, weight_decay, eps1, eps2, maximize, impl,
            )  # fmt: skip
            return
        floor = dtype_eps(params[0].dtype) if eps1 is None else eps1  # torch: the first param's
        hyper = (d, lr, beta2_decay, weight_decay, floor, eps2, maximize)
        whole = [k for k in range(len(params)) if not infos[k].shard_dims]
        if whole:  # replicated params: every rank has them whole
            lists = (params, grads, row_vars, col_vars, variances, state_steps)
            base(*(_pick(xs, whole) for xs in lists), *hyper, impl)
        adafactor_on_shards(
            _pick(params, sharded), _pick(grads, sharded), _pick(row_vars, sharded),
            _pick(col_vars, sharded), _pick(variances, sharded), _pick(state_steps, sharded),
            _pick(infos, sharded), *hyper,
        )  # fmt: skip

    wrapped = dataclasses.replace(spec, kernel=adafactor)
    _SPECS[id(spec)] = (spec, wrapped)
    return wrapped
