"""ZeroRedundancyOptimizer's ``overlap_with_ddp=True`` mode: the state machine behind the DDP hooks.

With ``overlap_with_ddp=True`` the ZeRO step is not run by :meth:`step` but by a DDP comm hook
(:mod:`compat_api.algorithms.ddp_comm_hooks.ddp_zero_hook`): each DDP gradient bucket is assigned
to one rank (or, with ``shard_buckets``, sliced over several), that rank updates the bucket's
parameters with a functional optimizer once the bucket's all-reduce is done, and the updated
parameters are broadcast back per bucket. Until DDP has finalised its buckets the hooks only
all-reduce (torch's warm-up: 2 iterations, 3 with ``static_graph=True``), then :func:`init_overlap`
builds everything at the start of the next backward pass.

Pieces, in the order they are used:

- :class:`OverlapStatus` and :class:`OverlapInfo`: torch's ``_OverlapStatus`` / ``_OverlapInfo``
  (same attribute names, used by torch's own tests);
- :func:`init_overlap`: apply the bucket plan (:func:`dist_runtime.ddp_bucket_plan.
  plan_bucket_assignments`, a pure function), flatten each assignment into one tensor (one
  broadcast each), build the local functional optimizer (:mod:`compat_api._zero.functional`);
- :func:`bucket_step` / :func:`local_step` and :func:`broadcast_bucket`: the per-bucket step
  and sync;
- the DDP hooks' controller and the mode's strategy: :mod:`compat_api._zero.overlap_control`.
"""

from __future__ import annotations

import enum
import logging
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import DebugLevel, GradBucket, get_debug_level

from compat_api._zero.functional import (
    build_functional_optimizer,
    sync_hyperparameters,
)
from compat_api._zero.layout import sync_param_groups
from compat_api._zero.step_guard import StepGuard
from compat_api._zero.strategy import ZeroContext
from dist_runtime.buckets import flatten_into_bucket
from dist_runtime.ddp_bucket_plan import BucketSlice, plan_bucket_assignments
from dist_runtime.param_sync import Waitable

__all__ = [
    "BucketSlice",
    "DDPBucketAssignment",
    "OverlapInfo",
    "OverlapStatus",
    "OverlapZero",
    "broadcast_bucket",
    "bucket_step",
    "init_overlap",
    "local_step",
    "plan_bucket_assignments",
    "save_bucket_info",
]

logger = logging.getLogger(__name__)


class OverlapStatus(enum.IntEnum):
    """Where a ZeRO instance with ``overlap_with_ddp=True`` stands (torch's ``_OverlapStatus``).

    ``UNINITIALIZED``: waiting for DDP to finalise (rebuild) its buckets.
    ``DDP_HAS_REBUILT_BUCKETS``: DDP's buckets are final; the hook records them for a pass.
    ``INITIALIZED``: the local optimizer exists and every backward pass updates parameters.
    """

    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


class DDPBucketAssignment:
    """The parameters of one DDP bucket that one rank updates (torch's ``_DDPBucketAssignment``).

    Args:
        bucket_index: the DDP bucket's index.
        parameters: a contiguous run of the bucket's parameters.
        offset: index of ``parameters[0]`` in the bucket's parameter (and gradient) list.

    Attributes:
        device: the parameters' device.
        tensor: the flat tensor the parameters are views of (set by :func:`init_overlap`); one
            broadcast of it syncs the whole assignment.

    Raises:
        ValueError: if ``parameters`` is empty (torch's message).
    """

    def __init__(self, bucket_index: int, parameters: list[torch.Tensor], offset: int) -> None:
        self.bucket_index = bucket_index
        self.parameters = parameters
        self.offset = offset
        if len(self.parameters) == 0:
            raise ValueError("Empty bucket assignment")
        self.device: torch.device = self.parameters[0].device
        self.tensor: torch.Tensor | None = None


class OverlapInfo:
    """What ZeRO needs to overlap with DDP (torch's ``_OverlapInfo``, same attributes).

    Args:
        world_size: the size of the process group.

    Attributes:
        status: see :class:`OverlapStatus`.
        shard_buckets: set by the hook constructor; slice buckets over ranks.
        params_per_bucket: the parameters of each DDP bucket, recorded during one backward pass.
        params_per_rank: the parameters each rank updates, in assignment order (the partition
            handed to ZeRO).
        offsets: ``{bucket_index: index of its first parameter in this rank's local list}``
            for the buckets assigned to this rank.
        assigned_ranks_per_bucket: the ranks updating (part of) each bucket.
        num_bucket_assignments: the number of (bucket, rank) assignments over all ranks.
        total_size: sum of ``numel()`` over all buckets when ``shard_buckets``, else None.
        bucket_assignments_per_rank: ``[rank]{bucket_index: DDPBucketAssignment}``.
        broadcast_handles: the broadcasts issued this iteration.
        bucket_indices_seen: the buckets seen by the hook this iteration, in order.
        bucket_index_to_future: the all-reduce futures of this iteration's buckets.
        bucket_index_to_bucket: this iteration's buckets.
        broadcast_timeout: how long to wait on one broadcast (None: the process group's timeout).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.status = OverlapStatus.UNINITIALIZED
        self.shard_buckets = False
        self.params_per_bucket: list[list[torch.Tensor]] = []
        self.params_per_rank: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        self.offsets: dict[int, int] = {}
        self.assigned_ranks_per_bucket: list[set[int]] = []
        self.num_bucket_assignments = 0
        self.total_size: int | None = None
        self.bucket_assignments_per_rank: list[dict[int, DDPBucketAssignment]] = []
        self.broadcast_handles: list[Waitable] = []
        self.bucket_indices_seen: list[int] = []
        self.bucket_index_to_future: dict[int, torch.futures.Future[Any]] = {}
        self.bucket_index_to_bucket: dict[int, GradBucket] = {}
        self.broadcast_timeout: timedelta | None = None

    def wait_for_broadcasts(self) -> None:
        """Wait for every broadcast of this iteration, then forget them.

        Raises:
            AssertionError: if a bucket's broadcast was never issued (torch's check).
        """
        if len(self.broadcast_handles) != self.num_bucket_assignments:
            raise AssertionError(f"Missing at least one broadcast handle on rank {dist.get_rank()}")
        for handle in self.broadcast_handles:
            if self.broadcast_timeout is None:
                handle.wait()
            else:
                handle.wait(self.broadcast_timeout)  # type: ignore[call-arg]
        self.broadcast_handles.clear()

    def clear_per_iter_info(self) -> None:
        """Forget this iteration's buckets and futures (end of an iteration)."""
        self.bucket_indices_seen.clear()
        self.bucket_index_to_future.clear()
        self.bucket_index_to_bucket.clear()


class OverlapZero(ZeroContext, Protocol):
    """What the overlap mode needs from ZeroRedundancyOptimizer beyond :class:`ZeroContext`."""

    _is_trainable_mask: list[bool]
    _step_guard: StepGuard
    undo_step_on_failure: bool

    def _clear_cache(self) -> None: ...

    def _partition_parameters(
        self, params_per_rank: list[list[torch.Tensor]] | None = None
    ) -> list[list[dict[str, Any]]]: ...

    def _get_is_trainable_mask(self) -> list[bool]: ...


# -- set-up ----------------------------------------------------------------------------------------


def save_bucket_info(info: OverlapInfo, bucket: GradBucket) -> None:
    """Record one DDP bucket's parameters (and, with ``shard_buckets``, its size).

    Raises:
        AssertionError: for an empty bucket (torch's check).
    """
    params = bucket.parameters()
    if len(params) <= 0:
        raise AssertionError("Empty bucket")
    info.params_per_bucket.append(params)
    if info.shard_buckets:
        if info.total_size is None:
            raise AssertionError
        info.total_size += sum(p.numel() for p in params)


def init_overlap(zero: OverlapZero, info: OverlapInfo) -> None:
    """The delayed initialisation (torch's ``_init_zero_for_overlap``).

    Plans the bucket assignments from the recorded DDP buckets, partitions the parameters
    accordingly, flattens each assignment's parameters into one tensor (parameters become views
    of it) and builds the local functional optimizer over this rank's parameters.

    Raises:
        AssertionError: if a bucket parameter does not require a gradient (torch's check).
        ValueError: if a DDP bucket holds a parameter ZeRO was not built with.
    """
    info.status = OverlapStatus.INITIALIZED
    zero._clear_cache()
    info.params_per_rank = [[] for _ in range(zero.world_size)]
    info.offsets.clear()
    info.assigned_ranks_per_bucket = [set() for _ in info.params_per_bucket]
    info.num_bucket_assignments = 0
    info.bucket_assignments_per_rank = [{} for _ in range(zero.world_size)]
    sizes = [[p.numel() for p in params] for params in info.params_per_bucket]
    for piece in plan_bucket_assignments(sizes, zero.world_size, info.shard_buckets):
        params = info.params_per_bucket[piece.bucket_index][piece.start : piece.stop]
        assignment = DDPBucketAssignment(piece.bucket_index, params, piece.start)
        info.bucket_assignments_per_rank[piece.rank][piece.bucket_index] = assignment
        if piece.rank == zero.rank:
            info.offsets[piece.bucket_index] = len(info.params_per_rank[piece.rank])
        info.params_per_rank[piece.rank].extend(params)
        info.assigned_ranks_per_bucket[piece.bucket_index].add(piece.rank)
        info.num_bucket_assignments += 1
    zero._partition_parameters(info.params_per_rank)
    for assignments in info.bucket_assignments_per_rank:
        for assignment in assignments.values():
            if not all(p.requires_grad for p in assignment.parameters):
                raise AssertionError(
                    "Model parameter corresponding to a gradient in a DDP bucket should require "
                    "a gradient"
                )
            assignment.tensor = flatten_into_bucket(assignment.parameters, assignment.device)
    groups = zero._partition_parameters()[zero.rank]
    if len(groups) != 1:
        raise AssertionError(
            "Initializing the local functional optimizer with more than one parameter group"
        )
    zero.optim = build_functional_optimizer(
        zero._optim_constructor, groups[0]["params"], zero._optim_defaults
    )
    sync_param_groups(zero.optim.param_groups, zero.param_groups)
    if get_debug_level() != DebugLevel.OFF:
        logger.info(
            "rank %s with %s parameters across %s buckets",
            zero.rank,
            sum(p.numel() for p in groups[0]["params"]),
            len(info.bucket_assignments_per_rank[zero.rank]),
        )


# -- per-bucket step and sync ----------------------------------------------------------------------


def local_step(zero: OverlapZero, gradients: list[torch.Tensor | None]) -> None:
    """Step the local functional optimizer; ``None`` gradients leave their parameters alone.

    Raises:
        RuntimeError: if a parameter's ``requires_grad`` changed since construction (torch's
            message).
    """
    if zero._get_is_trainable_mask() != zero._is_trainable_mask:
        raise RuntimeError(
            "ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not support changing "
            "parameter trainability at run time"
        )
    sync_param_groups(zero.param_groups, zero.optim.param_groups)
    sync_hyperparameters(zero.param_groups[0], zero.optim)
    zero.optim.step(gradients)


def _reduced_gradients(bucket: GradBucket, reduced: Any) -> list[torch.Tensor]:
    """The bucket's gradients after its all-reduce: views of the hook's result tensor."""
    tensor = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
    buffer = bucket.buffer()
    if isinstance(tensor, torch.Tensor) and tensor.data_ptr() != buffer.data_ptr():
        # A hook that returns a new tensor (compression hooks): DDP would copy it in anyway.
        buffer.copy_(tensor.view_as(buffer))
    grads: list[torch.Tensor] = bucket.gradients()
    return grads


def bucket_step(zero: OverlapZero, info: OverlapInfo, bucket: GradBucket, reduced: Any) -> None:
    """Update this rank's share of one DDP bucket from its reduced gradients.

    Args:
        zero: the ZeroRedundancyOptimizer (initialised, this rank assigned to the bucket).
        info: its overlap state.
        bucket: the DDP gradient bucket, its all-reduce complete.
        reduced: the all-reduce future's value (None: the bucket's buffer).

    Raises:
        AssertionError: if ZeRO has several param groups or the bucket is not assigned here
            (torch's checks).
    """
    index = bucket.index()
    if len(zero.optim.param_groups) != 1:
        raise AssertionError("Overlapping DDP with ZeRO only supports a single parameter group")
    if index not in info.offsets:
        raise AssertionError(f"Bucket index {index} was not assigned to rank {zero.rank}")
    grads = _reduced_gradients(bucket, bucket.buffer() if reduced is None else reduced)
    assignment = info.bucket_assignments_per_rank[zero.rank][index]
    first = info.offsets[index]
    gradients: list[torch.Tensor | None] = [None] * len(zero.optim.param_groups[0]["params"])
    count = len(assignment.parameters)
    gradients[first : first + count] = grads[assignment.offset : assignment.offset + count]
    local_step(zero, gradients)


def broadcast_bucket(process_group: Any, info: OverlapInfo, bucket_index: int) -> None:
    """Issue the broadcasts of one bucket, one per assigned rank in rank order (no waiting).

    Every rank must call this for the same buckets in the same order: gloo matches collectives
    by issue order, so the hooks only call it from the backward thread, in bucket order.

    Raises:
        AssertionError: if the bucket plan is incomplete (torch's checks).
    """
    if len(info.assigned_ranks_per_bucket) <= bucket_index:
        raise AssertionError("`assigned_ranks_per_bucket` is not fully constructed")
    ranks = sorted(info.assigned_ranks_per_bucket[bucket_index])
    if not ranks:
        raise AssertionError(f"Bucket {bucket_index} should be assigned to at least one rank")
    for rank in ranks:
        tensor = info.bucket_assignments_per_rank[rank][bucket_index].tensor
        if tensor is None:
            raise AssertionError
        work = dist.broadcast(tensor, group=process_group, group_src=rank, async_op=True)
        assert work is not None
        info.broadcast_handles.append(work)
