"""nadam kernel: per-tensor and multi-tensor (``_foreach``) paths behind one dispatch.

torch has no fused NAdam. Each path reproduces torch.optim.NAdam's matching implementation op
for op (``foreach=False`` / ``foreach=True``, not capturable), so results are bitwise equal.
``mu_products`` are 0-d tensors (torch's ``state["mu_product"]``), read as Python numbers.
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


def _mu(beta1: float, momentum_decay: float, step: float) -> float:
    """NAdam's momentum cache ``beta1 * (1 - 0.5 * 0.96 ** (step * momentum_decay))``."""
    return beta1 * (1.0 - 0.5 * float(0.96 ** (step * momentum_decay)))


def nadam_single(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    momentum_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Per-tensor NAdam; bitwise equal to ``torch.optim.NAdam(..., foreach=False)``.

    Args: as :func:`nadam`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        mu_product = mu_products[i]
        step_t = state_steps[i]
        if torch.is_complex(param):
            param = torch.view_as_real(param)
            grad = torch.view_as_real(grad)
            exp_avg = torch.view_as_real(exp_avg)
            exp_avg_sq = torch.view_as_real(exp_avg_sq)
        step_t += 1
        step = scalar_value(step_t)
        bias_correction2 = 1 - beta2**step
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        mu = _mu(beta1, momentum_decay, step)
        mu_next = _mu(beta1, momentum_decay, step + 1)
        mu_product *= mu
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.div(bias_correction2).sqrt()
        product = scalar_value(mu_product)
        mu_product_next = product * mu_next
        denom.add_(eps)
        param.addcdiv_(grad, denom, value=(-lr * (1.0 - mu) / (1.0 - product)))
        param.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1.0 - mu_product_next))


def nadam_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    momentum_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
) -> None:
    """Multi-tensor NAdam; bitwise equal to ``torch.optim.NAdam(..., foreach=True)``.

    Args: as :func:`nadam`, without ``impl``."""
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_exp_avgs = take(exp_avgs, idx)
        g_exp_avg_sqs = take(exp_avg_sqs, idx)
        g_mu_products = take(mu_products, idx)
        g_steps = take(state_steps, idx)
        if has_complex(g_params):
            g_params = real_views(g_params)
            g_grads = real_views(g_grads)
            g_exp_avgs = real_views(g_exp_avgs)
            g_exp_avg_sqs = real_views(g_exp_avg_sqs)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        increment_steps(g_steps)
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
        denom = torch._foreach_sqrt(g_exp_avg_sqs)
        # Union[int, float, complex] is TorchScript's "number": the ScalarList overloads need it.
        bias_correction_sqrt: List[Union[int, float, complex]] = []
        mus: List[Union[int, float, complex]] = []
        mu_values: List[float] = []
        mu_nexts: List[float] = []
        for s in g_steps:
            step = scalar_value(s)
            bias_correction_sqrt.append((1 - beta2**step) ** 0.5)
            mu = _mu(beta1, momentum_decay, step)
            mus.append(mu)
            mu_values.append(mu)
            mu_nexts.append(_mu(beta1, momentum_decay, step + 1))
        torch._foreach_mul_(g_mu_products, mus)
        torch._foreach_div_(denom, bias_correction_sqrt)
        torch._foreach_add_(denom, eps)
        step_size_grads: List[Union[int, float, complex]] = []
        step_size_exp_avgs: List[Union[int, float, complex]] = []
        for j in range(len(g_mu_products)):
            product = scalar_value(g_mu_products[j])
            step_size_grads.append((lr * (1.0 - mu_values[j]) / (1.0 - product)) * -1)
            step_size_exp_avgs.append((lr * mu_nexts[j] / (1.0 - product * mu_nexts[j])) * -1)
        torch._foreach_addcdiv_(g_params, g_grads, denom, step_size_grads)
        torch._foreach_addcdiv_(g_params, g_exp_avgs, denom, step_size_exp_avgs)


def nadam_impl(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    momentum_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``), no checks."""
    if impl == "foreach":
        nadam_foreach(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            mu_products,
            state_steps,
            beta1,
            beta2,
            lr,
            weight_decay,
            momentum_decay,
            eps,
            decoupled_weight_decay,
            maximize,
        )
    else:
        nadam_single(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            mu_products,
            state_steps,
            beta1,
            beta2,
            lr,
            weight_decay,
            momentum_decay,
            eps,
            decoupled_weight_decay,
            maximize,
        )


def nadam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    mu_products: List[Tensor],
    state_steps: List[Tensor],
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    momentum_decay: float,
    eps: float,
    decoupled_weight_decay: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """NAdam (torch.optim.NAdam): Adam with Nesterov momentum and a momentum-decay schedule.

    Updates ``params``, ``exp_avgs``, ``exp_avg_sqs``, ``mu_products`` and ``state_steps`` in
    place; call it under ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param.
        exp_avgs: first-moment buffers, one per param.
        exp_avg_sqs: second-moment buffers, one per param.
        mu_products: 0-d running products of the momentum coefficients (start at 1).
        state_steps: 0-d float step counters, one per param (incremented here).
        beta1: first-moment decay.
        beta2: second-moment decay.
        lr: learning rate.
        weight_decay: weight decay (L2 penalty, or decoupled).
        momentum_decay: decay of the momentum coefficient (torch's ``momentum_decay``).
        eps: term added to the denominator.
        decoupled_weight_decay: decay the params directly (AdamW-style) instead of the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (per-tensor on CPU, multi-tensor elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: if ``impl`` is unknown or ``fused`` (torch has no fused NAdam).
    """
    nadam_impl(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        mu_products,
        state_steps,
        beta1,
        beta2,
        lr,
        weight_decay,
        momentum_decay,
        eps,
        decoupled_weight_decay,
        maximize,
        resolve_impl(impl, params, False),
    )
