"""``per_matrix``: the extension point for whole-matrix optimizers on sharded params.

A matrix method (Muon's Newton-Schulz, PolarExpress or Gram Newton-Schulz variants, NorMuon's
orthogonalisation, ...) maps each 2-D update to a new one and needs the whole matrix to do it.
``per_matrix(fn)`` is that map as a transform: on plain tensors it is ``fn(u)`` per leaf; in
``fo.Optimizer``'s local step of sharded DTensor params (FSDP2 ``Shard(0)``, tensor-parallel
``Shard(0|1)``, 2-D meshes) every matrix is gathered on one owner rank (cost-balanced), ``fn``
runs there once, and each rank gets its block of the result back, the communication of later
matrices overlapped with ``fn`` on earlier ones (:mod:`functional_optim._owner_compute`).
Element-wise state (momentum) stays sharded in the transforms around it::

    tx = fo.chain(
        fo.trace(0.95, nesterov=True),
        fo.per_matrix(my_orthogonalise),
        fo.add_decayed_weights(0.1),
        fo.scale_by_learning_rate(0.02),
    )
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._owner_compute import is_sharded, outer_of, owner_map
from functional_optim._recipes import transform_factory
from functional_optim._tree import PyTree, tree_flatten, tree_leaves

__all__ = ["PerMatrixState", "per_matrix"]


class PerMatrixState(NamedTuple):
    """State of :func:`per_matrix` (none: it marks the transform for the shard checks)."""


def _check_matrices(params: PyTree) -> None:
    for k, p in enumerate(tree_leaves(params)):
        if isinstance(p, Tensor) and p.dim() != 2:
            raise ValueError(
                f"per_matrix takes 2-D params, but leaf {k} has size {tuple(p.size())}; give "
                "the others another transform (fo.masked, fo.multi_transform)"
            )


@transform_factory
def per_matrix(
    fn: Callable[[Tensor], Tensor],
    *,
    wire_dtype: torch.dtype | None = None,
    cost: Callable[[int, int], float] | None = None,
) -> GradientTransformation:
    """Map each 2-D update through ``fn`` as a whole matrix, on sharded params too (see the
    module).

    Args:
        fn: the whole-matrix function, ``(m, n) -> (m, n)``, without state (keep state in
            element-wise transforms around it). A module-level function pickles with the
            optimizer.
        wire_dtype: the dtype matrices travel (and reach ``fn``) in when sharded; the update's
            dtype (exact) by default. ``torch.bfloat16`` halves the bytes for a ``fn`` that
            computes in bfloat16 anyway.
        cost: ``cost(m, n)`` of ``fn`` on an ``m x n`` matrix, which balances the owners;
            ``m * n * min(m, n)`` (a matrix product's) by default.

    Returns:
        A ``GradientTransformation`` with state :class:`PerMatrixState`.

    Raises:
        ValueError: at ``init`` for a param that is not 2-D.
    """

    def init(params: PyTree) -> PerMatrixState:
        _check_matrices(params)
        return PerMatrixState()

    def whole(u: Tensor) -> Tensor:
        return fn(u).to(u.dtype)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params, inplace
        leaves, spec = tree_flatten(updates)
        return spec.unflatten([None if u is None else whole(u) for u in leaves]), state

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        outer = outer_of(view.params)
        sharded = [k for k, d in enumerate(outer) if is_sharded(d)]
        out = [u if is_sharded(d) else whole(u) for u, d in zip(updates, outer, strict=True)]
        if sharded:
            wire = wire_dtype or updates[sharded[0]].dtype
            blocks = [updates[k] for k in sharded]

            def on_owner(j: int, matrix: Tensor) -> Tensor:
                del j
                return fn(matrix)

            mats = [outer[k] for k in sharded]
            for j, block in owner_map(blocks, mats, on_owner, wire, cost, "per_matrix"):
                out[sharded[j]] = block.to(blocks[j].dtype)
        return out, state

    hyper = {"fn": fn, "wire_dtype": wire_dtype, "cost": cost}
    lists = ListTransform("per_matrix", hyper, apply, writes_updates=False)
    return GradientTransformation(init, update, lists=lists)
