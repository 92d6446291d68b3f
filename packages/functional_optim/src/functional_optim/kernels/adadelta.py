"""Adadelta kernel (torch.optim.Adadelta): per-tensor and multi-tensor paths.

All paths update ``params``, ``square_avgs``, ``acc_deltas`` and ``state_steps`` in place.
Complex params are updated as pairs of reals (``torch.view_as_real``), as torch does.

Numerics: ``adadelta_single`` is bitwise equal to ``torch.optim.Adadelta(foreach=False)`` and
``adadelta_foreach`` to ``foreach=True``.
"""

from typing import List

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl, take
from functional_optim.kernels._tensor_lists import (
    check_lengths,
    group_by_device_dtype,
    has_complex,
    real_views,
)


def _check(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
) -> None:
    check_lengths(
        "adadelta",
        params,
        [grads, square_avgs, acc_deltas, state_steps],
        ["grads", "square_avgs", "acc_deltas", "state_steps"],
    )


def adadelta_single(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Adadelta, one tensor at a time (torch's ``foreach=False`` path).

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        square_avgs: running averages of squared gradients, updated in place.
        acc_deltas: running averages of squared updates, updated in place.
        state_steps: scalar step tensors, incremented in place.
        lr: coefficient that scales the update.
        rho: decay of the running averages.
        eps: term added inside the square roots.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective instead of minimizing.

    Raises:
        ValueError: if the lists differ in length.
    """
    _check(params, grads, square_avgs, acc_deltas, state_steps)
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        square_avg = square_avgs[i]
        acc_delta = acc_deltas[i]
        state_steps[i].add_(1)
        if maximize:
            grad = torch.neg(grad)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        is_complex = torch.is_complex(param)
        if is_complex:
            square_avg = torch.view_as_real(square_avg)
            acc_delta = torch.view_as_real(acc_delta)
            grad = torch.view_as_real(grad)
        square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
        std = square_avg.add(eps).sqrt_()
        delta = acc_delta.add(eps).sqrt_()
        delta.div_(std).mul_(grad)
        acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
        if is_complex:
            delta = torch.view_as_complex(delta)
        param.add_(delta, alpha=-lr)


def _foreach_group(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    if has_complex(params):
        params = real_views(params)
        grads = real_views(grads)
        square_avgs = real_views(square_avgs)
        acc_deltas = real_views(acc_deltas)
    torch._foreach_add_(state_steps, 1)
    if maximize:
        grads = torch._foreach_neg(grads)  # type: ignore[assignment]
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)  # type: ignore[assignment]
    torch._foreach_mul_(square_avgs, rho)
    torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - rho)
    std = torch._foreach_add(square_avgs, eps)
    torch._foreach_sqrt_(std)
    deltas = torch._foreach_add(acc_deltas, eps)
    torch._foreach_sqrt_(deltas)
    torch._foreach_div_(deltas, std)
    torch._foreach_mul_(deltas, grads)
    torch._foreach_mul_(acc_deltas, rho)
    torch._foreach_addcmul_(acc_deltas, deltas, deltas, value=1 - rho)
    torch._foreach_add_(params, deltas, alpha=-lr)


def adadelta_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Adadelta with ``torch._foreach_*`` ops per (device, dtype) group (``foreach=True``).

    Arguments and exceptions as in :func:`adadelta_single`.
    """
    _check(params, grads, square_avgs, acc_deltas, state_steps)
    for idx in group_by_device_dtype(params):
        _foreach_group(
            take(params, idx),
            take(grads, idx),
            take(square_avgs, idx),
            take(acc_deltas, idx),
            take(state_steps, idx),
            lr,
            rho,
            eps,
            weight_decay,
            maximize,
        )


def adadelta(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adadelta (torch.optim.Adadelta) through the path chosen by ``impl``.

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        square_avgs: running averages of squared gradients, updated in place.
        acc_deltas: running averages of squared updates, updated in place.
        state_steps: scalar step tensors, incremented in place.
        lr: coefficient that scales the update.
        rho: decay of the running averages.
        eps: term added inside the square roots.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (the loop on CPU, foreach elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: for an unknown ``impl``, ``impl="fused"`` (torch has no fused Adadelta) or
            lists of different lengths.
    """
    if resolve_impl(impl, params, False) == "foreach":
        adadelta_foreach(
            params,
            grads,
            square_avgs,
            acc_deltas,
            state_steps,
            lr,
            rho,
            eps,
            weight_decay,
            maximize,
        )
    else:
        adadelta_single(
            params,
            grads,
            square_avgs,
            acc_deltas,
            state_steps,
            lr,
            rho,
            eps,
            weight_decay,
            maximize,
        )
