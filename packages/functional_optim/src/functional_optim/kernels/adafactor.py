"""adafactor kernel: per-tensor and multi-tensor (``_foreach``) paths behind one dispatch.

torch has no fused Adafactor. Each path reproduces torch.optim.Adafactor's matching
implementation op for op (``foreach=False`` / ``foreach=True``), so results are bitwise equal.
Params with more than one dimension keep factored second moments (``row_vars``, ``col_vars``;
``variances`` entry None); the others a full ``variances`` entry (row/col entries None).
As in torch, ``eps1=None`` means the machine epsilon of the first param's dtype, and an empty
param fails (torch divides by its zero size).
"""

from typing import List, Optional, Union

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl, take
from functional_optim.kernels._tensor_lists import (
    group_by_device_dtype,
    increment_steps,
    scalar_value,
)


def dtype_eps(dtype: torch.dtype) -> float:
    """``torch.finfo(dtype).eps`` (``finfo`` is not scriptable)."""
    if dtype == torch.float64:
        return 2.220446049250313e-16
    if dtype == torch.float16:
        return 0.0009765625
    if dtype == torch.bfloat16:
        return 0.0078125
    return 1.1920928955078125e-07


def _rms(t: Tensor) -> float:
    """``t.norm(2).item() / numel ** 0.5`` as torch computes it."""
    return float(torch.linalg.vector_norm(t, 2.0).item()) / float(t.numel() ** 0.5)


def _step_scales(step: float, lr: float, beta2_decay: float) -> List[float]:
    """``[1 - beta2_t, rho_t]`` of the step (torch's ``one_minus_beta2_t`` and ``rho_t``)."""
    return [step**beta2_decay, min(lr, 1 / (step**0.5))]


def adafactor_single(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Optional[Tensor]],
    col_vars: List[Optional[Tensor]],
    variances: List[Optional[Tensor]],
    state_steps: List[Tensor],
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
) -> None:
    """Per-tensor Adafactor; bitwise equal to ``torch.optim.Adafactor(..., foreach=False)``.

    Args: as :func:`adafactor`, without ``impl``."""
    floor = -1.0
    if eps1 is not None:
        floor = eps1
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        step_t = state_steps[i]
        if floor < 0:
            floor = dtype_eps(param.dtype)
        step_t += 1
        scales = _step_scales(scalar_value(step_t), lr, beta2_decay)
        alpha = max(eps2, _rms(param)) * scales[1]
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        row_var = row_vars[i]
        col_var = col_vars[i]
        variance = variances[i]
        if grad.dim() > 1:
            assert row_var is not None
            assert col_var is not None
            row_mean = torch.linalg.vector_norm(grad, 2.0, [-1], True).square_()
            row_var.lerp_(row_mean.div_(grad.size(-1)), scales[0])
            col_mean = torch.linalg.vector_norm(grad, 2.0, [-2], True).square_()
            col_var.lerp_(col_mean.div_(grad.size(-2)), scales[0])
            estimate = row_var @ col_var
            estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=floor))
        else:
            assert variance is not None
            variance.lerp_(grad * grad, scales[0])
            estimate = variance.clone()
        update = estimate.clamp_(min=floor * floor).rsqrt_()
        update.mul_(grad)
        denom = max(
            1.0, float(torch.linalg.vector_norm(update, 2.0).item()) / ((update.numel() ** 0.5) * d)
        )
        param.add_(update, alpha=-alpha / denom)


def _split_by_dim(params: List[Tensor], idx: List[int]) -> List[List[int]]:
    """``idx`` split into (multi-dimensional, other) groups, in first-seen order (torch's)."""
    matrices: List[int] = []
    vectors: List[int] = []
    first_is_matrix = params[idx[0]].dim() > 1
    for i in idx:
        if params[i].dim() > 1:
            matrices.append(i)
        else:
            vectors.append(i)
    out: List[List[int]] = []
    for group in [matrices, vectors] if first_is_matrix else [vectors, matrices]:
        if len(group) > 0:
            out.append(group)
    return out


def _some(tensors: List[Optional[Tensor]], idx: List[int]) -> List[Tensor]:
    out: List[Tensor] = []
    for i in idx:
        t = tensors[i]
        assert t is not None
        out.append(t)
    return out


def adafactor_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Optional[Tensor]],
    col_vars: List[Optional[Tensor]],
    variances: List[Optional[Tensor]],
    state_steps: List[Tensor],
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
) -> None:
    """Multi-tensor Adafactor; bitwise equal to ``torch.optim.Adafactor(..., foreach=True)``.

    Args: as :func:`adafactor`, without ``impl``."""
    if len(params) == 0:
        return
    floor = -1.0
    if eps1 is not None:
        floor = eps1
    for by_dtype in group_by_device_dtype(params):
        for idx in _split_by_dim(params, by_dtype):
            g_params = take(params, idx)
            g_grads = take(grads, idx)
            g_steps = take(state_steps, idx)
            if floor < 0:
                floor = dtype_eps(g_params[0].dtype)
            if maximize:
                g_grads = list(torch._foreach_neg(g_grads))
            increment_steps(g_steps)
            # Union[int, float, complex] is TorchScript's "number" (ScalarList overloads).
            weights: List[Union[int, float, complex]] = []
            alphas: List[float] = []
            for j in range(len(g_steps)):
                scales = _step_scales(scalar_value(g_steps[j]), lr, beta2_decay)
                weights.append(scales[0])
                alphas.append(max(eps2, _rms(g_params[j])) * scales[1])
            if weight_decay != 0:
                torch._foreach_mul_(g_params, 1 - lr * weight_decay)
            if g_params[0].dim() > 1:
                g_rows = _some(row_vars, idx)
                g_cols = _some(col_vars, idx)
                row_means: List[Tensor] = []
                col_means: List[Tensor] = []
                row_sizes: List[Union[int, float, complex]] = []
                col_sizes: List[Union[int, float, complex]] = []
                for g in g_grads:
                    row_means.append(torch.linalg.vector_norm(g, 2.0, [-1], True))
                    col_means.append(torch.linalg.vector_norm(g, 2.0, [-2], True))
                    row_sizes.append(g.size(-1))
                    col_sizes.append(g.size(-2))
                torch._foreach_mul_(row_means, row_means)
                torch._foreach_div_(row_means, row_sizes)
                torch._foreach_lerp_(g_rows, row_means, weights)
                torch._foreach_mul_(col_means, col_means)
                torch._foreach_div_(col_means, col_sizes)
                torch._foreach_lerp_(g_cols, col_means, weights)
                estimates: List[Tensor] = []
                row_var_means: List[Tensor] = []
                for j in range(len(g_rows)):
                    estimates.append(g_rows[j] @ g_cols[j])
                    row_var_means.append(g_rows[j].mean(dim=-2, keepdim=True))
                torch._foreach_clamp_min_(row_var_means, floor)
                torch._foreach_div_(estimates, row_var_means)
            else:
                g_vars = _some(variances, idx)
                squares = torch._foreach_mul(g_grads, g_grads)
                torch._foreach_lerp_(g_vars, squares, weights)
                estimates = [v.clone() for v in g_vars]
            torch._foreach_clamp_min_(estimates, floor * floor)
            torch._foreach_rsqrt_(estimates)
            torch._foreach_mul_(estimates, g_grads)
            step_sizes: List[Union[int, float, complex]] = []
            for j in range(len(estimates)):
                u = estimates[j]
                norm = float(torch.linalg.vector_norm(u, 2.0).item())
                step_sizes.append(-alphas[j] / max(1.0, norm / ((u.numel() ** 0.5) * d)))
            torch._foreach_mul_(estimates, step_sizes)
            torch._foreach_add_(g_params, estimates)


def adafactor_impl(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Optional[Tensor]],
    col_vars: List[Optional[Tensor]],
    variances: List[Optional[Tensor]],
    state_steps: List[Tensor],
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``), no checks."""
    if impl == "foreach":
        adafactor_foreach(
            params, grads, row_vars, col_vars, variances, state_steps,
            d, lr, beta2_decay, weight_decay, eps1, eps2, maximize,
        )  # fmt: skip
    else:
        adafactor_single(
            params, grads, row_vars, col_vars, variances, state_steps,
            d, lr, beta2_decay, weight_decay, eps1, eps2, maximize,
        )  # fmt: skip


def adafactor(
    params: List[Tensor],
    grads: List[Tensor],
    row_vars: List[Optional[Tensor]],
    col_vars: List[Optional[Tensor]],
    variances: List[Optional[Tensor]],
    state_steps: List[Tensor],
    d: float,
    lr: float,
    beta2_decay: float,
    weight_decay: float,
    eps1: Optional[float],
    eps2: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adafactor (torch.optim.Adafactor): factored second moments, relative step sizes.

    Updates ``params``, the second-moment buffers and ``state_steps`` in place; call it under
    ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update (real, non-empty).
        grads: one gradient per param.
        row_vars: per param with ``dim() > 1``: row factor (last dim reduced to 1); else None.
        col_vars: per param with ``dim() > 1``: column factor (dim -2 reduced to 1); else None.
        variances: per param with ``dim() <= 1``: full second moment; else None.
        state_steps: 0-d float step counters, one per param (incremented here).
        d: clipping threshold of the update's RMS.
        lr: learning rate (caps the relative step size ``1 / sqrt(t)``).
        beta2_decay: exponent of the second-moment decay ``1 - t ** beta2_decay``.
        weight_decay: decoupled weight decay.
        eps1: floor of the second moment (None: the dtype's machine epsilon).
        eps2: floor of the param RMS that scales the step.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (per-tensor on CPU, multi-tensor elsewhere), ``single`` or ``foreach``.

    Raises:
        ValueError: if ``impl`` is unknown or ``fused`` (torch has no fused Adafactor).
    """
    adafactor_impl(
        params, grads, row_vars, col_vars, variances, state_steps,
        d, lr, beta2_decay, weight_decay, eps1, eps2, maximize,
        resolve_impl(impl, params, False),
    )  # fmt: skip
