"""Out-of-place kernels: a list kernel's call that reads the old params and state and writes
new ones, in one pass.

``pure_step`` (:mod:`functional_optim._pure_flat`) must leave its inputs alone. With only
torch's in-place kernels it copies the params and moments into new buffers, then runs the
kernel on them: two passes over memory. For the kernels listed here it asks
:func:`for_kernel` for their out-of-place version, which computes torch's fused kernel's
result (bit for bit: :mod:`.cpu_extension` checks) straight into the new buffers, or declines
(returns False, nothing written) where it does not apply: another path than the fused one, a
tensor hyperparameter, a tensor that is not contiguous fp32 on CPU, a momentum buffer not made
yet. Then ``pure_step`` copies as before.

An algorithm takes part by adding its kernel's out-of-place version to :data:`_BY_KERNEL`;
nothing else in ``pure_step`` knows an algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from functional_optim import kernels
from functional_optim._kernel_args import adam_args, sgd_args
from functional_optim._out_of_place.cpu_extension import extension

__all__ = ["STREAM_BYTES", "OutOfPlace", "for_kernel"]

#: ``(args, old) -> ran``: ``args`` is the kernel's call with new tensors in the lists it
#: writes, ``old[i]`` the old tensors of written list ``i`` (None for the other arguments).
#: Returns False, having written nothing, where it does not apply.
OutOfPlace = Callable[[Sequence[Any], Sequence[Sequence[Tensor] | None]], bool]

#: the paths whose maths the extension reproduces: torch's fused kernels
_FUSED = ("auto", "fused")


#: Written bytes from which the kernels write with streaming stores (which skip reading each
#: line first but leave it out of the cache). Measured on a CPU with a 260 MiB last-level
#: cache: 1M-param Adam steps were 1.3-1.5x faster with plain stores, 10M-param ones 1.6x
#: faster with streaming ones (``benchmarks/pure_step_speed.py``).
STREAM_BYTES = 64 << 20


def _streams(numel: int, written: Sequence[Any]) -> bool:
    return numel * 4 * len(written) >= STREAM_BYTES


def _plain_floats(*values: Any) -> bool:
    return all(isinstance(v, (float, int)) and not isinstance(v, bool) for v in values)


def _adam(decoupled: bool) -> OutOfPlace:
    def run(args: Sequence[Any], old: Sequence[Sequence[Tensor] | None]) -> bool:
        a = adam_args(args)
        scalars = (a.lr, a.beta1, a.beta2, a.weight_decay, a.eps)
        if a.impl not in _FUSED or not _plain_floats(*scalars):
            return False
        written = (0, 2, 3, 4) if a.amsgrad else (0, 2, 3)
        before = [old[i] for i in written]
        if any(x is None for x in before):
            return False
        after = [args[i] for i in written]
        module = extension()
        if module is None:
            return False
        numel = module.fitting_numel([*before, *after, a.grads], a.state_steps, True)
        if numel < 0:
            return False
        hyper = (*map(float, scalars), bool(a.amsgrad), bool(a.maximize), decoupled)
        module.adam_out(before, a.grads, after, a.state_steps, *hyper, _streams(numel, after))
        return True

    return run


def _sgd(args: Sequence[Any], old: Sequence[Sequence[Tensor] | None]) -> bool:
    a = sgd_args(args)
    scalars = (a.lr, a.momentum, a.dampening, a.weight_decay)
    if a.impl not in _FUSED or not _plain_floats(*scalars):
        return False
    written = (0, 2) if a.momentum != 0 else (0,)
    before = [old[i] for i in written]
    # a momentum buffer made at this step (torch's first step) takes torch's kernel
    if any(x is None or any(t is None for t in x) for x in before):
        return False
    after = [args[i] for i in written]
    module = extension()
    if module is None:
        return False
    numel = module.fitting_numel([*before, *after, a.grads], [], False)
    if numel < 0:
        return False
    flags = (bool(a.nesterov), bool(a.maximize), _streams(numel, after))
    module.sgd_out(before, a.grads, after, *map(float, scalars), *flags)
    return True


#: kernel -> its out-of-place version
_BY_KERNEL: dict[Callable[..., None], OutOfPlace] = {
    kernels.adam: _adam(decoupled=False),
    kernels.adamw: _adam(decoupled=True),
    kernels.sgd: _sgd,
}


def for_kernel(kernel: Callable[..., None]) -> OutOfPlace | None:
    """``kernel``'s out-of-place version, or None (see the module docstring)."""
    return _BY_KERNEL.get(kernel)
