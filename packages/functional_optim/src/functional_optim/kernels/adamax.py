"""adamax kernel: per-tensor and multi-tensor (``_foreach``) paths behind one dispatch.

torch has no fused Adamax. Each path reproduces torch.optim.Adamax's matching implementation
op for op (``foreach=False`` / ``foreach=True``), so results are bitwise equal.
"""

from typing import List, Union

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl, take
from functional_optim.kernels._tensor_lists import (
    group_by_device_dtype,
    has_complex,
    increment_steps,
    real_views,
    scalar_value,
)


def adamax_single(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Per-tensor Adamax; bitwise equal to ``torch.optim.Adamax(..., foreach=False)``.

    Args: as :func:`adamax`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        exp_avg = exp_avgs[i]
        exp_inf = exp_infs[i]
        step_t = state_steps[i]
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_inf = torch.view_as_real(exp_inf)
        exp_avg.lerp_(grad, 1 - beta1)
        torch.maximum(exp_inf.mul_(beta2), grad.abs().add_(eps), out=exp_inf)
        # torch reads the step as a Python number in the non-capturable path.
        clr = lr / (1 - beta1 ** scalar_value(step_t))
        param.addcdiv_(exp_avg, exp_inf, value=-clr)


def adamax_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Multi-tensor Adamax; bitwise equal to ``torch.optim.Adamax(..., foreach=True)``.

    Args: as :func:`adamax`, without ``impl``."""
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_exp_avgs = take(exp_avgs, idx)
        g_exp_infs = take(exp_infs, idx)
        g_steps = take(state_steps, idx)
        if has_complex(g_params):
            g_params = real_views(g_params)
            g_grads = real_views(g_grads)
            g_exp_avgs = real_views(g_exp_avgs)
            g_exp_infs = real_views(g_exp_infs)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        increment_steps(g_steps)
        if weight_decay != 0:
            if maximize:
                # g_grads is already a fresh copy: update it in place.
                torch._foreach_add_(g_grads, g_params, alpha=weight_decay)
            else:
                g_grads = list(torch._foreach_add(g_grads, g_params, alpha=weight_decay))
        torch._foreach_lerp_(g_exp_avgs, g_grads, 1 - beta1)
        torch._foreach_mul_(g_exp_infs, beta2)
        if not maximize and weight_decay == 0:
            # g_grads still holds the caller's tensors: take |g| into new ones.
            g_grads = list(torch._foreach_abs(g_grads))
        else:
            torch._foreach_abs_(g_grads)
        torch._foreach_add_(g_grads, eps)
        torch._foreach_maximum_(g_exp_infs, g_grads)
        # Union[int, float, complex] is TorchScript's "number": the ScalarList overloads need it.
        step_size: List[Union[int, float, complex]] = []
        for s in g_steps:
            step_size.append((lr / (1 - beta1 ** scalar_value(s))) * -1)
        torch._foreach_addcdiv_(g_params, g_exp_avgs, g_exp_infs, step_size)


def adamax_impl(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``), no checks.

    Used by :func:`adamax` and by the functional optimizer, which resolves ``impl`` once."""
    if impl == "foreach":
        adamax_foreach(
            params,
            grads,
            exp_avgs,
            exp_infs,
            state_steps,
            eps,
            beta1,
            beta2,
            lr,
            weight_decay,
            maximize,
        )
    else:
        adamax_single(
            params,
            grads,
            exp_avgs,
            exp_infs,
            state_steps,
            eps,
            beta1,
            beta2,
            lr,
            weight_decay,
            maximize,
        )


def adamax(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adamax (torch.optim.Adamax).

    Updates ``params``, ``exp_avgs``, ``exp_infs`` and ``state_steps`` in place; call it under
    ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param.
        exp_avgs: first-moment buffers, one per param.
        exp_infs: exponentially weighted infinity norms, one per param.
        state_steps: 0-d float step counters, one per param (incremented here).
        eps: term added to the infinity norm.
        beta1: first-moment decay.
        beta2: infinity-norm decay.
        lr: learning rate.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (per-tensor on CPU, multi-tensor elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: if ``impl`` is unknown or ``fused`` (torch has no fused Adamax).
    """
    adamax_impl(
        params,
        grads,
        exp_avgs,
        exp_infs,
        state_steps,
        eps,
        beta1,
        beta2,
        lr,
        weight_decay,
        maximize,
        resolve_impl(impl, params, False),
    )
