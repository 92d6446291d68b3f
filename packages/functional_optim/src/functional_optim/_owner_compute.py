"""Whole-matrix functions of sharded DTensor matrices, each computed once, on an owner rank.

Newton-Schulz (Muon) and other matrix methods read a whole matrix, so they cannot run on a
shard. For the matrices of one step, :func:`owner_map`:

1. gives every matrix one owner rank (:func:`assign_owners`: largest cost first onto the
   least-loaded rank; cost ``m * n * min(m, n)`` unless the caller gives another);
2. cuts the matrices into a few batches, each with work for every owner;
3. sends, for every batch at once, each rank's local block (in the wire dtype) to the owners
   in one ``all_to_all_single`` per batch (asynchronous: later batches travel while earlier
   ones are computed);
4. on each owner assembles the whole matrix from the blocks (:mod:`functional_optim.
   _matrix_layout` says where each rank's block sits, for any mix of ``Shard(0|1)``,
   ``_StridedShard`` and ``Replicate`` on a mesh of any rank), runs the function once, and
   sends every rank its block of the result in a second ``all_to_all_single`` per batch;
5. yields each matrix's local result as its return arrives.

A block replicated over some mesh dims is sent once (from coordinate 0 of those dims) and
returned to every replica. The collectives run over the mesh's (flattened) process group
through ``torch.ops._c10d_functional``: this package never imports ``torch.distributed``.

:func:`check_matrix_group` runs once per param group, before its first step: it refuses
placements it cannot take and, with one ``all_gather``, checks that every rank steps the same
matrices (and learns each rank's mesh coordinate).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._matrix_layout import Region, local_region, region_get, region_set, split_dims

__all__ = [
    "assign_owners",
    "check_matrix_group",
    "is_sharded",
    "outer_of",
    "outer_params",
    "owner_map",
    "prepare",
]

#: the most batches a step's matrices are cut into (each batch is two collectives)
MAX_BATCHES = 4

#: the least a batch carries (wire bytes of whole matrices): below it a collective's latency
#: outweighs what overlapping can hide
MIN_BATCH_BYTES = 1 << 20

#: the contexts installed, innermost last: ``id(local param) -> DTensor param``
_ACTIVE: list[dict[int, Any]] = []


class _MeshGroup(NamedTuple):
    """A mesh's (flattened) process group and each group rank's mesh coordinate (checked for
    one list of matrices)."""

    name: str
    rank: int
    coordinates: tuple[tuple[int, ...], ...]


class _Batch(NamedTuple):
    members: list[int]
    mine: list[int]
    send: list[int]  # my matrices' blocks to send, in destination order
    send_splits: list[int]
    recv: list[tuple[int, int]]  # (source rank, matrix) of the blocks I receive
    recv_splits: list[int]
    back: list[tuple[int, int]]  # (destination rank, matrix) of the result blocks I send
    back_splits: list[int]
    results: list[int]  # the matrices whose local results I receive, in order
    result_splits: list[int]


class _Plan(NamedTuple):
    group: _MeshGroup
    regions: list[list[Region]]  # by matrix, then group rank
    batches: list[_Batch]


#: ``(mesh, matrices) -> group``, ``(mesh, matrices, cost) -> plan`` and owners (a model steps
#: the same matrices every step)
_GROUPS: dict[Any, _MeshGroup] = {}
_PLANS: dict[tuple[Any, ...], _Plan] = {}
_OWNERS: dict[tuple[Any, ...], list[int]] = {}


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


def outer_of(params: Sequence[Tensor]) -> list[Any]:
    """The DTensor param of each local param of the active step (None outside one)."""
    by_local = _ACTIVE[-1] if _ACTIVE else None
    if by_local is None:
        return [None] * len(params)
    return [by_local.get(id(p)) for p in params]


def is_sharded(p: Any) -> bool:
    """Whether a DTensor is split over some mesh dim."""
    return p is not None and any(not placement.is_replicate() for placement in p.placements)


def assign_owners(
    shapes: Sequence[tuple[int, int]],
    world: int,
    cost: Callable[[int, int], float] | None = None,
) -> list[int]:
    """The rank that computes each matrix: largest cost first, each onto the least-loaded rank
    (the lowest rank on ties). Deterministic, so every rank finds the same owners.

    Args:
        shapes: the matrices' global shapes.
        world: the number of ranks.
        cost: ``cost(m, n)`` of one matrix; ``m * n * min(m, n)`` (Newton-Schulz) by default.

    Returns:
        One owner rank per matrix.
    """
    key = (tuple(shapes), world, cost)
    owners = _OWNERS.get(key)
    if owners is None:
        costs = [m * n * min(m, n) if cost is None else cost(m, n) for m, n in shapes]
        owners = [0] * len(shapes)
        loads = [0.0] * world
        for j in sorted(range(len(shapes)), key=lambda j: (-costs[j], j)):
            rank = min(range(world), key=lambda s: (loads[s], s))
            owners[j] = rank
            loads[rank] += costs[j]
        _OWNERS[key] = owners
    return owners


def _fingerprint(params: Sequence[Any]) -> int:
    """A checksum of the sharded matrices' shapes and placements (the same on every rank)."""
    text = repr([(tuple(p.shape), tuple(map(str, p.placements))) for p in params])
    return zlib.crc32(text.encode())


def _mesh_group(mesh: Any) -> tuple[str, int, int]:
    """The name, size and local rank of the process group spanning the whole mesh."""
    if mesh.ndim == 1:
        group = mesh.get_group(0)
    elif mesh.mesh_dim_names:
        group = mesh._flatten().get_group()
    else:
        raise ValueError(
            f"matrices sharded on a {mesh.ndim}-D device mesh need mesh_dim_names (to build the "
            "mesh's flattened process group); init_device_mesh(..., mesh_dim_names=...)"
        )
    return str(group.group_name), int(group.size()), int(group.rank())


def check_matrix_group(i: int, params: Sequence[Any], name: str) -> None:
    """Check group ``i``'s sharded matrices before its first step (a collective: every rank).

    Args:
        i: the group's index (for messages).
        params: the group's DTensor params.
        name: the method, for messages (``"Muon"``).

    Raises:
        ValueError: a sharded param that is not 2-D, a placement other than ``Shard(0|1)`` /
            ``_StridedShard(0|1)`` / ``Replicate``, a multi-dim mesh without dim names, a
            layout whose local shape this module does not reproduce, or ranks that disagree on
            the sharded matrices.
    """
    sharded = [(k, p) for k, p in enumerate(params) if is_sharded(p)]
    if not sharded:
        return
    mesh = sharded[0][1].device_mesh
    coordinate = mesh.get_coordinate()
    for k, p in sharded:
        where = f"param {k} of param group {i}"
        if p.dim() != 2:
            raise ValueError(f"{where} has {p.dim()} dims; {name} shards 2-D matrices only")
        for placement in p.placements:
            split = split_dims(placement)
            if split is not None and split[0] not in (0, 1):
                raise ValueError(
                    f"{where} has placement {placement}; {name} takes matrices "
                    "sharded along dim 0 or 1 (Shard, _StridedShard) only"
                )
    problem = None  # found on this rank only: raised on every rank after the collective
    for k, p in sharded:
        mine = local_region(tuple(p.shape), p.placements, mesh.shape, coordinate)
        if problem is None and mine.shape != tuple(p._local_tensor.shape):
            problem = (
                f"param {k} of param group {i} has placements {tuple(p.placements)} and a local "
                f"shape {tuple(p._local_tensor.shape)}, not the {mine.shape} of torch.chunk's "
                "rule in mesh-dim order; a non-default shard order is not supported"
            )
    _group_of(mesh, [p for _, p in sharded], name, problem)


def _group_of(
    mesh: Any, sharded: Sequence[Any], name: str, problem: str | None = None
) -> _MeshGroup:
    """The mesh's group; on first sight of these matrices, one ``all_gather`` of every rank's
    coordinate, matrix checksum and whether it found a ``problem`` (raising on every rank if
    one did or if the ranks disagree)."""
    key = (mesh, tuple((tuple(p.shape), tuple(p.placements)) for p in sharded))
    known = _GROUPS.get(key)
    if known is not None and problem is None:
        return known
    group, world, rank = _mesh_group(mesh)
    flag = [int(problem is not None)]
    mine = [*mesh.get_coordinate(), *flag, _fingerprint(sharded), len(sharded)]
    local = torch.tensor(mine, dtype=torch.int64, device=sharded[0]._local_tensor.device)
    ops = torch.ops._c10d_functional
    gathered = ops.wait_tensor(ops.all_gather_into_tensor(local, world, group))
    rows = gathered.view(world, len(mine)).tolist()
    flagged = [s for s, row in enumerate(rows) if row[-3]]
    if flagged:
        raise ValueError(problem or f"rank {flagged[0]}: a local shape {name} cannot place")
    for s, row in enumerate(rows):
        if row[-2:] != mine[-2:]:
            raise ValueError(
                f"the ranks disagree on the sharded matrices {name} steps: rank {rank} has "
                f"{mine[-1]} (checksum {mine[-2]}), rank {s} has {row[-1]} (checksum "
                f"{row[-2]}); every rank must step the same params, shapes and placements"
            )
    found = _MeshGroup(group, rank, tuple(tuple(row[: mesh.ndim]) for row in rows))
    _GROUPS[key] = found
    return found


def _batches(owners: list[int], costs: list[float], world: int, size: int) -> list[list[int]]:
    """Matrices cut into batches with work for every owner: each owner's matrices (largest
    first) dealt over at most :data:`MAX_BATCHES` batches of about :data:`MIN_BATCH_BYTES` or
    more (``size``: the wire bytes of all the matrices)."""
    owned: list[list[int]] = [[] for _ in range(world)]
    for j in sorted(range(len(owners)), key=lambda j: (-costs[j], j)):
        owned[owners[j]].append(j)
    by_size = size // MIN_BATCH_BYTES if MIN_BATCH_BYTES > 0 else len(owners)
    count = min(MAX_BATCHES, max(len(js) for js in owned), max(1, by_size))
    return [sorted(j for js in owned for j in js[b::count]) for b in range(count)]


def _plan(
    outer: Sequence[Any],
    cost: Callable[[int, int], float] | None,
    name: str,
    wire: torch.dtype = torch.float32,
) -> _Plan:
    mesh = outer[0].device_mesh
    structure = tuple((tuple(p.shape), tuple(p.placements)) for p in outer)
    key = (mesh, structure, cost, wire)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    group = _group_of(mesh, outer, name)
    world, me = len(group.coordinates), group.rank
    shapes = [(int(p.shape[0]), int(p.shape[1])) for p in outer]
    owners = assign_owners(shapes, world, cost)
    costs = [float(m * n * min(m, n)) if cost is None else cost(m, n) for m, n in shapes]
    regions = [
        [local_region(shape, p.placements, mesh.shape, c) for c in group.coordinates]
        for shape, p in zip(shapes, outer, strict=True)
    ]
    sources = [_sources(p.placements, group.coordinates) for p in outer]
    batches = []
    size = sum(m * n for m, n in shapes) * wire.itemsize
    for members in _batches(owners, costs, world, size):
        mine = [j for j in members if owners[j] == me]
        send = [j for s in range(world) for j in members if owners[j] == s and sources[j][me]]
        recv = [(s, j) for s in range(world) for j in mine if sources[j][s]]
        back = [(s, j) for s in range(world) for j in mine]
        results = [j for s in range(world) for j in members if owners[j] == s]
        batches.append(
            _Batch(
                members, mine, send,
                [sum(regions[j][me].numel for j in send if owners[j] == s) for s in range(world)],
                recv,
                [sum(regions[j][s].numel for t, j in recv if t == s) for s in range(world)],
                back,
                [sum(regions[j][s].numel for t, j in back if t == s) for s in range(world)],
                results,
                [sum(regions[j][me].numel for j in results if owners[j] == s)
                 for s in range(world)],
            )
        )  # fmt: skip
    plan = _PLANS[key] = _Plan(group, regions, batches)
    return plan


def _sources(placements: Sequence[Any], coordinates: Sequence[Sequence[int]]) -> list[bool]:
    """Whether each rank sends its block: the first replica (coordinate 0 on every mesh dim
    the matrix is replicated over)."""
    replicated = [d for d, pl in enumerate(placements) if split_dims(pl) is None]
    return [all(c[d] == 0 for d in replicated) for c in coordinates]


def _start(send: Tensor, out_splits: list[int], in_splits: list[int], group: str) -> Tensor:
    return torch.ops._c10d_functional.all_to_all_single(  # type: ignore[no-any-return]
        send, out_splits, in_splits, group
    )


def _wait(pending: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(pending)  # type: ignore[no-any-return]


def _flat_cat(parts: list[Tensor], like: Tensor) -> Tensor:
    if not parts:
        return like.new_empty(0)
    return torch.cat([t.reshape(-1) for t in parts])


def prepare(outer: Sequence[Any], name: str) -> None:
    """Check a step's matrices before anything changes (on first sight of them, a collective
    that checks the ranks agree; see :func:`check_matrix_group`)."""
    _group_of(outer[0].device_mesh, outer, name)


def owner_map(
    inputs: list[Tensor],
    outer: Sequence[Any],
    fn: Callable[[int, Tensor], Tensor],
    wire: torch.dtype,
    cost: Callable[[int, int], float] | None = None,
    name: str = "a matrix method",
) -> Iterator[tuple[int, Tensor]]:
    """Run ``fn(j, whole matrix j)`` once per sharded matrix, on its owner (see the module).

    Args:
        inputs: each matrix's local block (any dtype; cast to ``wire`` to travel).
        outer: the matrices' DTensor params (one mesh).
        fn: the whole-matrix function; its result travels back in ``wire``.
        wire: the dtype that travels (and that ``fn`` receives).
        cost: ``cost(m, n)`` for :func:`assign_owners`.
        name: the method, for messages.

    Yields:
        ``(j, local block of fn's result for matrix j)`` for every matrix, as they arrive.
    """
    plan = _plan(outer, cost, name, wire)
    group = plan.group.name
    empty = inputs[0].new_empty(0, dtype=wire)
    sends = [_flat_cat([inputs[j].to(wire) for j in b.send], empty) for b in plan.batches]
    gathers = [
        _start(send, b.recv_splits, b.send_splits, group)
        for send, b in zip(sends, plan.batches, strict=True)
    ]
    returns = []
    for batch, pending in zip(plan.batches, gathers, strict=True):
        received = _wait(pending)
        sizes = [plan.regions[j][s].numel for s, j in batch.recv]
        wholes = {j: received.new_empty(tuple(outer[j].shape)) for j in batch.mine}
        for (s, j), piece in zip(batch.recv, received.split_with_sizes(sizes), strict=True):
            region = plan.regions[j][s]
            region_set(wholes[j], region, piece.view(region.shape))
        results = {j: fn(j, wholes[j]).to(wire) for j in batch.mine}
        back = [region_get(results[j], plan.regions[j][s]) for s, j in batch.back]
        returns.append(
            _start(_flat_cat(back, empty), batch.result_splits, batch.back_splits, group)
        )
    me = plan.group.rank
    for batch, pending in zip(plan.batches, returns, strict=True):
        arrived = _wait(pending)
        sizes = [plan.regions[j][me].numel for j in batch.results]
        for j, piece in zip(batch.results, arrived.split_with_sizes(sizes), strict=True):
            yield j, piece.view(inputs[j].shape)
