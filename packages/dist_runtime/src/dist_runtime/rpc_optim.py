"""RPC plumbing for a distributed optimizer: local optimizers on the parameters' owners.

Caller side (the trainer): :func:`create_remote_optimizers` groups parameter RRefs by owner and
builds one local optimizer per owner over RPC; :func:`step_remote_optimizers` asks every owner to
apply one distributed-autograd context's gradients and waits for all of them, raising once every
future has settled with every failure in the message.

Owner side (runs on RPC threads): a local optimizer is either a scripted
:class:`~dist_runtime._script_local_optimizer.ScriptLocalOptimizerModule` around a functional
optimizer (its step runs without the GIL) or an eager ``torch.optim.Optimizer`` fed through
``param.grad``. Both hold the per-parameter-set locks of :mod:`dist_runtime._param_locks`, taken in
Python around the step, so concurrent trainers never lose an update or tear a parameter while
trainers on disjoint parameters still overlap. Parameters on CUDA are supported: the step waits
for the device before reading gradients and finishes its kernels before answering, so the caller
never observes a half-applied update.

Steps are addressed by a small integer handle rather than by RRef: sending a UserRRef back to its
owner costs extra fork/ack messages on every step. Each owner keeps its local optimizers in a
registry by handle until the caller releases them (:func:`release_remote_optimizers`, which the
``DistributedOptimizer`` calls when it is garbage-collected). The registry holds them itself:
left to the RRef returned by :func:`create_remote_optimizers`, the local optimizer was freed
before its first step with CUDA parameters and device maps (torch 2.11, H200).
"""

from __future__ import annotations

import inspect
import itertools
import threading
import warnings
import weakref
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch._C._distributed_rpc import WorkerInfo
from torch._jit_internal import _qualified_name, createResolutionCallbackForClassMethods
from torch.jit._recursive import _compile_and_register_class
from torch.jit._state import _get_script_class

from dist_runtime._param_locks import ParamLockRegistry, ParamLockSet
from dist_runtime._script_local_optimizer import ScriptLocalOptimizerModule

__all__ = [
    "LocalOptimizer",
    "compile_class",
    "RemoteOptimizer",
    "ScriptLocalOptimizer",
    "create_remote_optimizers",
    "new_local_optimizer",
    "param_locks",
    "script_quietly",
    "step_local_optimizer",
    "step_remote_optimizers",
    "step_stats",
    "wait_all",
]

#: The process-wide registry of parameter locks used by every local optimizer on this worker.
param_locks = ParamLockRegistry()

# TorchScript cannot compile concurrently, and RPC threads may build optimizers concurrently.
_COMPILE_LOCK = threading.Lock()
_SCRIPT_DEPRECATION = r"`torch\.jit\.script` is deprecated"

_handles = itertools.count(1)
_local_optimizers: dict[int, _LocalOptimizerBase] = {}
_registry_lock = threading.Lock()


class _StepStats:
    """Counts steps in flight on this worker (to prove that disjoint steps overlap)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.completed = 0

    def enter(self) -> None:
        with self._mutex:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def exit(self) -> None:
        with self._mutex:
            self.active -= 1
            self.completed += 1

    def snapshot(self, reset: bool) -> dict[str, int]:
        with self._mutex:
            snap = {
                "active": self.active,
                "max_active": self.max_active,
                "completed": self.completed,
            }
            if reset:
                self.max_active = self.active
                self.completed = 0
            return snap


_stats = _StepStats()


def step_stats(reset: bool = False) -> dict[str, int]:
    """This worker's step counters: ``active``, ``max_active`` (peak overlap) and ``completed``.

    Args:
        reset: start a new measurement window after reading.
    """
    return _stats.snapshot(reset)


def script_quietly(obj: Any) -> Any:
    """``torch.jit.script(obj)`` under the compile lock, without torch's deprecation warning."""
    with _COMPILE_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCRIPT_DEPRECATION, category=DeprecationWarning)
        return torch.jit.script(obj)


def compile_class(cls: type) -> None:
    """Compile a functional optimizer class for TorchScript once, resolving names in its module.

    Scripting a module whose attribute is an instance of an uncompiled class hides the class's
    compile error behind "failed to convert Python type"; compiling it first reports the error.

    Raises:
        RuntimeError: if the class cannot be compiled, with TorchScript's reason.
    """
    with _COMPILE_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SCRIPT_DEPRECATION, category=DeprecationWarning)
        if _get_script_class(cls) is not None:  # type: ignore[no-untyped-call]
            return
        try:
            # Our functional classes compile themselves in a static hook (see functional_optim).
            hook = inspect.getattr_static(cls, "__prepare_scriptable__", None)
            if isinstance(hook, staticmethod | classmethod):
                cls.__prepare_scriptable__()  # type: ignore[attr-defined]
            if _get_script_class(cls) is None:  # type: ignore[no-untyped-call]
                rcb = createResolutionCallbackForClassMethods(cls)
                _compile_and_register_class(cls, rcb, _qualified_name(cls))  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise RuntimeError(
                f"{cls.__module__}.{cls.__qualname__} cannot be compiled with TorchScript, which "
                "the distributed optimizer needs for a class registered in functional_optim_map "
                "(see examples/qhm_optimizer.py for a scriptable optimizer). TorchScript says:\n"
                f"{exc}"
            ) from exc


class _LocalOptimizerBase(ABC):
    """An optimizer over one worker's share of the parameters, guarded by their locks."""

    def __init__(self, params: list[Tensor]) -> None:
        self._params = params
        self._cuda_devices = sorted(
            {param.device for param in params if param.is_cuda}, key=lambda d: d.index or 0
        )
        self._locks: ParamLockSet = param_locks.register(params)
        weakref.finalize(self, self._locks.close)

    @property
    def lock_ranks(self) -> tuple[int, ...]:
        """Ranks of the locks this optimizer takes (equal ranks = serialised)."""
        return self._locks.ranks

    def step(self, autograd_ctx_id: int) -> None:
        """Apply the gradients of ``autograd_ctx_id`` while holding the parameters' locks."""
        with self._locks:
            _stats.enter()
            try:
                self._sync_devices()
                self._step_locked(autograd_ctx_id)
                self._sync_devices()
            finally:
                _stats.exit()

    def _sync_devices(self) -> None:
        for device in self._cuda_devices:
            torch.cuda.synchronize(device)

    @abstractmethod
    def _step_locked(self, autograd_ctx_id: int) -> None:
        """Apply the gradients of ``autograd_ctx_id``; the caller holds the locks."""


class LocalOptimizer(_LocalOptimizerBase):
    """An eager ``torch.optim.Optimizer`` fed with a context's gradients through ``.grad``.

    Parameters without a gradient in the context get ``grad = None`` and are skipped, as on the
    TorchScript path (torch's eager path would re-apply a stale ``.grad`` from an earlier step).

    Args:
        optim_cls: the optimizer class, called as ``optim_cls(params, *args, **kwargs)``.
        params: the local parameters.
        args: positional constructor arguments after ``params``.
        kwargs: keyword constructor arguments.
    """

    def __init__(
        self,
        optim_cls: Any,
        params: list[Tensor],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.optim = optim_cls(params, *args, **(kwargs or {}))
        super().__init__(params)

    def _step_locked(self, autograd_ctx_id: int) -> None:
        grads = dist_autograd.get_gradients(autograd_ctx_id)  # type: ignore[attr-defined]
        for param in self._params:
            param.grad = grads.get(param)
        self.optim.step()


class ScriptLocalOptimizer(_LocalOptimizerBase):
    """A functional optimizer scripted with its parameters; its step runs without the GIL.

    Args:
        optim_cls: a TorchScript-compatible functional optimizer class.
        params: the local parameters.
        args: positional constructor arguments after ``params``.
        kwargs: keyword constructor arguments.
    """

    def __init__(
        self,
        optim_cls: Any,
        params: list[Tensor],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        compile_class(optim_cls)
        module = ScriptLocalOptimizerModule(optim_cls, params, tuple(args), dict(kwargs or {}))
        self.module = script_quietly(module)
        super().__init__(params)

    def _step_locked(self, autograd_ctx_id: int) -> None:
        self.module.step(autograd_ctx_id)


def new_local_optimizer(
    scripted: bool,
    optim_cls: Any,
    param_rrefs: Sequence[rpc.RRef[Any]],
    /,
    *args: Any,
    **kwargs: Any,
) -> tuple[rpc.RRef[Any], int]:
    """Build a local optimizer over this worker's ``param_rrefs`` (runs on the owner via RPC).

    Args:
        scripted: wrap ``optim_cls`` (a functional optimizer) in a scripted module; else build an
            eager ``torch.optim.Optimizer``.
        optim_cls: the class to instantiate.
        param_rrefs: RRefs owned by this worker.
        args: positional constructor arguments after the parameters.
        kwargs: keyword constructor arguments.

    Returns:
        An RRef that owns the local optimizer, and the handle that :func:`step_local_optimizer`
        takes.
    """
    params = [rref.local_value() for rref in param_rrefs]
    local: _LocalOptimizerBase
    if scripted:
        local = ScriptLocalOptimizer(optim_cls, params, args, kwargs)
    else:
        local = LocalOptimizer(optim_cls, params, args, kwargs)
    with _registry_lock:
        handle = next(_handles)
        _local_optimizers[handle] = local
    return rpc.RRef(local), handle


def release_local_optimizer(handle: int) -> None:
    """Drop this worker's local optimizer ``handle`` (runs on the owner via RPC; idempotent)."""
    with _registry_lock:
        _local_optimizers.pop(handle, None)


def step_local_optimizer(handle: int, autograd_ctx_id: int) -> None:
    """Run one step of the local optimizer ``handle`` (runs on the owner via RPC).

    Raises:
        RuntimeError: if the local optimizer no longer exists on this worker.
    """
    with _registry_lock:
        local = _local_optimizers.get(handle)
    if local is None:
        raise RuntimeError(
            f"no local optimizer with handle {handle} on {rpc.get_worker_info().name}: its "
            "DistributedOptimizer was garbage-collected or this worker restarted; build a new one"
        )
    local.step(autograd_ctx_id)


class RemoteOptimizer(NamedTuple):
    """A local optimizer living on ``owner``: the RRef that owns it and its step handle."""

    rref: rpc.RRef[Any]
    handle: int
    owner: WorkerInfo


def _describe(owner: Any) -> str:
    name = getattr(owner, "name", None)
    return str(name) if name is not None else str(owner)


def _retyped(exc: BaseException, message: str) -> BaseException:
    """``type(exc)(message)`` when that type can be built from one message, else RuntimeError."""
    try:
        new = type(exc)(message)
    except Exception:  # an exception type with a different constructor
        new = RuntimeError(message)
    if str(new) != message:
        new = RuntimeError(message)
    new.__cause__ = exc
    return new


def _with_owner(owner: Any, exc: BaseException, what: str) -> BaseException:
    """Name the worker in transport failures; remote errors already say "On WorkerInfo(...)"."""
    if "On WorkerInfo(" in str(exc):
        return exc
    name = _describe(owner)
    return _retyped(
        exc,
        f"RPC to {name} for {what} failed: {exc}. If {name} has shut down or crashed, the "
        "parameters it owned are gone: rebuild the model and the DistributedOptimizer.",
    )


def _combine(failures: Sequence[tuple[Any, BaseException]], total: int) -> BaseException:
    if len(failures) == 1:
        return failures[0][1]
    lines = [f"{len(failures)} of {total} workers failed:"]
    for owner, exc in failures:
        lines.append(f"--- {_describe(owner)}: {type(exc).__name__} ---\n{exc}")
    message = "\n".join(lines)
    kinds = {type(exc) for _, exc in failures}
    if len(kinds) == 1:
        return _retyped(failures[-1][1], message)
    combined = RuntimeError(message)
    combined.__cause__ = failures[-1][1]
    return combined


def wait_all(
    futures: Sequence[torch.futures.Future[Any]], owners: Sequence[Any], what: str = "a call"
) -> list[Any]:
    """Wait for every future; then raise if any failed.

    Unlike torch (which raises only the last failure), a single failure is re-raised and several
    failures are raised together: one exception listing every worker's error, of the failures'
    common type when they share one (else ``RuntimeError``), chained to the last one. Failures
    of the transport (worker gone, timeout), whose messages do not say which worker they concern,
    are re-raised with the worker's name.

    Args:
        futures: one future per owner.
        owners: the worker each future runs on (for the message).
        what: what the calls do, for transport-failure messages.

    Returns:
        The futures' values, in order.
    """
    results: list[Any] = []
    failures: list[tuple[Any, BaseException]] = []
    for owner, fut in zip(owners, futures, strict=True):
        try:
            results.append(fut.wait())
        except Exception as exc:
            results.append(exc)
            failures.append((owner, _with_owner(owner, exc, what)))
    if failures:
        raise _combine(failures, len(futures))
    return results


def create_remote_optimizers(
    optim_ctor: Any,
    params_rref: Iterable[rpc.RRef[Any]],
    scripted: bool,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> list[RemoteOptimizer]:
    """Build one local optimizer per owner of ``params_rref``, concurrently.

    Args:
        optim_ctor: the class to instantiate on each owner.
        params_rref: RRefs to the parameters (any owners, the caller included).
        scripted: whether ``optim_ctor`` is a functional optimizer to script.
        args: positional constructor arguments after the parameters.
        kwargs: keyword constructor arguments.

    Returns:
        One :class:`RemoteOptimizer` per owner, in first-seen owner order.

    Raises:
        Exception: every constructor failure, after all owners have answered.
    """
    per_owner: defaultdict[WorkerInfo, list[rpc.RRef[Any]]] = defaultdict(list)
    for rref in params_rref:
        per_owner[rref.owner()].append(rref)
    owners = list(per_owner)
    futures = [
        rpc.rpc_async(
            owner,
            new_local_optimizer,
            args=(scripted, optim_ctor, per_owner[owner], *args),
            kwargs=dict(kwargs or {}),
        )
        for owner in owners
    ]
    results = wait_all(futures, owners, "creating the local optimizer")
    return [
        RemoteOptimizer(rref, handle, owner)
        for owner, (rref, handle) in zip(owners, results, strict=True)
    ]


def step_remote_optimizers(remotes: Sequence[RemoteOptimizer], autograd_ctx_id: int) -> None:
    """Step every remote optimizer with the gradients of ``autograd_ctx_id``; block until done.

    Raises:
        RuntimeError: torch's message if ``autograd_ctx_id`` is not a live context here.
        Exception: every worker's failure, after all workers have answered.
    """
    dist_autograd._is_valid_context(autograd_ctx_id)  # type: ignore[attr-defined]
    futures = [
        rpc.rpc_async(remote.owner, step_local_optimizer, args=(remote.handle, autograd_ctx_id))
        for remote in remotes
    ]
    wait_all(futures, [remote.owner for remote in remotes], "the optimizer step")


def release_remote_optimizers(remotes: Sequence[RemoteOptimizer]) -> None:
    """Ask every owner to drop its local optimizer, without waiting (a garbage-collection hook).

    Once RPC is shut down the owners' registries are gone with their processes: nothing to do.
    """
    for remote in remotes:
        try:
            rpc.rpc_async(remote.owner, release_local_optimizer, args=(remote.handle,))
        except RuntimeError:  # RPC not initialised (any more) on this worker
            return
