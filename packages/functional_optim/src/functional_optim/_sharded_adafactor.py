"""Adafactor on FSDP2 shards: factored statistics finished with collectives over the mesh.

``fo.adafactor``'s kernel is wrapped (:func:`shards_adafactor`) so that, inside
``fo.Optimizer``'s local step of DTensor params (the shard context of
:mod:`functional_optim._shard_context` is installed), params split by rows (``Shard(0)`` on a
1-D mesh, FSDP2) go through :func:`adafactor_on_shards`, replicated ones through the kernel.

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

``scale_by_adafactor`` (the transform, e.g. in a chain run by ``fo.Optimizer``'s local step)
goes through the same :func:`sharded_directions`; :func:`state_zeros` lays out the state
buffers of row-sharded params (also SM3's accumulators, which finish with
:func:`all_reduce_max`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from functional_optim._shard_context import ShardInfo, owner_infos
from functional_optim.kernels.adafactor import dtype_eps

if TYPE_CHECKING:  # the alias builds the spec; importing it here would be circular
    from functional_optim._aliases._kernel_spec import KernelSpec

__all__ = [
    "adafactor_on_shards",
    "all_reduce_max",
    "check_row_placements",
    "is_row_sharded",
    "sharded_directions",
    "shards_adafactor",
    "state_zeros",
]

#: ``(base spec, its wrapped copy)`` by ``id(base spec)``
_SPECS: dict[int, tuple[KernelSpec, KernelSpec]] = {}


def check_row_placements(i: int, params: Sequence[Any], name: str) -> None:
    """Raise unless every sharded DTensor of group ``i`` is ``Shard(0)`` on a 1-D mesh.

    Args:
        i: the group's index.
        params: its DTensor params.
        name: the maths, for the message (``"Adafactor"``, ``"SM3"``).

    Raises:
        ValueError: naming the first param with another layout.
    """
    for k, p in enumerate(params):
        placements = tuple(p.placements)
        if all(placement.is_replicate() for placement in placements):
            continue
        if not is_row_sharded(p):
            raise ValueError(
                f"param {k} of param group {i} has placements {placements} on a "
                f"{len(placements)}-D device mesh; {name} steps sharded params with "
                "Shard(0) on a 1-D mesh (FSDP2) only"
            )


def is_row_sharded(p: Any) -> bool:
    """Whether ``p`` is a DTensor split by rows only: ``Shard(0)`` on a 1-D mesh (FSDP2)."""
    placements = getattr(p, "placements", None)
    if placements is None or not hasattr(p, "_local_tensor") or len(placements) != 1:
        return False
    first = placements[0]
    return bool(first.is_shard(0)) and type(first).__name__ != "_StridedShard"


def state_zeros(p: Any, shape: tuple[int, ...], split: bool) -> Tensor:
    """Zeros of ``shape`` for a state buffer of ``p``: ``p.new_zeros``, except on a row-sharded
    DTensor, where the buffer is split by rows like ``p`` (``split``: its dim 0 is ``p``'s) or
    whole on every rank (a replicated DTensor).

    Args:
        p: the param.
        shape: the buffer's global shape.
        split: whether dim 0 of the buffer follows ``p``'s rows.
    """
    if not is_row_sharded(p):
        return p.new_zeros(shape)  # type: ignore[no-any-return]
    if split:
        local = p._local_tensor.new_zeros((p._local_tensor.shape[0], *shape[1:]))
        placements = p.placements
    else:  # the placements of a 0-d tensor of p's mesh: Replicate
        local, placements = p._local_tensor.new_zeros(shape), p.new_empty(()).placements
    stride = torch.empty(shape, device="meta").stride()
    return type(p).from_local(  # type: ignore[no-any-return]
        local, p.device_mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def all_reduce_max(t: Tensor, mesh: Any) -> Tensor:
    """The element-wise maximum of ``t`` over the ranks of the 1-D ``mesh``."""
    ops = torch.ops._c10d_functional
    out = ops.all_reduce(t, "max", mesh.get_group(0).group_name)
    return ops.wait_tensor(out)  # type: ignore[no-any-return]


def _all_reduce(t: Tensor, mesh: Any) -> Tensor:
    """Sum ``t`` over the ranks of the 1-D ``mesh``."""
    ops = torch.ops._c10d_functional
    out = ops.all_reduce(t, "sum", mesh.get_group(0).group_name)
    return ops.wait_tensor(out)  # type: ignore[no-any-return]


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
    weights: list[float] = []
    rhos: list[float] = []
    scalars: list[Tensor] = []  # per param: its sum of squares; per matrix: its row_var sum
    columns: list[Tensor] = []  # per matrix: the column sums of its squared gradient
    for j, (p, g) in enumerate(zip(params, grads, strict=True)):
        step_t = state_steps[j]
        step_t += 1
        step = float(step_t.item())
        weights.append(step**beta2_decay)
        rhos.append(min(lr, 1 / (step**0.5)))
        scalars.append(_squares(p))  # the param RMS, before any decay
        row, col = row_vars[j], col_vars[j]
        if g.dim() > 1:
            assert row is not None
            assert col is not None
            row_mean = torch.linalg.vector_norm(g, 2.0, [-1], True).square_()
            row.lerp_(row_mean.div_(g.size(-1)), weights[j])
            if g.dim() == 2:  # rows are split: column sums and the row_var sum are partial
                columns.append(g.to(torch.float64).square().sum(0))
                scalars.append(row.sum(dtype=torch.float64).reshape(1))
            else:
                col_mean = torch.linalg.vector_norm(g, 2.0, [-2], True).square_()
                col.lerp_(col_mean.div_(g.size(-2)), weights[j])
        else:
            variance = variances[j]
            assert variance is not None
            variance.lerp_(g * g, weights[j])
    total = _all_reduce(torch.cat(scalars + columns), mesh)
    sums = iter(total[: len(scalars)].tolist())
    col_sums = iter(torch.split_with_sizes(total[len(scalars) :], [c.numel() for c in columns]))

    updates: list[Tensor] = []
    alphas: list[float] = []
    for j, g in enumerate(grads):
        rms = next(sums) ** 0.5 / infos[j].numel ** 0.5
        alphas.append(max(eps2, rms) * rhos[j])
        row, col, floor = row_vars[j], col_vars[j], floors[j]
        if g.dim() == 2:
            assert row is not None
            assert col is not None
            rows = infos[j].numel // g.size(-1)
            col_mean = next(col_sums) / rows
            col.lerp_(col_mean.to(col.dtype).view(col.shape), weights[j])
            estimate = (row @ col).div_(max(next(sums) / rows, floor))
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
    norms = _all_reduce(torch.cat([_squares(u) for u in updates]), mesh).tolist()
    sizes = [
        -alphas[j] / max(1.0, norms[j] ** 0.5 / ((infos[j].numel ** 0.5) * d))
        for j in range(len(updates))
    ]
    return updates, sizes


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
