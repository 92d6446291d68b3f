"""RMSprop kernel (torch.optim.RMSprop): per-tensor and multi-tensor paths.

All paths update ``params``, the state buffers and ``state_steps`` in place. ``grad_avgs`` is
empty unless ``centered`` and ``momentum_buffers`` is empty unless ``momentum > 0`` (torch's
layout). Complex params are updated as pairs of reals (``torch.view_as_real``), as torch does.

Numerics: ``rmsprop_single`` is bitwise equal to ``torch.optim.RMSprop(foreach=False)`` and
``rmsprop_foreach`` to ``foreach=True``.
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
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    momentum: float,
    centered: bool,
) -> None:
    lists = [grads, square_avgs, state_steps]
    names = ["grads", "square_avgs", "state_steps"]
    if centered:
        lists.append(grad_avgs)
        names.append("grad_avgs (centered=True)")
    if momentum > 0:
        lists.append(momentum_buffers)
        names.append("momentum_buffers (momentum > 0)")
    check_lengths("rmsprop", params, lists, names)


def rmsprop_single(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    """RMSprop, one tensor at a time (torch's ``foreach=False`` path).

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        square_avgs: running averages of squared gradients, updated in place.
        grad_avgs: running averages of gradients (one per param if ``centered``, else empty).
        momentum_buffers: momentum buffers (one per param if ``momentum > 0``, else empty).
        state_steps: scalar step tensors, incremented in place.
        lr: learning rate.
        alpha: smoothing constant of the running averages.
        eps: term added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum factor.
        centered: normalize by the estimated variance of the gradient.
        maximize: maximize the objective instead of minimizing.

    Raises:
        ValueError: if the lists differ in length.
    """
    _check(params, grads, square_avgs, grad_avgs, momentum_buffers, state_steps, momentum, centered)
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = torch.neg(grad)
        square_avg = square_avgs[i]
        state_steps[i].add_(1)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        is_complex = torch.is_complex(param)
        if is_complex:
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            square_avg = torch.view_as_real(square_avg)
        square_avg.mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
        if centered:
            grad_avg = grad_avgs[i]
            if is_complex:
                grad_avg = torch.view_as_real(grad_avg)
            grad_avg.lerp_(grad, 1 - alpha)
            avg = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
        else:
            avg = square_avg.sqrt()
        avg = avg.add_(eps)
        if momentum > 0:
            buf = momentum_buffers[i]
            if is_complex:
                buf = torch.view_as_real(buf)
            buf.mul_(momentum).addcdiv_(grad, avg)
            param.add_(buf, alpha=-lr)
        else:
            param.addcdiv_(grad, avg, value=-lr)


def _foreach_group(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    if has_complex(params):
        params = real_views(params)
        grads = real_views(grads)
        square_avgs = real_views(square_avgs)
        grad_avgs = real_views(grad_avgs)
        momentum_buffers = real_views(momentum_buffers)
    if maximize:
        grads = torch._foreach_neg(grads)  # type: ignore[assignment]
    torch._foreach_add_(state_steps, 1)
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)  # type: ignore[assignment]
    torch._foreach_mul_(square_avgs, alpha)
    torch._foreach_addcmul_(square_avgs, grads, grads, value=1 - alpha)
    if centered:
        torch._foreach_lerp_(grad_avgs, grads, 1 - alpha)
        avg = torch._foreach_addcmul(square_avgs, grad_avgs, grad_avgs, value=-1)
        torch._foreach_sqrt_(avg)
        torch._foreach_add_(avg, eps)
    else:
        avg = torch._foreach_sqrt(square_avgs)
        torch._foreach_add_(avg, eps)
    if momentum > 0:
        torch._foreach_mul_(momentum_buffers, momentum)
        torch._foreach_addcdiv_(momentum_buffers, grads, avg)
        torch._foreach_add_(params, momentum_buffers, alpha=-lr)
    else:
        torch._foreach_addcdiv_(params, grads, avg, value=-lr)


def rmsprop_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
) -> None:
    """RMSprop with ``torch._foreach_*`` ops per (device, dtype) group (``foreach=True``).

    Arguments and exceptions as in :func:`rmsprop_single`.
    """
    _check(params, grads, square_avgs, grad_avgs, momentum_buffers, state_steps, momentum, centered)
    for idx in group_by_device_dtype(params):
        _foreach_group(
            take(params, idx),
            take(grads, idx),
            take(square_avgs, idx),
            take(grad_avgs, idx) if centered else grad_avgs,
            take(momentum_buffers, idx) if momentum > 0 else momentum_buffers,
            take(state_steps, idx),
            lr,
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
            maximize,
        )


def rmsprop(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """RMSprop (torch.optim.RMSprop) through the path chosen by ``impl``.

    ``grad_avgs`` is empty unless ``centered``; ``momentum_buffers`` is empty unless
    ``momentum > 0``.

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        square_avgs: running averages of squared gradients, updated in place.
        grad_avgs: running averages of gradients (centered only).
        momentum_buffers: momentum buffers (``momentum > 0`` only).
        state_steps: scalar step tensors, incremented in place.
        lr: learning rate.
        alpha: smoothing constant of the running averages.
        eps: term added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        momentum: momentum factor.
        centered: normalize by the estimated variance of the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (the loop on CPU, foreach elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: for an unknown ``impl``, ``impl="fused"`` (torch has no fused RMSprop) or
            lists of different lengths.
    """
    if resolve_impl(impl, params, False) == "foreach":
        rmsprop_foreach(
            params,
            grads,
            square_avgs,
            grad_avgs,
            momentum_buffers,
            state_steps,
            lr,
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
            maximize,
        )
    else:
        rmsprop_single(
            params,
            grads,
            square_avgs,
            grad_avgs,
            momentum_buffers,
            state_steps,
            lr,
            alpha,
            eps,
            weight_decay,
            momentum,
            centered,
            maximize,
        )
