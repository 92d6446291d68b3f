"""Adam's three paths (per-tensor, multi-tensor ``_foreach``, fused) and their dispatch.

Each reproduces torch.optim.Adam's matching implementation op for op (``foreach=False``,
``foreach=True``, ``fused=True``). They take ``decoupled`` and serve both
:mod:`functional_optim.kernels.adam` and :mod:`functional_optim.kernels.adamw`.
"""

from typing import List, Union

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import take
from functional_optim.kernels._tensor_lists import (
    group_by_device_dtype,
    has_complex,
    increment_steps,
    real_views,
    scalar_value,
)


def _adam_single(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
) -> None:
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step_t = state_steps[i]
        step_t += 1
        if weight_decay != 0:
            if decoupled:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
            param = torch.view_as_real(param)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # torch reads the step as a Python number in the non-capturable path.
        step = scalar_value(step_t)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if amsgrad:
            max_sq = max_exp_avg_sqs[i]
            if torch.is_complex(max_sq):
                max_sq = torch.view_as_real(max_sq)
            torch.maximum(max_sq, exp_avg_sq, out=max_sq)
            denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def _adam_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
) -> None:
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_exp_avgs = take(exp_avgs, idx)
        g_exp_avg_sqs = take(exp_avg_sqs, idx)
        g_max: List[Tensor] = []
        if amsgrad:
            g_max = take(max_exp_avg_sqs, idx)
        g_steps = take(state_steps, idx)
        if has_complex(g_params):
            g_params = real_views(g_params)
            g_grads = real_views(g_grads)
            g_exp_avgs = real_views(g_exp_avgs)
            g_exp_avg_sqs = real_views(g_exp_avg_sqs)
            g_max = real_views(g_max)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        increment_steps(g_steps)
        if weight_decay != 0:
            if decoupled:
                torch._foreach_mul_(g_params, 1 - lr * weight_decay)
            elif maximize:
                # g_grads is already a fresh copy: update it in place.
                torch._foreach_add_(g_grads, g_params, alpha=weight_decay)
            else:
                g_grads = list(torch._foreach_add(g_grads, g_params, alpha=weight_decay))
        torch._foreach_lerp_(g_exp_avgs, g_grads, 1 - beta1)
        torch._foreach_mul_(g_exp_avg_sqs, beta2)
        torch._foreach_addcmul_(g_exp_avg_sqs, g_grads, g_grads, 1 - beta2)
        # Union[int, float, complex] is TorchScript's "number": the ScalarList overloads need it.
        step_size: List[Union[int, float, complex]] = []
        bias_correction2_sqrt: List[Union[int, float, complex]] = []
        for s in g_steps:
            step = scalar_value(s)
            step_size.append((lr / (1 - beta1**step)) * -1)
            bias_correction2_sqrt.append((1 - beta2**step) ** 0.5)
        if amsgrad:
            torch._foreach_maximum_(g_max, g_exp_avg_sqs)
            denom = torch._foreach_sqrt(g_max)
        else:
            denom = torch._foreach_sqrt(g_exp_avg_sqs)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(g_params, g_exp_avgs, denom, step_size)


def _adam_fused(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
) -> None:
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_steps = take(state_steps, idx)
        g_max: List[Tensor] = []
        if amsgrad:
            g_max = take(max_exp_avg_sqs, idx)
        torch._foreach_add_(g_steps, 1)
        if decoupled:
            torch._fused_adamw_(
                g_params,
                take(grads, idx),
                take(exp_avgs, idx),
                take(exp_avg_sqs, idx),
                g_max,
                g_steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=amsgrad,
                maximize=maximize,
                grad_scale=None,
                found_inf=None,
            )
        else:
            torch._fused_adam_(
                g_params,
                take(grads, idx),
                take(exp_avgs, idx),
                take(exp_avg_sqs, idx),
                g_max,
                g_steps,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=amsgrad,
                maximize=maximize,
                grad_scale=None,
                found_inf=None,
            )


def adam_impl(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``/``fused``), no checks.

    Used by :func:`adam`, :func:`functional_optim.kernels.adamw.adamw` and the functional
    optimizers, which resolve ``impl`` once at construction."""
    if impl == "fused":
        _adam_fused(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            amsgrad,
            beta1,
            beta2,
            lr,
            weight_decay,
            eps,
            maximize,
            decoupled,
        )
    elif impl == "foreach":
        _adam_foreach(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            amsgrad,
            beta1,
            beta2,
            lr,
            weight_decay,
            eps,
            maximize,
            decoupled,
        )
    else:
        _adam_single(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            amsgrad,
            beta1,
            beta2,
            lr,
            weight_decay,
            eps,
            maximize,
            decoupled,
        )
