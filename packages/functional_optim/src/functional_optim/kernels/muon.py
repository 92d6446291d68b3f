"""muon kernel: momentum, Newton-Schulz orthogonalisation in bfloat16, shape-adjusted step.

torch has only a per-tensor Muon (``foreach=True`` raises there); this reproduces
``torch.optim.Muon`` op for op, so results are bitwise equal. 2-D params only. A tensor ``lr``
gives the step size and the decay factor in tensor maths (0-d tensors of ``lr``'s dtype), as
torch computes them from one.
"""

import math
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl


def newton_schulz(
    grad: Tensor, ns_coefficients: Tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Approximately orthogonalise a 2-D ``grad`` (``U S' V^T``, ``S'`` near 1), in bfloat16.

    Args:
        grad: the matrix (any float dtype; computed in bfloat16 as torch does).
        ns_coefficients: ``(a, b, c)`` of the quintic iteration.
        ns_steps: iterations (< 100).
        eps: floor of the norm the input is divided by.

    Returns:
        A bfloat16 matrix shaped like ``grad``.

    Raises:
        ValueError: torch's messages for ``ns_steps >= 100`` or a non-2-D ``grad``.
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.dim() != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    ortho = grad.to(torch.bfloat16)
    if tall:
        ortho = ortho.t()
    # Out of place (same numbers as torch's ``div_``): the norm's backward needs ``ortho``, so
    # an in-place division would break ``torch.func.grad`` through the pure path.
    ortho = ortho.div(torch.linalg.vector_norm(ortho, 2.0).clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.t()
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    if tall:
        ortho = ortho.t()
    return ortho


def adjusted_lr_ratio(adjust_lr_fn: Optional[str], rows: int, cols: int) -> float:
    """The factor torch multiplies ``lr`` by for a ``rows x cols`` param."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(float(max(rows, cols)))
    return 1.0


def muon_single(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    lr: Union[float, Tensor],
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: Optional[str],
) -> None:
    """Per-tensor Muon; bitwise equal to ``torch.optim.Muon``.

    Args: as :func:`muon`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if grad.dim() != 2:
            raise ValueError("Param gradient must be a 2D matrix")
        buf = momentum_buffers[i]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if nesterov else buf
        ortho = newton_schulz(update, ns_coefficients, ns_steps, eps)
        ratio = adjusted_lr_ratio(adjust_lr_fn, param.size(0), param.size(1))
        if isinstance(lr, Tensor):
            # torch's ``alpha=-(lr * ratio)`` takes the 0-d tensor's value (``.item()``)
            lr_adjusted = lr * ratio
            param.mul_(1 - lr * weight_decay)
            param.add_(ortho, alpha=-float(lr_adjusted.item()))
        else:
            adjusted = lr * ratio
            param.mul_(1 - lr * weight_decay)
            param.add_(ortho, alpha=-adjusted)


def muon(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Tensor],
    lr: Union[float, Tensor],
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: Tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: Optional[str],
    impl: str = "auto",
) -> None:
    """Muon (torch.optim.Muon) for 2-D params.

    Updates ``params`` and ``momentum_buffers`` in place; call it under ``torch.no_grad()``.

    Args:
        params: 2-D parameters to update.
        grads: one gradient per param.
        momentum_buffers: momentum buffers (zeros at first), one per param.
        lr: learning rate (also scales the decoupled weight decay): a float, or a 0-d tensor
            (the step size and ``1 - lr * weight_decay`` are then computed in its dtype, as
            torch does).
        weight_decay: decoupled weight decay.
        momentum: momentum factor.
        nesterov: use the Nesterov look-ahead as the matrix to orthogonalise.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz iteration.
        ns_steps: Newton-Schulz iterations.
        eps: floor of the norm in the Newton-Schulz normalisation.
        adjust_lr_fn: ``None``/``"original"`` (``sqrt(max(1, A/B))``) or
            ``"match_rms_adamw"`` (``0.2 * sqrt(max(A, B))``).
        impl: ``auto`` or ``single`` (the only path, as in torch).

    Raises:
        ValueError: for a non-2-D gradient, ``ns_steps >= 100``, an unknown ``impl``, or
            ``foreach``/``fused`` (torch has only the per-tensor Muon).
    """
    path = resolve_impl(impl, params, False)
    if path == "foreach" and impl != "auto":
        raise ValueError("impl='foreach': Muon has only the per-tensor path (as torch)")
    muon_single(
        params, grads, momentum_buffers, lr, weight_decay, momentum, nesterov,
        ns_coefficients, ns_steps, eps, adjust_lr_fn,
    )  # fmt: skip
