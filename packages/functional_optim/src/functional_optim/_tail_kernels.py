"""The built-in fused chain tails (how ``chain(<scaling>, [decay], lr)`` runs as one list
kernel), and the kernels torch has none for.

A scaling transform (``scale_by_adam``, ``scale_by_lion``, ``scale_by_rms``,
``scale_by_adamax``) names its tail (a :class:`functional_optim._lists.FusedTail`) in its
``ListTransform``. When a chain ends in that transform, an optional ``add_decayed_weights(wd)``
(masked or not) and a learning rate, :mod:`functional_optim._fusion` runs the tail's kernel
instead of the three components: it only matches that shape, and reads everything else (torch's
checks, the state lists the kernel reads and writes, the call) from the declaration, so a new
algorithm's tail is one declaration beside its transform.

The kernels here write the params and their moments in place with ``torch._foreach_*`` ops,
in torch's op order where torch has the algorithm, and are called through
:func:`functional_optim._kernel_runner.run_kernel` with each argument's role in the matching
``*_ROLES`` (so that ``pure_step`` can run them on copies). ``decays[k]`` says whether leaf
``k`` takes the weight decay (a masked decay splits them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from functional_optim import kernels
from functional_optim._counts import increment_counts
from functional_optim._input_checks import GradRules
from functional_optim._kernel_runner import Role, run_kernel
from functional_optim._lists import FusedTail, LeafView, TailCall

__all__ = [
    "ADAMAX_TAIL",
    "ADAM_SPARSE",
    "ADAM_TAIL",
    "LION_TAIL",
    "LR_ROLES",
    "RMS_TAIL",
    "adamax",
    "lion",
    "lr_only",
    "rms",
]

#: torch.optim.Adam's message for a sparse gradient (AdamW, its subclass, shares it).
ADAM_SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"


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


#: ``kernels.adam(w)``'s arguments: params, grads, mu, nu, nu_max, counts, then scalars.
_ADAM_ROLES: tuple[Role, ...] = ("write", "read", "write", "write", "write", "count", *[None] * 8)


def _adam_kernel(call: TailCall, view: LeafView, updates: list[Tensor], wd: float) -> None:
    if not updates:
        return
    hyper, state = call.hyper, call.state
    amsgrad = bool(hyper["amsgrad"])
    args = [
        list(view.params),  # the runner refills its lists with new tensors
        updates,
        view.gather(state.mu),
        view.gather(state.nu),
        view.gather(state.nu_max) if amsgrad else [],
        view.gather(state.count),
        amsgrad,
        float(hyper["b1"]),
        float(hyper["b2"]),
        call.lr,
        wd,
        float(hyper["eps"]),
        False,
        "auto",
    ]
    run_kernel(kernels.adamw if wd != 0.0 else kernels.adam, args, _ADAM_ROLES)


def _run_adam(call: TailCall) -> None:
    """``kernels.adamw`` (``kernels.adam`` without decay; torch's fused kernel where it has
    one); a masked decay splits the leaves in two calls, as torch's two param groups."""
    if call.decayed is None:
        _adam_kernel(call, call.view, call.updates, call.weight_decay)
        return
    chosen = set(call.decayed)
    rest = [j for j in range(len(call.view.idx)) if j not in chosen]
    for positions, decay in ((call.decayed, call.weight_decay), (rest, 0.0)):
        sub = call.view.subset(positions)
        _adam_kernel(call, sub, [call.updates[j] for j in positions], decay)


def _adam_buffers(hyper: Mapping[str, Any]) -> list[tuple[str, str]]:
    buffers = [("exp_avg", "mu"), ("exp_avg_sq", "nu")]
    if hyper["amsgrad"]:
        buffers.append(("max_exp_avg_sq", "nu_max"))
    return buffers


ADAM_TAIL = FusedTail(
    "adam",
    GradRules("Adam", sparse_message=ADAM_SPARSE),
    _adam_buffers,
    ("count", "mu", "nu", "nu_max"),
    _run_adam,
)


def _run_lion(call: TailCall) -> None:
    view, state, hyper = call.view, call.state, call.hyper
    args: list[Any] = [list(view.params), call.updates, view.gather(state.mu)]
    args += [view.gather(state.count), call.decays(), call.lr, call.weight_decay]
    args += [float(hyper["b1"]), float(hyper["b2"])]
    run_kernel(lion, args, LION_ROLES)


LION_TAIL = FusedTail(
    "lion", GradRules("Lion"), lambda hyper: [("exp_avg", "mu")], ("count", "mu"), _run_lion
)


def _run_rms(call: TailCall) -> None:
    view, state, hyper = call.view, call.state, call.hyper
    centered = bool(hyper["centered"])
    mu = view.gather(state.mu) if centered else []
    args: list[Any] = [list(view.params), call.updates, view.gather(state.nu), mu]
    args += [view.gather(state.count), call.decays(), call.lr, call.weight_decay]
    args += [float(hyper["alpha"])]
    run_kernel(rms, [*args, float(hyper["eps"]), centered], RMS_ROLES)


def _rms_buffers(hyper: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [("square_avg", "nu"), *([("grad_avg", "mu")] if hyper["centered"] else [])]


RMS_TAIL = FusedTail(
    "rms", GradRules("RMSprop", promotes=True), _rms_buffers, ("count", "nu", "mu"), _run_rms
)


def _run_adamax(call: TailCall) -> None:
    view, state, hyper = call.view, call.state, call.hyper
    args: list[Any] = [list(view.params), call.updates, view.gather(state.mu)]
    args += [view.gather(state.nu), view.gather(state.count), call.decays(), call.lr]
    args += [call.weight_decay, float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])]
    run_kernel(adamax, args, ADAMAX_ROLES)


ADAMAX_TAIL = FusedTail(
    "adamax",
    GradRules("Adamax"),
    lambda hyper: [("exp_avg", "mu"), ("exp_inf", "nu")],
    ("count", "mu", "nu"),
    _run_adamax,
)
