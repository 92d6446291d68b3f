"""The list kernels of the in-place chain tails that torch has no single kernel for.

:mod:`functional_optim._fusion` matches a chain's tail (``scale_by_lion, [decay], scale(-lr)``,
...) and calls one of these through :func:`functional_optim._kernel_runner.run_kernel`, with
each argument's role in the matching ``*_ROLES``. Each writes the params and its moments in
place with ``torch._foreach_*`` ops, in torch's op order where torch has the algorithm.
``decays[k]`` says whether leaf ``k`` takes the weight decay (a masked decay splits them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from functional_optim._counts import increment_counts
from functional_optim._kernel_runner import Role

__all__ = [
    "ADAMAX_ROLES",
    "LION_ROLES",
    "LR_ROLES",
    "RMS_ROLES",
    "TAIL_STATE",
    "adamax",
    "lion",
    "lr_only",
    "rms",
]

#: The state fields each tail rule's kernel writes (``pure_step`` copies the others).
TAIL_STATE = {
    "adam": ("count", "mu", "nu", "nu_max"),
    "lion": ("count", "mu"),
    "rms": ("count", "nu", "mu"),
    "adamax": ("count", "mu", "nu"),
    "lr": (),
}


def _decay(params: list[Tensor], decays: list[bool], lr: float, weight_decay: float) -> None:
    if weight_decay != 0.0:
        decayed = [p for p, d in zip(params, decays, strict=True) if d]
        if decayed:
            torch._foreach_mul_(decayed, 1.0 - lr * weight_decay)


LION_ROLES: tuple[Role, ...] = ("write", "read", "write", "count", "read", None, None, None, None)


def lion(
    params: list[Tensor],
    updates: list[Tensor],
    mu: list[Tensor],
    counts: list[Tensor],
    decays: list[bool],
    lr: float,
    weight_decay: float,
    b1: float,
    b2: float,
) -> None:
    """Lion in the ``lerp`` form (``m + (1 - b) * (g - m)``), decoupled decay first."""
    increment_counts(counts)
    _decay(params, decays, lr, weight_decay)
    direction = torch._foreach_lerp(mu, updates, 1 - b1)
    torch._foreach_sign_(direction)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(mu, updates, 1 - b2)


RMS_ROLES: tuple[Role, ...] = ("write", "read", "write", "write", "count", "read", *[None] * 5)


def rms(
    params: list[Tensor],
    updates: list[Tensor],
    nu: list[Tensor],
    mu: list[Tensor],
    counts: list[Tensor],
    decays: list[bool],
    lr: float,
    weight_decay: float,
    alpha: float,
    eps: float,
    centered: bool,
) -> None:
    """torch's foreach RMSprop (``p.addcdiv_(g, sqrt(v) + eps, value=-lr)``); ``mu`` is the
    gradient average when ``centered``."""
    increment_counts(counts)
    torch._foreach_mul_(nu, alpha)
    torch._foreach_addcmul_(nu, updates, updates, value=1 - alpha)
    if centered:
        torch._foreach_lerp_(mu, updates, 1 - alpha)
        avg = torch._foreach_addcmul(nu, mu, mu, value=-1)
        torch._foreach_sqrt_(avg)
    else:
        avg = torch._foreach_sqrt(nu)
    torch._foreach_add_(avg, eps)
    _decay(params, decays, lr, weight_decay)
    torch._foreach_addcdiv_(params, updates, avg, value=-lr)


ADAMAX_ROLES: tuple[Role, ...] = ("write", "read", "write", "write", "count", "read", *[None] * 5)


def adamax(
    params: list[Tensor],
    updates: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    counts: list[Tensor],
    decays: list[bool],
    lr: float,
    weight_decay: float,
    b1: float,
    b2: float,
    eps: float,
) -> None:
    """torch's foreach Adamax (``p.addcdiv_(m, u, value=-lr / (1 - b1**t))``)."""
    increment_counts(counts)
    torch._foreach_lerp_(mu, updates, 1 - b1)
    torch._foreach_mul_(nu, b2)
    bound = torch._foreach_abs(updates)
    torch._foreach_add_(bound, eps)
    torch._foreach_maximum_(nu, bound)
    _decay(params, decays, lr, weight_decay)
    rates = [-(lr / (1 - b1 ** float(count))) for count in counts]
    torch._foreach_addcdiv_(params, mu, nu, rates)


LR_ROLES: tuple[Role, ...] = ("write", "read", "read", None, None)


def lr_only(
    params: list[Tensor], updates: list[Tensor], decays: list[bool], lr: float, weight_decay: float
) -> None:
    """``p.mul_(1 - lr * wd)`` on the decayed leaves, then ``p.add_(u, alpha=-lr)``."""
    _decay(params, decays, lr, weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
