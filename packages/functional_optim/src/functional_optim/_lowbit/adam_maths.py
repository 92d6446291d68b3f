"""Adam's maths for low-bit moments on CPU: one definition for every path.

With these moments the Adam and AdamW kernels (:func:`functional_optim.kernels.adam`,
:func:`~functional_optim.kernels.adamw`) are replaced, through the kernel seam
(:mod:`functional_optim._kernel_runner`), by these operations, in this order, in fp32:

.. code-block:: text

    g = -grad if maximize else grad;  g = g + param * weight_decay  (Adam's L2 only)
    m = m + (g - m) * (1 - beta1);    v = v * beta2 + (g * g) * (1 - beta2)
    denom = sqrt(v) / sqrt(1 - beta2**t) + eps
    param = param * (1 - lr * weight_decay) - (m / denom) * (lr / (1 - beta1**t))

(the decay factor only for AdamW; ``sqrt`` correctly rounded). :func:`adam_lists` runs them
as torch ops on dequantised moments (a step whose blocks are shared with other ranks, or
without the C++ extension); :mod:`.fused_cpu` runs them in C++ with the codec, in one pass.
Every operation is rounded once (no fused multiply-add), so the two give the same bits, and
a model gives the same parameters however it is sharded. torch's own fused kernel orders its
operations otherwise (its results differ from these in the last bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from functional_optim import kernels
from functional_optim._kernel_args import adam_args
from functional_optim._kernel_runner import Role

__all__ = [
    "AdamCall",
    "EagerAdam",
    "adam_call",
    "adam_lists",
    "decoupled",
    "replaced_kernel",
]

#: the kernels replaced, and whether their weight decay is decoupled (AdamW)
_KERNELS: dict[Callable[..., None], bool] = {kernels.adam: False, kernels.adamw: True}

#: ``(beta1, beta2, eps, decay, l2, maximize)``
Hyper = tuple[float, float, float, float, float, bool]


@dataclass
class AdamCall:
    """One Adam kernel call's lists and the scalars of its step.

    Attributes:
        params, grads, exp_avgs, exp_avg_sqs: the kernel's lists.
        step_sizes: ``lr / (1 - beta1**t)`` per param.
        bc2_sqrts: ``sqrt(1 - beta2**t)`` per param.
        hyper: ``(beta1, beta2, eps, decay, l2, maximize)``.
    """

    params: list[Tensor]
    grads: list[Tensor]
    exp_avgs: list[Tensor]
    exp_avg_sqs: list[Tensor]
    step_sizes: list[float]
    bc2_sqrts: list[float]
    hyper: Hyper


def replaced_kernel(kernel: Callable[..., None], args: Sequence[Any]) -> bool:
    """Whether ``kernel(*args)`` is an Adam call these maths replace: Adam or AdamW without
    AMSGrad, on fp32 params."""
    if kernel not in _KERNELS:
        return False
    named = adam_args(args)
    return not named.amsgrad and all(p.dtype == torch.float32 for p in named.params)


def decoupled(kernel: Callable[..., None]) -> bool:
    """Whether a replaced kernel's weight decay is decoupled (AdamW)."""
    return _KERNELS[kernel]


def adam_call(kernel: Callable[..., None], args: Sequence[Any]) -> AdamCall | None:
    """The Adam call of ``kernel(*args)`` with its step counters advanced; None (nothing
    changed) where :func:`replaced_kernel` is false."""
    if not replaced_kernel(kernel, args):
        return None
    named = adam_args(args)
    params, grads, steps, maximize = named.params, named.grads, named.state_steps, named.maximize
    b1, b2, lr, wd, eps = map(
        float, (named.beta1, named.beta2, named.lr, named.weight_decay, named.eps)
    )
    if steps:
        torch._foreach_add_(list(steps), 1.0)
    corrections: dict[float, tuple[float, float]] = {}
    step_sizes, bc2_sqrts = [], []
    for count in steps:
        t = float(count)
        if t not in corrections:
            corrections[t] = (lr / (1 - b1**t), math.sqrt(1 - b2**t))
        step_size, bc2_sqrt = corrections[t]
        step_sizes.append(step_size)
        bc2_sqrts.append(bc2_sqrt)
    decay, l2 = (1 - lr * wd, 0.0) if _KERNELS[kernel] else (1.0, wd)
    hyper = (b1, b2, eps, decay, l2, bool(maximize))
    moments = list(named.exp_avgs), list(named.exp_avg_sqs)
    return AdamCall(list(params), list(grads), *moments, step_sizes, bc2_sqrts, hyper)


def adam_lists(call: AdamCall) -> None:
    """The step of ``call`` as torch ops, in place on its params and fp32 moments."""
    b1, b2, eps, decay, l2, maximize = call.hyper
    for p, g, m, v, step_size, bc2_sqrt in zip(
        call.params,
        call.grads,
        call.exp_avgs,
        call.exp_avg_sqs,
        call.step_sizes,
        call.bc2_sqrts,
        strict=True,
    ):
        if maximize:
            g = -g
        if l2 != 0:
            g = g + p * l2
        m.copy_(m + (g - m) * (1 - b1))
        v.copy_(v * b2 + (g * g) * (1 - b2))
        # the correctly rounded fp32 root (the C++ one): torch's fp32 sqrt on CPU may be off
        # by an ulp (MKL), the root of the exact fp64 value rounded to fp32 is not
        denom = v.double().sqrt().float() / bc2_sqrt + eps
        p.copy_(p * decay - (m / denom) * step_size)


class EagerAdam:
    """A kernel runner: Adam kernels run :func:`adam_lists`, others run as they are."""

    def __call__(self, kernel: Callable[..., None], args: list[Any], roles: Sequence[Role]) -> None:
        call = adam_call(kernel, args)
        if call is None:
            kernel(*args)
        else:
            adam_lists(call)
