"""``scale_by_muon``: momentum, then Newton-Schulz orthogonalisation of each 2-D update."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._tree import PyTree, tree_leaves, tree_zeros_like
from functional_optim.kernels.muon import adjusted_lr_ratio, newton_schulz

__all__ = ["ScaleByMuonState", "check_muon_params", "scale_by_muon"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


class ScaleByMuonState(NamedTuple):
    """State of :func:`scale_by_muon`; torch's ``momentum_buffer``."""

    momentum_buffer: PyTree


def check_muon_params(params: PyTree) -> None:
    """torch.optim.Muon's constructor check.

    Raises:
        ValueError: if a param is not 2-D (torch's message).
    """
    for p in tree_leaves(params):
        if isinstance(p, Tensor) and p.dim() != 2:
            raise ValueError(
                "Muon only supports 2D parameters whereas we found a parameter with size: "
                f"{p.size()}"
            )


def check_muon_inputs(params: list[Tensor | None], grads: list[Tensor | None]) -> None:
    """torch.optim.Muon's step checks, before anything changes.

    Raises:
        RuntimeError: for a complex param or a sparse gradient (torch's messages).
    """
    for p, g in zip(params, grads, strict=True):
        if g is None or p is None:
            continue
        if torch.is_complex(p):
            raise RuntimeError("Muon does not support complex parameters")
        if g.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")


@transform_factory
def scale_by_muon(
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon's direction: ``buf = lerp(buf, g, 1 - momentum)``, ``u = lerp(g, buf, momentum)``
    (Nesterov) or ``buf``, output ``NS(u) * r`` with ``NS`` the bfloat16 Newton-Schulz
    orthogonalisation and ``r`` torch's shape-dependent learning-rate factor
    (``adjust_lr_fn``); chain with ``scale_by_learning_rate``. 2-D params only.

    Args:
        momentum: momentum factor.
        nesterov: orthogonalise the Nesterov look-ahead.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz iteration.
        eps: floor of the normalising norm.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByMuonState`.

    Raises:
        ValueError: at ``init`` for a param that is not 2-D (torch's message).
    """

    def init(params: PyTree) -> ScaleByMuonState:
        check_muon_params(params)
        return ScaleByMuonState(tree_zeros_like(params))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, buf: Tensor) -> tuple[Tensor, ...]:
            if g.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            buf = _ops.lerp(buf, g, 1 - momentum, inplace)
            direction = g.lerp(buf, momentum) if nesterov else buf
            ortho = newton_schulz(direction, ns_coefficients, ns_steps, eps)
            ratio = adjusted_lr_ratio(adjust_lr_fn, g.size(0), g.size(1))
            return ortho.to(g.dtype) * ratio, buf

        return _ops.map_state(updates, state, ScaleByMuonState, leaf)

    return GradientTransformation(init, update)
