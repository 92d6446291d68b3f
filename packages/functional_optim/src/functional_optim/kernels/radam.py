"""radam kernel: per-tensor and multi-tensor (``_foreach``) paths behind one dispatch.

torch has no fused RAdam. Each path reproduces torch.optim.RAdam's matching implementation op
for op (``foreach=False`` / ``foreach=True``, not capturable), so results are bitwise equal.
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


def rho(beta2: float, step: float) -> float:
    """Length of the approximated simple moving average at ``step`` (RAdam's ``rho_t``)."""
    rho_inf = 2 / (1 - beta2) - 1
    power = float(beta2**step)
    return rho_inf - 2 * step * power / (1 - power)


def rectification(beta2: float, rho_t: float) -> float:
    """The variance rectification term ``r_t`` (valid when ``rho_t > 5``)."""
    rho_inf = 2 / (1 - beta2) - 1
    ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
    return float(ratio**0.5)


def radam_single(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Per-tensor RAdam; bitwise equal to ``torch.optim.RAdam(..., foreach=False)``.

    Args: as :func:`radam`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = state_steps[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step_t += 1
        step = scalar_value(step_t)
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        corrected = exp_avg / bias_correction1
        rho_t = rho(beta2, step)
        if rho_t > 5.0:
            adaptive = (bias_correction2**0.5) / exp_avg_sq.sqrt().add_(eps)
            rect = rectification(beta2, rho_t)
            param.add_(corrected * lr * adaptive * rect, alpha=-1.0)
        else:
            param.add_(corrected * lr, alpha=-1.0)


def radam_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Multi-tensor RAdam; bitwise equal to ``torch.optim.RAdam(..., foreach=True)``.

    Args: as :func:`radam`, without ``impl``."""
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_exp_avgs = take(exp_avgs, idx)
        g_exp_avg_sqs = take(exp_avg_sqs, idx)
        g_steps = take(state_steps, idx)
        increment_steps(g_steps)
        if has_complex(g_params):
            g_params = real_views(g_params)
            g_grads = real_views(g_grads)
            g_exp_avgs = real_views(g_exp_avgs)
            g_exp_avg_sqs = real_views(g_exp_avg_sqs)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        if weight_decay != 0:
            if decoupled_weight_decay:
                torch._foreach_mul_(g_params, 1 - lr * weight_decay)
            elif maximize:
                torch._foreach_add_(g_grads, g_params, alpha=weight_decay)
            else:
                g_grads = list(torch._foreach_add(g_grads, g_params, alpha=weight_decay))
        torch._foreach_lerp_(g_exp_avgs, g_grads, 1 - beta1)
        torch._foreach_mul_(g_exp_avg_sqs, beta2)
        torch._foreach_addcmul_(g_exp_avg_sqs, g_grads, g_grads, 1 - beta2)
        # Union[int, float, complex] is TorchScript's "number": the ScalarList overloads need it.
        unrect_step_size: List[Union[int, float, complex]] = []
        rect_step_size: List[Union[int, float, complex]] = []
        for s in g_steps:
            step = scalar_value(s)
            rho_t = rho(beta2, step)
            rect = rectification(beta2, rho_t) if rho_t > 5 else 0.0
            unrectified = 0.0 if rect > 0 else 1.0
            bias_correction1 = 1 - beta1**step
            unrect_step_size.append((lr * unrectified / bias_correction1) * -1)
            rect_step_size.append(((1 - beta2**step) ** 0.5) * (lr * rect / bias_correction1) * -1)
        buffer = torch._foreach_sqrt(g_exp_avg_sqs)
        torch._foreach_add_(buffer, eps)
        torch._foreach_div_(buffer, rect_step_size)
        torch._foreach_reciprocal_(buffer)
        torch._foreach_add_(buffer, unrect_step_size)
        torch._foreach_addcmul_(g_params, g_exp_avgs, buffer)


def radam_impl(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``), no checks."""
    if impl == "foreach":
        radam_foreach(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            beta1,
            beta2,
            lr,
            weight_decay,
            eps,
            decoupled_weight_decay,
            maximize,
        )
    else:
        radam_single(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            beta1,
            beta2,
            lr,
            weight_decay,
            eps,
            decoupled_weight_decay,
            maximize,
        )


def radam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """RAdam (torch.optim.RAdam): Adam with the variance of the adaptive rate rectified.

    Updates ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``state_steps`` in place; call it
    under ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param.
        exp_avgs: first-moment buffers, one per param.
        exp_avg_sqs: second-moment buffers, one per param.
        state_steps: 0-d float step counters, one per param (incremented here).
        beta1: first-moment decay.
        beta2: second-moment decay.
        lr: learning rate.
        weight_decay: weight decay (L2 penalty, or decoupled).
        eps: term added to the denominator.
        decoupled_weight_decay: decay the params directly (AdamW-style) instead of the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (per-tensor on CPU, multi-tensor elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: if ``impl`` is unknown or ``fused`` (torch has no fused RAdam).
    """
    radam_impl(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        state_steps,
        beta1,
        beta2,
        lr,
        weight_decay,
        eps,
        decoupled_weight_decay,
        maximize,
        resolve_impl(impl, params, False),
    )
