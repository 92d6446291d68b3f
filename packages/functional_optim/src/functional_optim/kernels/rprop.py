"""Rprop kernel (torch.optim.Rprop): per-tensor and multi-tensor paths.

All paths update ``params``, ``prevs``, ``step_sizes`` and ``state_steps`` in place. The
learning rate lives in the state: ``step_sizes`` start filled with ``lr`` (the caller's state
set-up). Complex params are updated as pairs of reals (``torch.view_as_real``), as torch does.

Numerics: ``rprop_single`` is bitwise equal to ``torch.optim.Rprop(foreach=False)`` and
``rprop_foreach`` to ``foreach=True``.
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
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
) -> None:
    check_lengths(
        "rprop",
        params,
        [grads, prevs, step_sizes, state_steps],
        ["grads", "prevs", "step_sizes", "state_steps"],
    )


def _sign_to_factor(sign: Tensor, etaminus: float, etaplus: float) -> None:
    # In place, in torch's order: sign > 0 -> etaplus, then < 0 -> etaminus, then == 0 -> 1.
    sign.masked_fill_(sign.gt(0), etaplus)
    sign.masked_fill_(sign.lt(0), etaminus)
    sign.masked_fill_(sign.eq(0), 1)


def rprop_single(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
) -> None:
    """Rprop, one tensor at a time (torch's ``foreach=False`` path).

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        prevs: the previous (masked) gradients, updated in place.
        step_sizes: per-element step sizes (initially ``lr``), updated in place.
        state_steps: scalar step tensors, incremented in place.
        step_size_min: lower bound of the step sizes.
        step_size_max: upper bound of the step sizes.
        etaminus: multiplicative decrease factor (0 < etaminus < 1).
        etaplus: multiplicative increase factor (etaplus > 1).
        maximize: maximize the objective instead of minimizing.

    Raises:
        ValueError: if the lists differ in length.
    """
    _check(params, grads, prevs, step_sizes, state_steps)
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = torch.neg(grad)
        prev = prevs[i]
        step_size = step_sizes[i]
        state_steps[i].add_(1)
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            prev = torch.view_as_real(prev)
            param = torch.view_as_real(param)
            step_size = torch.view_as_real(step_size)
        sign = grad.mul(prev).sign()
        _sign_to_factor(sign, etaminus, etaplus)
        step_size.mul_(sign).clamp_(step_size_min, step_size_max)
        grad = grad.clone(memory_format=torch.preserve_format)
        grad.masked_fill_(sign.eq(etaminus), 0)
        param.addcmul_(grad.sign(), step_size, value=-1)
        prev.copy_(grad)


def _foreach_group(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
) -> None:
    torch._foreach_add_(state_steps, 1)
    if has_complex(params):
        params = real_views(params)
        grads = real_views(grads)
        prevs = real_views(prevs)
        step_sizes = real_views(step_sizes)
    signs = torch._foreach_mul(grads, prevs)
    if maximize:
        torch._foreach_neg_(signs)
    # prevs ends the step holding the masked gradient; compute it in place there.
    torch._foreach_copy_(prevs, grads)
    if maximize:
        torch._foreach_neg_(prevs)
    torch._foreach_sign_(signs)
    for sign in signs:
        _sign_to_factor(sign, etaminus, etaplus)
    torch._foreach_mul_(step_sizes, signs)
    for step_size in step_sizes:
        step_size.clamp_(step_size_min, step_size_max)
    for i in range(len(prevs)):
        prevs[i].masked_fill_(signs[i].eq(etaminus), 0)
    grad_signs = [g.sign() for g in prevs]
    torch._foreach_addcmul_(params, grad_signs, step_sizes, value=-1)


def rprop_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
) -> None:
    """Rprop with ``torch._foreach_*`` ops per (device, dtype) group (``foreach=True``).

    Arguments and exceptions as in :func:`rprop_single`.
    """
    _check(params, grads, prevs, step_sizes, state_steps)
    for idx in group_by_device_dtype(params):
        _foreach_group(
            take(params, idx),
            take(grads, idx),
            take(prevs, idx),
            take(step_sizes, idx),
            take(state_steps, idx),
            step_size_min,
            step_size_max,
            etaminus,
            etaplus,
            maximize,
        )


def rprop(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Rprop (torch.optim.Rprop) through the path chosen by ``impl``.

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        prevs: the previous (masked) gradients, updated in place.
        step_sizes: per-element step sizes (initially ``lr``), updated in place.
        state_steps: scalar step tensors, incremented in place.
        step_size_min: lower bound of the step sizes.
        step_size_max: upper bound of the step sizes.
        etaminus: multiplicative decrease factor.
        etaplus: multiplicative increase factor.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (the loop on CPU, foreach elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: for an unknown ``impl``, ``impl="fused"`` (torch has no fused Rprop) or
            lists of different lengths.
    """
    if resolve_impl(impl, params, False) == "foreach":
        rprop_foreach(
            params,
            grads,
            prevs,
            step_sizes,
            state_steps,
            step_size_min,
            step_size_max,
            etaminus,
            etaplus,
            maximize,
        )
    else:
        rprop_single(
            params,
            grads,
            prevs,
            step_sizes,
            state_steps,
            step_size_min,
            step_size_max,
            etaminus,
            etaplus,
            maximize,
        )
