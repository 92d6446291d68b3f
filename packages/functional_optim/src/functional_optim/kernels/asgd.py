"""asgd kernel: per-tensor and multi-tensor (``_foreach``) paths behind one dispatch.

torch has no fused ASGD. Each path reproduces torch.optim.ASGD's matching implementation op
for op (``foreach=False`` / ``foreach=True``, not capturable), so results are bitwise equal.
``etas`` and ``mus`` are 0-d tensors (torch's ``state["eta"]`` and ``state["mu"]``), rewritten in
place each step.
"""

from typing import List

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


def asgd_single(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    state_steps: List[Tensor],
    lambd: float,
    lr: float,
    t0: float,
    alpha: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Per-tensor ASGD; bitwise equal to ``torch.optim.ASGD(..., foreach=False)``.

    Args: as :func:`asgd`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        mu = mus[i]
        ax = axs[i]
        eta = etas[i]
        step_t = state_steps[i]
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            param = torch.view_as_real(param)
            ax = torch.view_as_real(ax)
        step_t += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        eta_value = scalar_value(eta)
        param.mul_(1 - lambd * eta_value)
        param.add_(grad, alpha=-eta_value)
        if not torch.jit.is_scripting() and torch.compiler.is_compiling():  # type: ignore[attr-defined]
            # no data-dependent branch under torch.compile: the averaging step in tensor maths
            # (mu = 1 gives ax + (param - ax), equal to param up to one rounding)
            ax.add_(param.sub(ax).mul_(mu))
            eta.copy_(lr / ((1 + lambd * lr * step_t) ** alpha))
            mu.copy_(1 / torch.clamp(step_t - t0, min=1.0))
            continue
        if scalar_value(mu) != 1:
            ax.add_(param.sub(ax).mul_(mu))
        else:
            ax.copy_(param)
        step = scalar_value(step_t)
        eta.fill_(lr / ((1 + lambd * lr * step) ** alpha))
        mu.fill_(1 / max(1.0, step - t0))


def asgd_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    state_steps: List[Tensor],
    lambd: float,
    lr: float,
    t0: float,
    alpha: float,
    weight_decay: float,
    maximize: bool,
) -> None:
    """Multi-tensor ASGD; bitwise equal to ``torch.optim.ASGD(..., foreach=True)``.

    torch computes the new ``eta`` here from the step *tensor* (in its dtype), not from the
    Python number as the per-tensor path does; so does this path.

    Args: as :func:`asgd`, without ``impl``."""
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_axs = take(axs, idx)
        g_mus = take(mus, idx)
        g_etas = take(etas, idx)
        g_steps = take(state_steps, idx)
        if has_complex(g_params):
            g_params = real_views(g_params)
            g_grads = real_views(g_grads)
            g_axs = real_views(g_axs)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        increment_steps(g_steps)
        if weight_decay != 0:
            if maximize:
                torch._foreach_add_(g_grads, g_params, alpha=weight_decay)
                intermediate = g_grads
            else:
                intermediate = list(torch._foreach_add(g_grads, g_params, alpha=weight_decay))
            torch._foreach_add_(intermediate, g_params, alpha=lambd)
        else:
            intermediate = list(torch._foreach_add(g_grads, g_params, alpha=lambd))
        torch._foreach_addcmul_(g_params, intermediate, g_etas, value=-1)
        difference = torch._foreach_sub(g_params, g_axs)
        torch._foreach_addcmul_(g_axs, difference, g_mus)
        device = g_params[0].device
        new_etas: List[Tensor] = []
        new_mus: List[Tensor] = []
        for s in g_steps:
            # torch's ``lr / t`` on a tensor is ``t.reciprocal() * lr``.
            new_etas.append(((1 + lambd * lr * s) ** alpha).reciprocal().mul(lr).to(device))
            value = 1 / max(1.0, scalar_value(s) - t0)
            new_mus.append(torch.full((), value, dtype=s.dtype).to(device))
        torch._foreach_copy_(g_etas, new_etas)
        torch._foreach_copy_(g_mus, new_mus)


def asgd_impl(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    state_steps: List[Tensor],
    lambd: float,
    lr: float,
    t0: float,
    alpha: float,
    weight_decay: float,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``), no checks."""
    if impl == "foreach":
        asgd_foreach(
            params, grads, axs, mus, etas, state_steps, lambd, lr, t0, alpha, weight_decay, maximize
        )
    else:
        asgd_single(
            params, grads, axs, mus, etas, state_steps, lambd, lr, t0, alpha, weight_decay, maximize
        )


def asgd(
    params: List[Tensor],
    grads: List[Tensor],
    axs: List[Tensor],
    mus: List[Tensor],
    etas: List[Tensor],
    state_steps: List[Tensor],
    lambd: float,
    lr: float,
    t0: float,
    alpha: float,
    weight_decay: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Averaged SGD (torch.optim.ASGD).

    Updates ``params``, ``axs``, ``mus``, ``etas`` and ``state_steps`` in place; call it under
    ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param.
        axs: running averages of the params, one per param.
        mus: 0-d averaging coefficients (start at 1).
        etas: 0-d effective learning rates (start at ``lr``).
        state_steps: 0-d float step counters, one per param (incremented here).
        lambd: decay term.
        lr: learning rate (sets the next ``etas``).
        t0: step at which averaging starts.
        alpha: power of the ``eta`` update.
        weight_decay: L2 penalty added to the gradient.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (per-tensor on CPU, multi-tensor elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: if ``impl`` is unknown or ``fused`` (torch has no fused ASGD).
    """
    asgd_impl(
        params,
        grads,
        axs,
        mus,
        etas,
        state_steps,
        lambd,
        lr,
        t0,
        alpha,
        weight_decay,
        maximize,
        resolve_impl(impl, params, False),
    )
