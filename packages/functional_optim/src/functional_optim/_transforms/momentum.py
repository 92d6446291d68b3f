"""``trace``: heavy-ball / Nesterov momentum with dampening, as torch.optim.SGD applies it."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lists import LeafView, ListTransform
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_flatten

__all__ = ["TraceState", "trace"]


class TraceState(NamedTuple):
    """State of :func:`trace`: one momentum buffer per param, ``None`` until its first update."""

    momentum_buffer: PyTree


@transform_factory
def trace(
    momentum: float, dampening: float = 0.0, nesterov: bool = False
) -> GradientTransformation:
    """Accumulate updates in a momentum buffer (torch.optim.SGD's ``momentum_buffer``).

    First update of a param: ``buf = u``; then ``buf = momentum * buf + (1 - dampening) * u``.
    The output is ``buf``, or ``u + momentum * buf`` with ``nesterov``. ``momentum == 0`` passes
    updates through and keeps the buffers ``None``.

    Args:
        momentum: the momentum factor.
        dampening: dampening of the new update.
        nesterov: use Nesterov momentum.

    Returns:
        A ``GradientTransformation`` with state :class:`TraceState`.
    """

    def init(params: PyTree) -> TraceState:
        leaves, spec = tree_flatten(params)
        return TraceState(spec.unflatten([None] * len(leaves)))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        if momentum == 0:
            return updates, state

        def leaf(u: Tensor, buf: Tensor | None) -> tuple[Tensor, Tensor]:
            if buf is None:
                # torch stores a detached clone; the pure path keeps the graph for meta-gradients.
                buf = u.detach().clone() if inplace else u.clone()
            else:
                buf = _ops.add(_ops.mul(buf, momentum, inplace), u, inplace, alpha=1 - dampening)
            if nesterov:
                return _ops.add(u, buf, inplace, alpha=momentum), buf
            # In place, the update must not alias the buffer that later transforms scale.
            return (u.copy_(buf) if inplace else buf), buf

        return _ops.map_state(updates, state, TraceState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        if momentum == 0 or not updates:
            return updates, state
        bufs: list[Tensor | None] = view.gather(state.momentum_buffer)
        old = [j for j, b in enumerate(bufs) if b is not None]
        if old:
            old_bufs = [b for b in bufs if b is not None]
            torch._foreach_mul_(old_bufs, momentum)
            torch._foreach_add_(old_bufs, [updates[j] for j in old], alpha=1 - dampening)
        if len(old) < len(bufs):  # first update of some leaves: the buffer is a copy
            every = view.spec_leaves(state.momentum_buffer)
            for j, b in enumerate(bufs):
                if b is None:
                    bufs[j] = every[view.idx[j]] = updates[j].detach().clone()
            state = TraceState(view.spec.unflatten(every))
        ready: list[Tensor] = [b for b in bufs if b is not None]
        if nesterov:
            torch._foreach_add_(updates, ready, alpha=momentum)
        else:
            torch._foreach_copy_(updates, ready)
        return updates, state

    hyper = {"momentum": momentum, "dampening": dampening, "nesterov": nesterov}
    return GradientTransformation(init, update, lists=ListTransform("trace", hyper, apply))
