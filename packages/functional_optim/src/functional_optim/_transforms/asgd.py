"""``scale_by_asgd``: averaged SGD's decayed step and running average of the params."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = ["ScaleByAsgdState", "scale_by_asgd"]


class ScaleByAsgdState(NamedTuple):
    """State of :func:`scale_by_asgd`; torch's ``step``, ``eta``, ``mu``, ``ax``."""

    count: PyTree
    eta: PyTree
    mu: PyTree
    ax: PyTree


def _scalars_like(params: PyTree, value: float | Tensor) -> PyTree:
    """One 0-d ``value`` per param, on the param's device, in the step dtype (torch's); a tensor
    ``value`` is copied, not read, so it stays differentiable and vmappable, in its own dtype
    when that is wider than the step dtype."""
    leaves, spec = tree_flatten(params)
    dtype = _ops.scalar_dtype()
    if isinstance(value, Tensor):
        dtype = torch.promote_types(value.dtype, dtype)
    out = [None if p is None else _scalar(value, dtype, p.device) for p in leaves]
    return spec.unflatten(out)


def _scalar(value: float | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.reshape(()).to(dtype=dtype, device=device, copy=True)
    return torch.full((), value, dtype=dtype, device=device)


@transform_factory
def scale_by_asgd(
    lr: float | Tensor = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6
) -> GradientTransformation:
    """Averaged SGD (``torch.optim.ASGD``): the whole update, learning rate included.

    The new param is ``p * (1 - lambd * eta) - eta * g`` (the output is that minus ``p``); then
    ``ax`` averages the new params (``ax += mu * (p' - ax)``, or ``ax = p'`` while ``mu == 1``),
    ``eta = lr / (1 + lambd * lr * t) ** alpha`` and ``mu = 1 / max(1, t - t0)``. The step size
    lives in the state (``eta`` starts at ``lr``), so no ``scale_by_learning_rate`` follows.

    ``eta`` and ``mu`` are 0-d tensors in the step dtype, as torch keeps them. A 0-d tensor
    ``lr`` is never read as a number: ``eta`` is computed from it by tensor ops, so ``update``
    works under ``torch.func.grad`` (a meta-gradient w.r.t. ``lr``) and ``torch.func.vmap``
    (a sweep over ``lr``); ``eta`` then takes ``lr``'s dtype when it is wider (a float64 ``lr``
    keeps float64 step sizes under a float32 default dtype).

    Args:
        lr: learning rate (a float or a 0-d tensor).
        lambd: decay term.
        alpha: power of the ``eta`` update.
        t0: step at which averaging starts.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByAsgdState`; ``update`` needs
        the params.
    """

    def init(params: PyTree) -> ScaleByAsgdState:
        return ScaleByAsgdState(
            _ops.zero_counts(params),
            _scalars_like(params, lr),
            _scalars_like(params, 1.0),
            tree_zeros_like(params),
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        _ops.require_params(params, "scale_by_asgd")
        leaves, spec, (ps, counts, etas, mus, axs) = _ops.flat(
            updates, params, state.count, state.eta, state.mu, state.ax
        )
        out: list[Tensor | None] = []
        for i, g in enumerate(leaves):
            if g is None:
                out.append(None)
                continue
            out.append(_leaf(g, ps[i], counts, etas, mus, axs, i, inplace))
        new_state = ScaleByAsgdState(
            *(spec.unflatten(column) for column in (counts, etas, mus, axs))
        )
        return spec.unflatten(out), new_state

    def _leaf(
        g: Tensor,
        p: Tensor,
        counts: list[Tensor],
        etas: list[Tensor],
        mus: list[Tensor],
        axs: list[Tensor],
        i: int,
        inplace: bool,
    ) -> Tensor:
        """One param's update; writes its new state into the columns at ``i``."""
        count = _ops.increment(counts[i], inplace)
        eta, mu, ax = etas[i], mus[i], axs[i]
        e = _ops.like(eta, p)
        new_p = p.mul(1 - lambd * e).sub(g.mul(e))
        averaged = ax.add(new_p.sub(ax).mul(_ops.like(mu, ax)))
        new_ax = torch.where(mu != 1, averaged, new_p)
        step = count.to(torch.float64)
        new_eta = lr / (1 + lambd * lr * step) ** alpha
        new_mu = 1 / torch.clamp(step - t0, min=1.0)
        if inplace:
            ax.copy_(new_ax)
            eta.copy_(new_eta)
            mu.copy_(new_mu)
        else:
            axs[i], etas[i], mus[i] = new_ax, new_eta.to(eta.dtype), new_mu.to(mu.dtype)
        counts[i] = count
        return new_p.sub(p)

    hyper = {"lr": lr, "lambd": lambd, "alpha": alpha, "t0": t0}
    lists = leafwise_lists("scale_by_asgd", hyper, update)
    return GradientTransformation(init, update, lists=lists)
