"""Adagrad kernel (torch.optim.Adagrad): per-tensor, multi-tensor and fused paths.

All paths update ``params``, ``state_sums`` and ``state_steps`` in place. ``state_steps`` are
scalar tensors; each path adds one to them first and reads the new value with ``.item()``, as
torch's non-capturable path does. ``initial_accumulator_value`` is the caller's concern: it is
the fill value of ``state_sums`` when the state is created.

Numerics: ``adagrad_single`` is bitwise equal to ``torch.optim.Adagrad(foreach=False)``,
``adagrad_foreach`` to ``foreach=True`` and ``adagrad_fused`` to ``fused=True``.
"""

from typing import List

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl, take
from functional_optim.kernels._tensor_lists import (
    check_lengths,
    group_by_device_dtype,
    has_complex,
    has_sparse,
    real_views,
    scalar_value,
)


def _check(
    params: List[Tensor], grads: List[Tensor], state_sums: List[Tensor], state_steps: List[Tensor]
) -> None:
    check_lengths(
        "adagrad",
        params,
        [grads, state_sums, state_steps],
        ["grads", "state_sums", "state_steps"],
    )


def _check_sparse_weight_decay(grads: List[Tensor], weight_decay: float) -> None:
    if weight_decay != 0 and has_sparse(grads):
        raise RuntimeError("weight_decay option is not compatible with sparse gradients")


def _sparse_like(grad: Tensor, values: Tensor) -> Tensor:
    # ``grad`` is coalesced, so its indices need no invariant checks (nor their warning).
    out: Tensor = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        grad.sparse_dim(),
        grad.dense_dim(),
        grad.size(),
        grad._indices(),
        values,
        dtype=values.dtype,
        layout=torch.sparse_coo,
        device=values.device,
        is_coalesced=True,
    )
    return out


def _sparse_update(param: Tensor, grad: Tensor, state_sum: Tensor, clr: float, eps: float) -> None:
    grad = grad.coalesce()  # the update is non-linear, so indices must be unique
    values = grad._values()
    state_sum.add_(_sparse_like(grad, values.pow(2)))
    std_values = state_sum.sparse_mask(grad)._values().sqrt_().add_(eps)
    param.add_(_sparse_like(grad, values / std_values), alpha=-clr)


def adagrad_single(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """Adagrad, one tensor at a time (torch's ``foreach=False`` path).

    Args:
        params: parameters, updated in place.
        grads: one gradient per param (dense, or sparse COO when ``weight_decay == 0``).
        state_sums: running sums of squared gradients, updated in place.
        state_steps: scalar step tensors, incremented in place.
        lr: learning rate.
        weight_decay: L2 penalty added to the gradient.
        lr_decay: learning-rate decay, ``clr = lr / (1 + (step - 1) * lr_decay)``.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing.

    Raises:
        ValueError: if the lists differ in length.
        RuntimeError: if ``weight_decay != 0`` with a sparse gradient.
    """
    _check(params, grads, state_sums, state_steps)
    _check_sparse_weight_decay(grads, weight_decay)
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        state_sum = state_sums[i]
        step_t = state_steps[i]
        step_t.add_(1)
        step = scalar_value(step_t)
        if maximize:
            grad = torch.neg(grad)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        clr = lr / (1.0 + (step - 1.0) * lr_decay)
        if grad.is_sparse:
            _sparse_update(param, grad, state_sum, clr, eps)
            continue
        if torch.is_complex(param):
            grad = torch.view_as_real(grad)
            state_sum = torch.view_as_real(state_sum)
            param = torch.view_as_real(param)
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(eps)
        param.addcdiv_(grad, std, value=-clr)


def _foreach_group(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    if has_sparse(grads):
        adagrad_single(
            params, grads, state_sums, state_steps, lr, weight_decay, lr_decay, eps, maximize
        )
        return
    if has_complex(params):
        params = real_views(params)
        grads = real_views(grads)
        state_sums = real_views(state_sums)
    if maximize:
        grads = torch._foreach_neg(grads)  # type: ignore[assignment]
    torch._foreach_add_(state_steps, 1)
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)  # type: ignore[assignment]
    # foreach takes a list of Scalars; float64 round-trips give exact Scalars under TorchScript.
    minus_clr = [
        torch.scalar_tensor(
            -lr / (1.0 + (float(step.item()) - 1.0) * lr_decay), dtype=torch.float64
        ).item()
        for step in state_steps
    ]
    torch._foreach_addcmul_(state_sums, grads, grads, value=1)
    std = torch._foreach_sqrt(state_sums)
    torch._foreach_add_(std, eps)
    if weight_decay != 0 or maximize:
        torch._foreach_mul_(grads, minus_clr)
        numerator = grads
    else:
        numerator = torch._foreach_mul(grads, minus_clr)  # type: ignore[assignment]
    torch._foreach_addcdiv_(params, numerator, std)


def adagrad_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """Adagrad with ``torch._foreach_*`` ops per (device, dtype) group (``foreach=True``).

    Groups that contain a sparse gradient run :func:`adagrad_single`, as torch does. Arguments
    and exceptions as in :func:`adagrad_single`.
    """
    _check(params, grads, state_sums, state_steps)
    _check_sparse_weight_decay(grads, weight_decay)
    for idx in group_by_device_dtype(params):
        _foreach_group(
            take(params, idx),
            take(grads, idx),
            take(state_sums, idx),
            take(state_steps, idx),
            lr,
            weight_decay,
            lr_decay,
            eps,
            maximize,
        )


# torch._fused_adagrad_ has no fake (meta) kernel, so torch.compile cannot trace it: run it
# eagerly (a graph break) under torch.compile, and as a Python call from TorchScript.
@torch.jit.ignore  # type: ignore[untyped-decorator]
@torch.compiler.disable  # type: ignore[untyped-decorator]
def _fused_adagrad_call(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    torch._fused_adagrad_(
        params,
        grads,
        state_sums,
        state_steps,
        lr=lr,
        lr_decay=lr_decay,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=None,
        found_inf=None,
    )


def adagrad_fused(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """Adagrad with ``torch._fused_adagrad_`` per (device, dtype) group (``fused=True``).

    Arguments as in :func:`adagrad_single`; ``state_steps`` must be float32 on the params'
    device, as torch's fused Adagrad creates them.

    Raises:
        ValueError: if the lists differ in length.
        RuntimeError: for sparse gradients or complex params (use ``single`` or ``foreach``).
    """
    _check(params, grads, state_sums, state_steps)
    if len(params) == 0:
        return
    if has_sparse(grads) or has_complex(params):
        raise RuntimeError("`fused` does not support sparse grad or complex param")
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        g_sums = take(state_sums, idx)
        g_steps = take(state_steps, idx)
        torch._foreach_add_(g_steps, 1)
        _fused_adagrad_call(
            g_params, g_grads, g_sums, g_steps, lr, weight_decay, lr_decay, eps, maximize
        )


def adagrad(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adagrad (torch.optim.Adagrad) through the path chosen by ``impl``.

    Args:
        params: parameters, updated in place.
        grads: one gradient per param.
        state_sums: running sums of squared gradients, updated in place.
        state_steps: scalar step tensors, incremented in place.
        lr: learning rate.
        weight_decay: L2 penalty added to the gradient.
        lr_decay: learning-rate decay.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (fused on CPU, foreach on CUDA as torch's default there, the
            per-tensor loop for sparse gradients or complex params), ``single``, ``foreach``
            or ``fused`` (CPU and CUDA, as torch's).

    Raises:
        ValueError: for an unknown ``impl`` or lists of different lengths.
        RuntimeError: see :func:`adagrad_single` and :func:`adagrad_fused`.
    """
    # resolve_impl looks at the params only; fused cannot take sparse gradients.
    # torch's fused Adagrad runs on CPU and CUDA (``fused=True`` is taken on both, and its
    # message lists "cuda"); ``auto`` keeps torch's default on CUDA, foreach.
    if impl == "auto" and has_sparse(grads):
        path = "single"
    else:
        path = resolve_impl(impl, params, True, impl != "auto")
    if path == "fused":
        adagrad_fused(
            params, grads, state_sums, state_steps, lr, weight_decay, lr_decay, eps, maximize
        )
    elif path == "foreach":
        adagrad_foreach(
            params, grads, state_sums, state_steps, lr, weight_decay, lr_decay, eps, maximize
        )
    else:
        adagrad_single(
            params, grads, state_sums, state_steps, lr, weight_decay, lr_decay, eps, maximize
        )
