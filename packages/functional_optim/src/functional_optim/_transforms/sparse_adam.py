"""``scale_by_sparse_adam``: Adam on the entries a sparse (COO) gradient touches."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_leaves, tree_zeros_like

__all__ = ["ScaleBySparseAdamState", "check_dense_real_params", "scale_by_sparse_adam"]

DENSE_GRAD_MESSAGE = "SparseAdam does not support dense gradients, please consider Adam instead"


class ScaleBySparseAdamState(NamedTuple):
    """State of :func:`scale_by_sparse_adam`; torch's ``step``, ``exp_avg``, ``exp_avg_sq``."""

    count: PyTree
    mu: PyTree
    nu: PyTree


def check_dense_real_params(params: PyTree) -> None:
    """torch.optim.SparseAdam's constructor checks (one group: indices ``[0, i]``).

    Raises:
        ValueError: for sparse or complex params (torch's messages).
    """
    leaves = [p for p in tree_leaves(params) if isinstance(p, Tensor)]
    sparse = [[0, i] for i, p in enumerate(leaves) if p.is_sparse]
    if sparse:
        raise ValueError(
            f"Sparse params at indices {sparse}: SparseAdam requires dense parameter tensors"
        )
    complex_ = [[0, i] for i, p in enumerate(leaves) if p.is_complex()]
    if complex_:
        raise ValueError(
            f"Complex params at indices {complex_}: SparseAdam does not support complex parameters"
        )


def _coo(indices: Tensor, values: Tensor, like: Tensor) -> Tensor:
    """A COO tensor of ``like``'s size (invariants hold: indices come from ``like``)."""
    return torch.sparse_coo_tensor(indices, values, like.size(), check_invariants=False)


@transform_factory
def scale_by_sparse_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> GradientTransformation:
    """Adam restricted to a sparse gradient's entries (``torch.optim.SparseAdam``).

    The moments change only where the coalesced gradient has entries; the output is sparse
    with those entries, ``sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)``. The step count
    advances on every update, as torch's. Chain with ``scale_by_learning_rate``.

    Args:
        b1: decay of the first moment.
        b2: decay of the second moment.
        eps: added to the denominator.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleBySparseAdamState`; ``init``
        rejects sparse or complex params, ``update`` dense gradients (torch's messages).
    """

    def init(params: PyTree) -> ScaleBySparseAdamState:
        check_dense_real_params(params)
        return ScaleBySparseAdamState(
            _ops.zero_counts(params), tree_zeros_like(params), tree_zeros_like(params)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        if any(isinstance(u, Tensor) and not u.is_sparse for u in tree_leaves(updates)):
            raise RuntimeError(DENSE_GRAD_MESSAGE)

        def leaf(g: Tensor, count: Tensor, mu: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            count = _ops.increment(count, inplace)
            g = g.coalesce()
            indices, values = g._indices(), g._values()
            if values.numel() == 0:
                return g, count, mu, nu
            old_mu = mu.sparse_mask(g)._values()
            mu_update = values.sub(old_mu).mul(1 - b1)
            mu = _ops.add(mu, _coo(indices, mu_update, g), inplace)
            old_nu = nu.sparse_mask(g)._values()
            nu_update = values.pow(2).sub(old_nu).mul(1 - b2)
            nu = _ops.add(nu, _coo(indices, nu_update, g), inplace)
            numer = mu_update.add(old_mu)
            denom = nu_update.add(old_nu).sqrt().add(eps)
            step = float(count.item())
            factor = math.sqrt(1 - b2**step) / (1 - b1**step)
            out = _coo(indices, numer.div(denom).mul(factor), g)
            return out, count, mu, nu

        return _ops.map_state(updates, state, ScaleBySparseAdamState, leaf)

    return GradientTransformation(init, update)
