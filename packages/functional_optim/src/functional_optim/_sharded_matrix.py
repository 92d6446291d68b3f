"""Muon on FSDP2 shards: each matrix orthogonalised once, on one owner rank.

Newton-Schulz reads a whole matrix, so it cannot run on a row shard. ``fo.muon``'s kernel is
wrapped (:func:`shards_matrices`) so that, inside ``fo.Optimizer``'s local step of DTensor
params (:mod:`functional_optim._sharded_params` installs :func:`outer_params`), the sharded
matrices of a step go through :func:`muon_on_shards`:

1. the momentum is updated element-wise on the local shards (it stays sharded);
2. every matrix gets one owner rank (:func:`assign_owners`: a balanced greedy assignment by
   cost ``m * n * min(m, n)``, the same on every rank);
3. the local shards of the direction, cast to bfloat16 (the dtype Newton-Schulz computes in:
   the cast is element-wise, so the owner sees exactly the cast of the full matrix), travel to
   their owners in one ``all_to_all_single``;
4. each owner orthogonalises its matrices and a second ``all_to_all_single`` returns the rows
   of the result to the ranks that hold them;
5. every rank applies the decay and the (shape-adjusted) step to its local shards.

The owner runs the unsharded maths on the unsharded input, so the result is bitwise that of
``torch.optim.Muon`` on the full tensors. The collectives go through
``torch.ops._c10d_functional`` (this package never imports ``torch.distributed``). Every rank
must step the same matrices (the params with a gradient), as FSDP2 guarantees.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._aliases._kernel_spec import KernelSpec
from functional_optim.kernels.muon import adjusted_lr_ratio, newton_schulz

__all__ = ["assign_owners", "check_muon_placements", "outer_params", "shards_matrices"]

#: the contexts installed, innermost last: ``id(local param) -> DTensor param``
_ACTIVE: list[dict[int, Any]] = []

#: ``(shapes, world size) -> owners`` (a model steps the same matrices every step)
_OWNERS: dict[tuple[tuple[tuple[int, int], ...], int], list[int]] = {}

#: ``(base spec, its wrapped copy)`` by ``id(base spec)``
_SPECS: dict[int, tuple[KernelSpec, KernelSpec]] = {}

#: ``mesh -> its process group's name``
_GROUP_NAMES: dict[Any, str] = {}

_WIRE = torch.bfloat16  # Newton-Schulz's dtype: what travels


@contextlib.contextmanager
def outer_params(by_local: dict[int, Any]) -> Iterator[None]:
    """Install ``id(local param) -> DTensor param`` for the duration of a local step.

    Args:
        by_local: the group's DTensor params by the id of their local tensors.
    """
    _ACTIVE.append(by_local)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _is_sharded(p: Any) -> bool:
    return any(not placement.is_replicate() for placement in p.placements)


def check_muon_placements(i: int, params: Sequence[Any]) -> None:
    """Raise unless every sharded DTensor of group ``i`` is ``Shard(0)`` on a 1-D mesh.

    Raises:
        ValueError: naming the first param with another layout.
    """
    for k, p in enumerate(params):
        if not _is_sharded(p):
            continue
        placements = tuple(p.placements)
        first = placements[0]
        strided = type(first).__name__ == "_StridedShard"
        if len(placements) != 1 or strided or not first.is_shard(0):
            raise ValueError(
                f"param {k} of param group {i} has placements {placements} on a "
                f"{len(placements)}-D device mesh; Muon orthogonalises whole matrices and steps "
                "sharded params with Shard(0) on a 1-D mesh (FSDP2) only"
            )


def row_counts(rows: int, world: int) -> list[int]:
    """The rows of each rank's ``Shard(0)`` chunk (``torch.chunk`` sizes, then empty ones)."""
    chunk = -(-rows // world)
    return [max(0, min(rows, (s + 1) * chunk) - min(rows, s * chunk)) for s in range(world)]


def assign_owners(shapes: Sequence[tuple[int, int]], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: largest cost ``m * n * min(m, n)`` first,
    each onto the least-loaded rank (the lowest rank on ties). Deterministic.

    Args:
        shapes: the matrices' global shapes.
        world: the number of ranks.

    Returns:
        One owner rank per matrix.
    """
    key = (tuple(shapes), world)
    owners = _OWNERS.get(key)
    if owners is None:
        costs = [m * n * min(m, n) for m, n in shapes]
        owners = [0] * len(shapes)
        loads = [0] * world
        for j in sorted(range(len(shapes)), key=lambda j: (-costs[j], j)):
            rank = min(range(world), key=lambda s: (loads[s], s))
            owners[j] = rank
            loads[rank] += costs[j]
        _OWNERS[key] = owners
    return owners


def _all_to_all(send: Tensor, out_splits: list[int], in_splits: list[int], group: str) -> Tensor:
    """One ``all_to_all_single`` of a flat bfloat16 tensor."""
    ops = torch.ops._c10d_functional
    out = ops.all_to_all_single(send, out_splits, in_splits, group)
    return ops.wait_tensor(out)  # type: ignore[no-any-return]


def _flat_cat(parts: list[Tensor], device: torch.device) -> Tensor:
    if not parts:
        return torch.empty(0, dtype=_WIRE, device=device)
    return torch.cat([t.reshape(-1) for t in parts])


def _apply(param: Tensor, ortho: Tensor, lr: float | Tensor, wd: float, ratio: float) -> None:
    """The decay and the step, as ``kernels.muon_single`` writes them."""
    if isinstance(lr, Tensor):
        lr_adjusted = lr * ratio
        param.mul_(1 - lr * wd)
        param.add_(ortho, alpha=-float(lr_adjusted.item()))
    else:
        param.mul_(1 - lr * wd)
        param.add_(ortho, alpha=-(lr * ratio))


def muon_on_shards(
    params: list[Tensor],
    outer: list[Any],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """Muon on the local ``Shard(0)`` shards of matrices of one 1-D mesh (see the module).

    Args:
        params: the local shards.
        outer: their DTensor params.
        grads, momentum_buffers, ...: as ``kernels.muon`` (local shards).
    """
    mesh = outer[0].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    group = _GROUP_NAMES.get(mesh)
    if group is None:
        group = _GROUP_NAMES[mesh] = mesh.get_group(0).group_name
    shapes = [(int(p.shape[0]), int(p.shape[1])) for p in outer]
    owners = assign_owners(shapes, world)
    counts = [row_counts(m, world) for m, _ in shapes]
    device = params[0].device

    directions: list[Tensor] = []
    for g, buf in zip(grads, momentum_buffers, strict=True):
        buf.lerp_(g, 1 - momentum)
        direction = g.lerp(buf, momentum) if nesterov else buf
        directions.append(direction.to(_WIRE))

    by_dest: list[list[int]] = [[] for _ in range(world)]
    for j, owner in enumerate(owners):
        by_dest[owner].append(j)
    in_splits = [sum(directions[j].numel() for j in js) for js in by_dest]
    mine = by_dest[rank]
    out_splits = [sum(counts[j][s] * shapes[j][1] for j in mine) for s in range(world)]
    send = _flat_cat([directions[j] for js in by_dest for j in js], device)
    received = _all_to_all(send, out_splits, in_splits, group)

    sizes = [counts[j][s] * shapes[j][1] for s in range(world) for j in mine]
    pieces = iter(torch.split_with_sizes(received, sizes))
    rows: dict[int, list[Tensor]] = {j: [] for j in mine}
    for _ in range(world):
        for j in mine:
            rows[j].append(next(pieces))
    back: list[list[Tensor]] = [[] for _ in range(world)]
    for j in mine:
        full = torch.cat(rows[j]).view(shapes[j])
        ortho = newton_schulz(full, ns_coefficients, ns_steps, eps)
        for s, part in enumerate(torch.split_with_sizes(ortho, counts[j])):
            back[s].append(part)
    returned = _all_to_all(
        _flat_cat([t for parts in back for t in parts], device), in_splits, out_splits, group
    )

    order = [j for js in by_dest for j in js]
    local = torch.split_with_sizes(returned, [directions[j].numel() for j in order])
    for j, piece in zip(order, local, strict=True):
        ratio = adjusted_lr_ratio(adjust_lr_fn, shapes[j][0], shapes[j][1])
        _apply(params[j], piece.view(params[j].shape), lr, weight_decay, ratio)


def _pick(xs: Sequence[Any], keep: list[int]) -> list[Any]:
    return [xs[k] for k in keep]


def _checked(grads: list[Tensor], ns_steps: int) -> None:
    """Newton-Schulz's checks on every rank before anything moves (an owner raising alone
    would leave the others waiting in the collective)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    for g in grads:
        if g.dim() != 2:
            raise ValueError("Param gradient must be a 2D matrix")


def shards_matrices(spec: KernelSpec) -> KernelSpec:
    """``spec`` (Muon's kernel declaration) with a kernel that steps sharded DTensor matrices
    through :func:`muon_on_shards` and everything else through ``spec.kernel``.

    Args:
        spec: the registered declaration (its kernel takes ``kernels.muon``'s arguments).

    Returns:
        The declaration with the wrapped kernel (cached per ``spec``).
    """
    cached = _SPECS.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    base: Callable[..., None] = spec.kernel

    def muon(
        params: list[Tensor],
        grads: list[Tensor],
        momentum_buffers: list[Tensor],
        lr: float | Tensor,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        eps: float,
        adjust_lr_fn: str | None,
        impl: str = "auto",
    ) -> None:
        by_local = _ACTIVE[-1] if _ACTIVE else None
        outer = [None] * len(params) if by_local is None else [by_local.get(id(p)) for p in params]
        sharded = [k for k, d in enumerate(outer) if d is not None and _is_sharded(d)]
        if not sharded:
            base(
                params, grads, momentum_buffers, lr, weight_decay, momentum, nesterov,
                ns_coefficients, ns_steps, eps, adjust_lr_fn, impl,
            )  # fmt: skip
            return
        _checked(grads, ns_steps)
        hyper = (lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps)
        whole = [k for k in range(len(params)) if k not in set(sharded)]
        if whole:  # replicated matrices: every rank has them whole
            base(
                _pick(params, whole), _pick(grads, whole), _pick(momentum_buffers, whole),
                *hyper, adjust_lr_fn, impl,
            )  # fmt: skip
        muon_on_shards(
            _pick(params, sharded), _pick(outer, sharded), _pick(grads, sharded),
            _pick(momentum_buffers, sharded), *hyper, adjust_lr_fn,
        )  # fmt: skip

    wrapped = dataclasses.replace(spec, kernel=muon)
    _SPECS[id(spec)] = (spec, wrapped)
    return wrapped
