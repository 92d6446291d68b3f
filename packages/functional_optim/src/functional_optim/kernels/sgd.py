"""sgd kernel: per-tensor, multi-tensor (``_foreach``) and fused paths behind one dispatch.

Each path reproduces torch.optim.SGD's matching implementation op for op (``foreach=False``,
``foreach=True``, ``fused=True``), so results are bitwise equal. Momentum buffers start as
None; the first step stores a new buffer into ``momentum_buffers[i]``, as torch does.
"""

from typing import List, Optional

import torch
from torch import Tensor

from functional_optim.kernels._dispatch import resolve_impl, take
from functional_optim.kernels._tensor_lists import group_by_device_dtype, has_sparse


def sgd_single(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """Per-tensor SGD; bitwise equal to ``torch.optim.SGD(..., foreach=False)``.

    Supports sparse gradients. Args: as :func:`sgd`, without ``impl``."""
    for i in range(len(params)):
        param = params[i]
        grad = grads[i]
        if maximize:
            grad = -grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            old_buf = momentum_buffers[i]
            if old_buf is None:
                buf = grad.detach().clone()
                momentum_buffers[i] = buf
            else:
                buf = old_buf
                buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buf, alpha=momentum) if nesterov else buf
        param.add_(grad, alpha=-lr)


def sgd_foreach(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """Multi-tensor SGD; bitwise equal to ``torch.optim.SGD(..., foreach=True)``.

    Sparse gradients fall back to per-tensor adds, as in torch. Args: as :func:`sgd`, without
    ``impl``."""
    if len(params) == 0:
        return
    for idx in group_by_device_dtype(params):
        g_params = take(params, idx)
        g_grads = take(grads, idx)
        sparse = has_sparse(g_grads)
        if maximize:
            g_grads = list(torch._foreach_neg(g_grads))
        if weight_decay != 0:
            if maximize:
                # g_grads is already a fresh copy: update it in place.
                torch._foreach_add_(g_grads, g_params, alpha=weight_decay)
            else:
                g_grads = list(torch._foreach_add(g_grads, g_params, alpha=weight_decay))
        if momentum != 0:
            bufs: List[Tensor] = []
            all_have_buffer = True
            for i in idx:
                maybe_buf = momentum_buffers[i]
                if maybe_buf is not None:
                    bufs.append(maybe_buf)
                else:
                    all_have_buffer = False
                    break
            if all_have_buffer:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, g_grads, alpha=1 - dampening)
            else:
                bufs = []
                for j in range(len(idx)):
                    old_buf = momentum_buffers[idx[j]]
                    if old_buf is None:
                        new_buf = g_grads[j].detach().clone()
                        momentum_buffers[idx[j]] = new_buf
                        bufs.append(new_buf)
                    else:
                        old_buf.mul_(momentum).add_(g_grads[j], alpha=1 - dampening)
                        bufs.append(old_buf)
            if nesterov:
                if maximize or weight_decay != 0:
                    torch._foreach_add_(g_grads, bufs, alpha=momentum)
                else:
                    # torch adds in place into the caller's grads here; we leave them intact
                    # (same values, one extra allocation).
                    g_grads = list(torch._foreach_add(g_grads, bufs, alpha=momentum))
            else:
                g_grads = bufs
        if not sparse:
            torch._foreach_add_(g_params, g_grads, alpha=-lr)
        else:
            for j in range(len(g_params)):
                g_params[j].add_(g_grads[j], alpha=-lr)


def _sgd_loop_into(
    params: List[Tensor],
    grads: List[Tensor],
    bufs: List[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
) -> None:
    """torch's per-tensor SGD into the fused path's buffers.

    torch 2.13's fused CPU SGD with momentum reads memory it never wrote in bfloat16 and float16
    (two identical runs give different params), so those groups take torch's loop instead.
    """
    loop_bufs: List[Optional[Tensor]] = []
    for buf in bufs:
        loop_bufs.append(None if is_first_step else buf)
    sgd_single(params, grads, loop_bufs, lr, momentum, dampening, weight_decay, nesterov, maximize)
    if is_first_step:
        for j in range(len(bufs)):
            new_buf = loop_bufs[j]
            if new_buf is not None:
                bufs[j].copy_(new_buf)


def _sgd_fused_call(
    params: List[Tensor],
    grads: List[Tensor],
    bufs: List[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
) -> None:
    for idx in group_by_device_dtype(params):
        g_bufs: List[Tensor] = []
        if momentum != 0:
            g_bufs = take(bufs, idx)
            first = params[idx[0]]
            if first.is_cpu and (first.dtype == torch.bfloat16 or first.dtype == torch.float16):
                _sgd_loop_into(
                    take(params, idx), take(grads, idx), g_bufs, lr, momentum, dampening,
                    weight_decay, nesterov, maximize, is_first_step,
                )  # fmt: skip
                continue
        torch._fused_sgd_(
            take(params, idx),
            take(grads, idx),
            g_bufs,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
            is_first_step=is_first_step,
            grad_scale=None,
            found_inf=None,
        )


def sgd_fused(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """Fused SGD (``torch._fused_sgd_``); bitwise equal to ``torch.optim.SGD(..., fused=True)``.

    Needs dense floating-point params and grads. Unlike torch, a mix of params with and without
    a momentum buffer is allowed: the new ones run as a first step, the others as a later one.

    Args: as :func:`sgd`, without ``impl``.

    Raises:
        RuntimeError: if a gradient is sparse (torch's message).
    """
    if len(params) == 0:
        return
    if has_sparse(grads):
        raise RuntimeError("`_fused_sgd` does not support sparse gradients")
    if momentum == 0:
        if torch.jit.is_scripting():  # type: ignore[attr-defined]
            # TorchScript's alias analysis drops a ``_fused_sgd_`` whose only writes go to the
            # params of a list built inside the script (no momentum buffer keeps it alive), so
            # scripted callers take the per-tensor path: the same update, one ``add_`` each.
            sgd_single(
                params,
                grads,
                momentum_buffers,
                lr,
                momentum,
                dampening,
                weight_decay,
                nesterov,
                maximize,
            )
            return
        _sgd_fused_call(
            params, grads, [], lr, momentum, dampening, weight_decay, nesterov, maximize, False
        )
        return
    new_idx: List[int] = []
    old_idx: List[int] = []
    old_bufs: List[Tensor] = []
    for i in range(len(params)):
        buf = momentum_buffers[i]
        if buf is None:
            new_idx.append(i)
        else:
            old_idx.append(i)
            old_bufs.append(buf)
    if len(new_idx) > 0:
        new_bufs: List[Tensor] = []
        for i in new_idx:
            new_buf = torch.empty_like(grads[i])
            momentum_buffers[i] = new_buf
            new_bufs.append(new_buf)
        _sgd_fused_call(
            take(params, new_idx),
            take(grads, new_idx),
            new_bufs,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
            True,
        )
    if len(old_idx) > 0:
        _sgd_fused_call(
            take(params, old_idx),
            take(grads, old_idx),
            old_bufs,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
            False,
        )


def sgd_impl(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    impl: str,
) -> None:
    """Run the already-resolved path ``impl`` (``single``/``foreach``/``fused``), no checks.

    Used by :func:`sgd` and by the functional optimizer, which resolves ``impl`` once."""
    if impl == "fused":
        sgd_fused(
            params,
            grads,
            momentum_buffers,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
        )
    elif impl == "foreach":
        sgd_foreach(
            params,
            grads,
            momentum_buffers,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
        )
    else:
        sgd_single(
            params,
            grads,
            momentum_buffers,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize,
        )


def sgd(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """SGD with momentum, dampening, weight decay, Nesterov and maximize (torch.optim.SGD).

    ``momentum_buffers[i]`` may be None before the first step; the kernel stores the new buffer
    there (a clone of the first gradient), as torch does. Updates ``params`` and the buffers in
    place; call it under ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param (sparse allowed on the single and foreach paths).
        momentum_buffers: one buffer or None per param (unused when ``momentum == 0``).
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (fused where possible, else per-tensor on CPU and multi-tensor
            elsewhere; sparse gradients take the per-tensor path), ``single``, ``foreach`` or
            ``fused``.

    Raises:
        ValueError: if ``impl`` is unknown.
        RuntimeError: if ``impl="fused"`` and the params or grads cannot use the fused kernel.
    """
    sparse_auto = impl == "auto" and has_sparse(grads)
    chosen = "single" if sparse_auto else resolve_impl(impl, params, True)
    sgd_impl(
        params,
        grads,
        momentum_buffers,
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        maximize,
        chosen,
    )
