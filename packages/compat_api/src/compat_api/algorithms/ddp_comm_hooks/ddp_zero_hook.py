"""Drop-in ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook`` (torch 2.13).

:func:`hook_with_zero_step` and :func:`hook_with_zero_step_interleaved` wrap a DDP comm hook so
that a :class:`~compat_api.zero_redundancy_optimizer.ZeroRedundancyOptimizer` built with
``overlap_with_ddp=True`` runs its step inside DDP's backward pass: each bucket's parameters are
updated by the rank(s) they are assigned to, with the local functional optimizer, and broadcast
back bucket by bucket. The state machine lives in :mod:`compat_api._zero.overlap`.

Unlike torch, these hooks also run on gloo (torch refuses it: pytorch issue 62300). torch's
interleaved hook issues each bucket's broadcasts from the all-reduce future's callback, so the
position of a broadcast among the all-reduces depends on timing and differs between ranks; gloo
matches collectives by issue order and fails ("Received data size doesn't match expected size")
or hangs. Here every collective is issued from the backward thread in a fixed order that is the
same on every rank; only the optimizer computation runs in the future callbacks:

- :func:`hook_with_zero_step`: all-reduces ``0..n-1``, then, after the last bucket, step and
  broadcast each bucket in index order (torch's order);
- :func:`hook_with_zero_step_interleaved`: bucket ``i``'s step runs in its all-reduce future's
  callback as soon as the all-reduce completes (interleaved with the backward computation);
  the broadcasts are issued after the last bucket's all-reduce, in bucket order, each once its
  step is done: ``ar0, ..., ar(n-1), bc0, ..., bc(n-1)``. (Issuing bucket ``i``'s broadcast
  from bucket ``i + 1``'s hook call also keeps the order fixed, but stalls the backward pass on
  every bucket's all-reduce: 1.4x slower on two CPU ranks.)

The hooks' annotations are real objects (no ``from __future__ import annotations``): DDP's
``register_comm_hook`` compares them with ``GradBucket`` and ``Future[Tensor]``.

Every broadcast is waited on (with the process group's timeout) before the last bucket's hook
returns, so the next forward pass sees the updated parameters.

A collective that fails (a dead or hung peer) raises
:class:`~dist_runtime.collective_failure.CollectiveFailedError` naming the failed rank from the
hook, so from ``backward()``. With ``ZeroRedundancyOptimizer.undo_step_on_failure`` the
iteration is snapshotted at bucket 0 (before any step) and, on failure, restored once its steps
and broadcasts still in flight are done (:meth:`OverlapController.guarded`).
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from compat_api._zero.overlap_control import OverlapController, overlap_controller

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

Hook = Callable[[Any, GradBucket], torch.futures.Future[Any]]


def _check_join_order(zero: Any) -> None:
    """Refuse ``Join([zero, ddp])``: ZeRO's per-iteration join all-reduce would run mid-backward.

    torch calls ``Join.notify_join_context`` from every bucket's step, which only communicates
    for the first joinable; with ZeRO first its all-reduce lands among DDP's and the ranks hang.
    """
    config = getattr(zero, "_join_config", None)
    if config is not None and config.enable and config.is_first_joinable:
        raise RuntimeError(
            "With `overlap_with_ddp=True` the DistributedDataParallel module must come before "
            "the ZeroRedundancyOptimizer in Join (e.g. `Join([ddp, zero])`): ZeRO's step runs "
            "inside DDP's backward pass"
        )


def _advance(
    controller: OverlapController,
    ddp_ref: weakref.ReferenceType[DistributedDataParallel],
    bucket: GradBucket,
) -> int | None:
    """Warm-up; once ZeRO is initialised, the bucket's index (else None).

    At bucket 0 of an iteration this also snapshots what the iteration's steps will write, when
    ZeRO undoes failed steps: before the bucket's all-reduce is issued (and so before any step).
    """
    ddp = ddp_ref()
    controller.setup(ddp is not None and bool(ddp._has_rebuilt_buckets), bucket)
    if not controller.initialized:
        return None
    index: int = bucket.index()
    if index == 0:
        _check_join_order(controller.zero)
        controller.begin_iteration()
    return index


def _controller(zero: Any, shard_buckets: bool) -> OverlapController:
    controller = overlap_controller(zero)
    if shard_buckets:
        controller.shard_buckets()
    return controller


def hook_with_zero_step(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: Any,
    shard_buckets: bool = False,
) -> Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]:
    r"""Wrap ``hook`` so that ZeRO's step follows the last bucket's all-reduce in backward.

    The backward computation runs uninterrupted; after the last bucket has been handed to
    ``hook``, each bucket (in index order) waits for its all-reduce, is updated by its assigned
    rank(s) and broadcast, overlapping with the all-reduces still in flight. Prefer it over
    :func:`hook_with_zero_step_interleaved` when communication is slow relative to computation.

    Args:
        hook: the comm hook to wrap, e.g. ``default_hooks.allreduce_hook``.
        ddp: the DistributedDataParallel module the hook is registered on.
        zero: a ZeroRedundancyOptimizer built with ``overlap_with_ddp=True`` over ``ddp``'s
            parameters (one param group).
        shard_buckets: slice each bucket over several ranks for balance (else each bucket goes
            whole to one rank).

    Returns:
        The hook to pass to ``ddp.register_comm_hook``.

    Raises:
        ValueError: if ``zero`` was built with ``overlap_with_ddp=False`` (torch's message).

    .. warning:: The first two iterations (three with ``static_graph=True``) do not update the
        parameters: DDP's bucketing is final only then, as in torch.

    Example::

        >>> # xdoctest: +SKIP("needs a process group")
        >>> zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam,
        ...                                overlap_with_ddp=True, lr=1e-3)
        >>> ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        >>> for x in batches:
        ...     ddp(x).sum().backward()   # no zero.step()
    """
    controller = _controller(zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if _advance(controller, ddp_ref, bucket) is None:
            return hook(state, bucket)
        with controller.guarded():
            fut = hook(state, bucket)
            if controller.record(bucket, fut) != controller.num_buckets - 1:
                return fut
            info = controller.info
            # Not chained on the last all-reduce: the earlier buckets' steps need not wait for it.
            for j in range(controller.num_buckets):
                if controller.updates_here(j):
                    reduced = info.bucket_index_to_future[j].wait()
                    controller.bucket_step(info.bucket_index_to_bucket[j], reduced)
                controller.broadcast_bucket(j)
            controller.finish_iteration()
        return fut

    return hook_with_zero_fn


def _step_in_callback(
    controller: OverlapController, bucket: Any, fut: torch.futures.Future[Any]
) -> torch.Tensor:
    """Future callback: update this rank's share of ``bucket`` once its all-reduce is done."""
    controller.bucket_step(bucket, fut.value())
    buffer: torch.Tensor = bucket.buffer()
    return buffer


def _sync_bucket(controller: OverlapController, index: int) -> None:
    """Wait for this rank's step of bucket ``index`` (if assigned), then issue its broadcasts."""
    if controller.updates_here(index):
        controller.info.bucket_index_to_future[index].wait()
    controller.broadcast_bucket(index)


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: Any,
    shard_buckets: bool = False,
) -> Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]:
    r"""Wrap ``hook`` so that each bucket's ZeRO step starts as soon as its all-reduce completes.

    The optimizer computation of bucket ``i`` runs in the all-reduce future's callback,
    interleaved with the backward computation and the other buckets' communication; the
    broadcasts follow the last bucket's all-reduce, in bucket order (the fixed order that keeps
    gloo in step, see the module notes). Prefer it over :func:`hook_with_zero_step` when
    communication is fast relative to computation.

    Args:
        hook: the comm hook to wrap, e.g. ``default_hooks.allreduce_hook``.
        ddp: the DistributedDataParallel module the hook is registered on.
        zero: a ZeroRedundancyOptimizer built with ``overlap_with_ddp=True`` over ``ddp``'s
            parameters (one param group).
        shard_buckets: slice each bucket over several ranks for balance (else each bucket goes
            whole to one rank).

    Returns:
        The hook to pass to ``ddp.register_comm_hook``.

    Raises:
        ValueError: if ``zero`` was built with ``overlap_with_ddp=False`` (torch's message).

    .. warning:: The first two iterations (three with ``static_graph=True``) do not update the
        parameters, as in torch.
    """
    controller = _controller(zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)

    def hook_with_zero_interleaved_fn(
        state: Any, bucket: GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        if _advance(controller, ddp_ref, bucket) is None:
            return hook(state, bucket)
        with controller.guarded():
            fut = hook(state, bucket)
            index = controller.record(bucket, fut)
            if controller.updates_here(index):
                fut = fut.then(functools.partial(_step_in_callback, controller, bucket))
                controller.info.bucket_index_to_future[index] = fut
            if index == controller.num_buckets - 1:
                for j in range(controller.num_buckets):
                    _sync_bucket(controller, j)
                controller.finish_iteration()
        return fut

    return hook_with_zero_interleaved_fn
