"""The out-of-place CPU kernels' extension (:mod:`.cpu_source`): built on first use, and used
only where its results equal torch's fused kernels bit for bit, which it checks once per
process on a probe of every branch (vector loop and scalar tail, each option of Adam, AdamW
and SGD). Elsewhere (not x86 with AVX2, no compiler, another torch build) it is None and
``pure_step`` copies, then runs torch's kernel in place."""

from __future__ import annotations

import functools
import itertools
import logging
import platform
from typing import Any

import torch
from torch import Tensor

from functional_optim._cpp_extension import ISA_FLAGS, load
from functional_optim._out_of_place.cpu_source import FUNCTIONS, SOURCE

__all__ = ["agrees_with_torch", "built", "extension"]

_LOG = logging.getLogger(__name__)

#: torch's level for its fused optimizer kernels on x86: AVX512 machines run the AVX2 build
_LEVEL = "AVX2"

#: probe sizes: a scalar tail only, one vector, vectors and a tail, several 64-byte pieces
_SIZES = (1, 7, 8, 9, 23, 100, 1029)


@functools.cache
def built() -> Any | None:
    """The extension module, unchecked; None where it cannot be built here."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine() not in ("x86_64", "AMD64") or capability not in ("AVX2", "AVX512"):
        return None
    flags = [*ISA_FLAGS[_LEVEL], f"-DCPU_CAPABILITY={_LEVEL}", f"-DCPU_CAPABILITY_{_LEVEL}"]
    name = f"functional_optim_out_of_place_{_LEVEL.lower()}"
    return load(name, SOURCE, FUNCTIONS, flags, threads=True)


@functools.cache
def extension() -> Any | None:
    """The extension module where it equals torch's fused kernels, else None (logged once)."""
    module = built()
    if module is None:
        return None
    try:
        agrees = agrees_with_torch(module)
    except Exception as error:  # a torch whose private fused ops changed their signature
        _LOG.warning("the out-of-place kernels' check failed (%s)", error)
        agrees = False
    if not agrees:
        _LOG.warning(
            "the out-of-place kernels differ from this torch's fused kernels; pure_step "
            "copies and runs torch's kernels instead"
        )
        return None
    return module


#: explicit, whatever the default device and dtype are
_CPU32: dict[str, Any] = {"device": "cpu", "dtype": torch.float32}


def _probe(generator: torch.Generator, count: int) -> list[list[Tensor]]:
    return [[torch.randn(n, generator=generator, **_CPU32) for n in _SIZES] for _ in range(count)]


def _equal(a: list[list[Tensor]], b: list[list[Tensor]]) -> bool:
    return all(torch.equal(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys))


def _adam_agrees(module: Any, case: tuple[Any, ...], generator: torch.Generator) -> bool:
    decoupled, amsgrad, maximize, beta1, weight_decay, stream = case
    params, grads, exp_avgs, exp_avg_sqs, maxima = _probe(generator, 5)
    exp_avg_sqs, maxima = [t.abs() for t in exp_avg_sqs], [t.abs() for t in maxima]
    old = [params, exp_avgs, exp_avg_sqs, maxima] if amsgrad else [params, exp_avgs, exp_avg_sqs]
    theirs = [[t.clone() for t in x] for x in old]
    ours = [[torch.empty_like(t) for t in x] for x in old]
    steps = [torch.tensor(float(k), **_CPU32) for k in range(len(_SIZES))]
    our_steps = [s.clone() for s in steps]
    torch._foreach_add_(steps, 1)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    hyper = {"lr": 1e-2, "beta1": beta1, "beta2": 0.99, "weight_decay": weight_decay, "eps": 1e-3}
    fused(
        theirs[0], grads, theirs[1], theirs[2], theirs[3] if amsgrad else [], steps, **hyper,
        amsgrad=amsgrad, maximize=maximize, grad_scale=None, found_inf=None,
    )  # fmt: skip
    flags = (amsgrad, maximize, decoupled, stream)
    module.adam_out(old, grads, ours, our_steps, *hyper.values(), *flags)
    return _equal(ours, theirs) and _equal([our_steps], [steps])


def _sgd_agrees(module: Any, case: tuple[Any, ...], generator: torch.Generator) -> bool:
    momentum, nesterov, maximize, dampening, weight_decay, stream = case
    params, grads, bufs = _probe(generator, 3)
    old = [params, bufs] if momentum else [params]
    theirs = [[t.clone() for t in x] for x in old]
    ours = [[torch.empty_like(t) for t in x] for x in old]
    hyper = {"lr": 1e-2, "momentum": momentum, "dampening": dampening}
    torch._fused_sgd_(
        theirs[0], grads, theirs[1] if momentum else [], **hyper, weight_decay=weight_decay,
        nesterov=nesterov, maximize=maximize, is_first_step=False, grad_scale=None,
        found_inf=None,
    )  # fmt: skip
    flags = (nesterov, maximize, stream)
    module.sgd_out(old, grads, ours, *hyper.values(), weight_decay, *flags)
    return _equal(ours, theirs)


def agrees_with_torch(module: Any) -> bool:
    """Whether ``module``'s kernels give torch's fused kernels' bits on a probe of every
    option, with plain and with streaming stores (a few milliseconds)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    flags = (False, True)
    adam = itertools.product(flags, flags, flags, (0.9, 0.3), (0.0, 0.1), flags)
    if not all(_adam_agrees(module, case, generator) for case in adam):
        return False
    sgd = itertools.product((0.0, 0.9), flags, flags, (0.0, 0.1), (0.0, 0.01), flags)
    return all(_sgd_agrees(module, case, generator) for case in sgd if case[0] or not case[1])
