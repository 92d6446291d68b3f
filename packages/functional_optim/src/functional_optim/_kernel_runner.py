"""Where a step's list kernel runs: in place, or on fresh copies of what it writes.

Every fused step ends in one call of a kernel over flat lists (``kernels.adam(params, grads,
exp_avgs, ...)``): it reads the gradients and writes the params and the state lists in place.
The caller names each argument's :data:`Role` and calls :func:`run_kernel`. Normally that is
``kernel(*args)``. Inside :func:`running_with` (what ``fo.pure_step`` does) the installed
:class:`Runner` gets the call instead, and gives the kernel copies to write, so that the same
kernel, in the same order, makes new params and state and leaves its inputs alone
(:mod:`functional_optim._pure_flat`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, Protocol

import torch

__all__ = ["Role", "Runner", "run_kernel", "running_with"]

#: What a kernel does with an argument: ``"write"`` a list of param-shaped tensors it updates
#: in place (the params, a moment), ``"count"`` a list of 0-d counters it updates, ``"other"``
#: any other list it updates (factored moments), ``"read"`` a list it only reads (gradients),
#: None anything that is not a per-leaf list (a hyperparameter).
Role = Literal["write", "count", "other", "read"] | None


class Runner(Protocol):
    """Runs ``kernel(*args)`` so that the lists it writes are new tensors."""

    def __call__(
        self, kernel: Callable[..., None], args: list[Any], roles: Sequence[Role]
    ) -> None: ...


_RUNNER: ContextVar[Runner | None] = ContextVar("functional_optim_kernel_runner", default=None)


def run_kernel(kernel: Callable[..., None], args: list[Any], roles: Sequence[Role]) -> None:
    """``kernel(*args)``, or the installed runner's version of it (see the module docstring).

    Args:
        kernel: the list kernel.
        args: its arguments, in order.
        roles: the role of each argument (:data:`Role`).
    """
    runner = None if torch.compiler.is_compiling() else _RUNNER.get()
    if runner is None:
        kernel(*args)
    else:
        runner(kernel, args, roles)


@contextmanager
def running_with(runner: Runner) -> Iterator[None]:
    """Route :func:`run_kernel` calls to ``runner`` in this context (this thread or task)."""
    token = _RUNNER.set(runner)
    try:
        yield
    finally:
        _RUNNER.reset(token)
