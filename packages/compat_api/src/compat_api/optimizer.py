"""Drop-in for ``torch.distributed.optim.DistributedOptimizer`` (torch 2.13).

Same constructor, attributes (``remote_optimizers``, ``is_functional_optim``), warning and errors
as torch. Differences, all in the direction of safety:

* Concurrent ``step`` calls are serialised per parameter set on every worker, on the TorchScript
  path too (torch takes no lock there and loses updates), and steps on disjoint parameters of one
  worker run concurrently (torch's eager path takes one global lock).
* When several workers fail, the error lists every failure (torch raises only the last one).
* Parameters on CUDA work when the RPC device maps are set.
* On the eager path a parameter without a gradient in the context is skipped, as on the
  TorchScript path (torch's eager path would re-apply its stale ``.grad``).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, ClassVar

import torch
from torch.distributed.rpc import RRef

from compat_api.utils import functional_optim_map
from dist_runtime.rpc_optim import (
    RemoteOptimizer,
    create_remote_optimizers,
    release_remote_optimizers,
    step_remote_optimizers,
)

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger(__name__)


def _jit_enabled() -> bool:
    return bool(torch.jit._state._enabled)


class DistributedOptimizer:
    """Apply an optimizer, on every worker, to the parameters that live there.

    Takes RRefs to parameters scattered across workers; builds one local optimizer per owning
    worker; :meth:`step` applies one ``torch.distributed.autograd`` context's gradients
    (retrieved with :func:`torch.distributed.autograd.get_gradients`) on every worker.

    When ``optimizer_class`` has a functional counterpart in :attr:`functional_optim_map` and
    TorchScript is enabled, the local optimizers are TorchScript modules, so that updates are not
    blocked by the GIL in multithreaded training. Register your own optimizer with
    :func:`compat_api.utils.register_functional_optim` (recipe: ``examples/qhm_optimizer.py``).

    Concurrent :meth:`step` calls, from one or several trainers, are serialised on each worker
    for each set of parameters; there is no guarantee that a trainer's forward, backward and step
    run without another trainer's step in between, nor any ordering across workers.

    Args:
        optimizer_class (optim.Optimizer): the class of optimizer to instantiate on each worker.
        params_rref (list[RRef]): RRefs to the local or remote parameters to optimize.
        args: positional arguments for the optimizer constructor on each worker.
        kwargs: keyword arguments for the optimizer constructor on each worker.

    Raises:
        Exception: the constructor's error if it fails on any worker (every failure is listed).

    Example::

        >>> # xdoctest: +SKIP("distributed")
        >>> with dist_autograd.context() as context_id:
        ...     rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        ...     rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        ...     loss = rref1.to_here() + rref2.to_here()
        ...     dist_autograd.backward(context_id, [loss.sum()])
        ...     dist_optim = DistributedOptimizer(optim.SGD, [rref1, rref2], lr=0.05)
        ...     dist_optim.step(context_id)
    """

    #: The same dict as :data:`compat_api.utils.functional_optim_map`.
    functional_optim_map: ClassVar[dict[Any, type]] = functional_optim_map

    def __init__(
        self, optimizer_class: Any, params_rref: list[RRef[Any]], *args: Any, **kwargs: Any
    ) -> None:
        if optimizer_class in self.functional_optim_map and _jit_enabled():
            optim_ctor = self.functional_optim_map[optimizer_class]
        else:
            optim_ctor = optimizer_class
        self.is_functional_optim = optim_ctor != optimizer_class
        if not self.is_functional_optim:
            logger.warning(
                "Creating the optimizer %s without TorchScript support, "
                "this might result in slow computation time in multithreading environment"
                "(i.e. Distributed Model Parallel training on CPU) due to the Python's "
                "Global Interpreter Lock (GIL). Please file an issue if you need this "
                "optimizer in TorchScript. ",
                optimizer_class,
            )
        self._remotes: list[RemoteOptimizer] = create_remote_optimizers(
            optim_ctor, params_rref, self.is_functional_optim, args, kwargs
        )
        self.remote_optimizers: list[RRef[Any]] = [remote.rref for remote in self._remotes]
        # The owners hold the local optimizers until this object is garbage-collected; not at
        # interpreter exit (RPC is shut down by then, and the owners' registries with it).
        release = weakref.finalize(self, release_remote_optimizers, list(self._remotes))
        release.atexit = False

    def step(self, context_id: int) -> None:
        """Perform a single optimization step on every worker; block until all return.

        Args:
            context_id: the autograd context id whose gradients to apply.

        Raises:
            RuntimeError: if ``context_id`` is not a valid autograd context on this worker.
            Exception: the step's error on any worker, after all workers have answered.
        """
        step_remote_optimizers(self._remotes, context_id)
