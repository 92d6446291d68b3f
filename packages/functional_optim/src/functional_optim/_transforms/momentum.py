"""``trace``: heavy-ball / Nesterov momentum with dampening, as torch.optim.SGD applies it."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_flatten

__all__ = ["TraceState", "trace"]


class TraceState(NamedTuple):
    """State of :func:`trace`: one momentum buffer per param, ``None`` until its first update."""

    momentum_buffer: PyTree


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

    return GradientTransformation(init, update)
