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
  (same attribute names, used by torch's own tests and by the hooks);
- :func:`plan_bucket_assignments`: the bucket-to-rank plan, a pure function of the bucket sizes
  (torch's rule, with and without ``shard_buckets``);
- :class:`DDPBucketAssignment` and :func:`init_overlap`: apply the plan, flatten each assignment
  into one tensor (one broadcast each), build the local functional optimizer;
- :func:`bucket_step` / :func:`local_step`: the per-bucket functional optimizer step;
- :func:`broadcast_bucket` and :meth:`OverlapInfo.wait_for_broadcasts`: the per-bucket sync;
- :func:`functional_constructor` and :func:`local_state_dict`: the functional optimizer chosen
  through :data:`compat_api.utils.functional_optim_map` and its state in ``torch.optim`` layout
  (torch's functional optimizers have no ``state_dict``, so torch cannot consolidate in this mode).
"""

from __future__ import annotations

import enum
import inspect
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import DebugLevel, GradBucket, get_debug_level

from compat_api._zero.layout import sync_param_groups
from dist_runtime.buckets import flatten_into_bucket
from dist_runtime.param_sync import Waitable
from dist_runtime.partition import argmin_rank
from dist_runtime.state_consolidation import copy_to_device

__all__ = [
    "BucketSlice",
    "DDPBucketAssignment",
    "OverlapInfo",
    "OverlapStatus",
    "OverlapZero",
    "broadcast_bucket",
    "bucket_step",
    "functional_constructor",
    "init_overlap",
    "load_local_state",
    "local_state_dict",
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


@dataclass(frozen=True)
class BucketSlice:
    """One entry of a bucket plan: ``rank`` updates parameters ``[start, stop)`` of the bucket."""

    bucket_index: int
    rank: int
    start: int
    stop: int


def plan_bucket_assignments(
    bucket_sizes: Sequence[Sequence[int]], world_size: int, shard_buckets: bool
) -> list[BucketSlice]:
    """Assign DDP buckets (or slices of them) to ranks, with torch's rule.

    Without ``shard_buckets`` bucket ``i`` goes whole to rank ``i % world_size``. With it, the
    buckets are visited smallest first (stable on ties); each is cut, in parameter order, into
    runs that stay under ``total / world_size`` elements (a run is closed before the parameter
    that would reach the threshold, and holds at least one parameter), and every run goes to the
    least-loaded rank that holds no run of that bucket yet. Where torch would run out of ranks
    for one bucket (it raises), the last allowed run takes the rest of the bucket.

    Args:
        bucket_sizes: ``bucket_sizes[i][j]``: ``numel()`` of parameter ``j`` of bucket ``i``.
        world_size: the number of ranks.
        shard_buckets: slice buckets over ranks for balance.

    Returns:
        The slices in assignment order (the order in which each rank's local parameters are
        listed).

    Raises:
        ValueError: if a bucket is empty or ``world_size < 1``.

    Example::

        >>> plan_bucket_assignments([[4], [2, 2]], 2, False)
        [BucketSlice(bucket_index=0, rank=0, start=0, stop=1), BucketSlice(bucket_index=1, rank=1, start=0, stop=2)]
    """  # noqa: E501
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    for index, sizes in enumerate(bucket_sizes):
        if len(sizes) == 0:
            raise ValueError(f"DDP bucket {index} is empty")
    if not shard_buckets:
        return [
            BucketSlice(index, index % world_size, 0, len(sizes))
            for index, sizes in enumerate(bucket_sizes)
        ]
    threshold = sum(sum(sizes) for sizes in bucket_sizes) / world_size
    loads = [0] * world_size
    plan: list[BucketSlice] = []
    order = sorted(range(len(bucket_sizes)), key=lambda i: sum(bucket_sizes[i]))
    for index in order:
        sizes = bucket_sizes[index]
        taken: set[int] = set()
        start, run = 0, 0
        for j, numel in enumerate(sizes):
            room_for_more = len(taken) < world_size - 1
            if room_for_more and j > start and run + numel >= threshold:
                rank = argmin_rank(loads, taken)
                plan.append(BucketSlice(index, rank, start, j))
                taken.add(rank)
                loads[rank] += run
                start, run = j, 0
            run += numel
        rank = argmin_rank(loads, taken)
        plan.append(BucketSlice(index, rank, start, len(sizes)))
        loads[rank] += run
    return plan


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


class OverlapZero(Protocol):
    """What these functions need from ZeroRedundancyOptimizer."""

    _overlap_info: OverlapInfo
    _optim_constructor: Callable[..., Any]
    _optim_defaults: dict[str, Any]
    _is_trainable_mask: list[bool]
    optim: Any
    param_groups: list[dict[str, Any]]
    process_group: Any
    world_size: int
    rank: int

    def _clear_cache(self) -> None: ...

    def _partition_parameters(
        self, params_per_rank: list[list[torch.Tensor]] | None = None
    ) -> list[list[dict[str, Any]]]: ...

    def _get_is_trainable_mask(self) -> list[bool]: ...


# -- functional optimizers -------------------------------------------------------------------------


def _torch_functional_classes() -> list[Any]:
    with warnings.catch_warnings():
        # Importing torch.distributed.optim scripts its interfaces (deprecated in torch 2.13).
        warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
        from torch.distributed.optim.utils import functional_optim_map as torch_map

    return list(torch_map.values())


def functional_constructor(optimizer_class: Any) -> Callable[..., Any]:
    """The functional optimizer to use for ``optimizer_class`` with ``overlap_with_ddp=True``.

    A functional optimizer class (ours, or torch's ``_FunctionalX``) is used as it is; a
    ``torch.optim`` class is translated through :data:`compat_api.utils.functional_optim_map`.

    Raises:
        ValueError: if there is no functional counterpart (torch's message).
    """
    from compat_api.utils import functional_optim_map

    known = list(functional_optim_map.values()) + _torch_functional_classes()
    if any(optimizer_class is cls for cls in known):
        constructor: Callable[..., Any] = optimizer_class
        return constructor
    if optimizer_class in functional_optim_map:
        constructor = functional_optim_map[optimizer_class]
        logger.info(
            "Using the functional optimizer %s instead of %s since `overlap_with_ddp=True`",
            constructor,
            optimizer_class,
        )
        return constructor
    raise ValueError(
        "Using `ddp_with_overlap=True` requires using a functional optimizer, but there is no "
        f"supported functional optimizer equivalent for {optimizer_class}"
    )


def _build_functional_optimizer(zero: OverlapZero, params: list[torch.Tensor]) -> Any:
    constructor = zero._optim_constructor
    try:
        accepts_empty = "_allow_empty_param_list" in inspect.signature(constructor).parameters
    except (TypeError, ValueError):
        accepts_empty = False
    if accepts_empty:
        optim = constructor(params, **zero._optim_defaults, _allow_empty_param_list=True)
    else:
        logger.warning(
            "%s does not support the argument `_allow_empty_param_list`; "
            "ZeroRedundancyOptimizer may error due to an empty parameter list",
            constructor,
        )
        optim = constructor(params, **zero._optim_defaults)
    if not hasattr(optim, "param_groups"):
        if not hasattr(optim, "param_group"):
            raise AssertionError(
                "The functional optimizer should set at least one of the attributes "
                "`param_group` or `param_groups`"
            )
        optim.param_groups = [optim.param_group]
    return optim


def _sync_hyperparameters(group: dict[str, Any], optim: Any) -> None:
    """Copy numeric hyperparameters of the wrapper's group (what LR schedulers edit) to ``optim``.

    torch's functional optimizers read ``self.defaults``, so in torch a scheduler has no effect
    in this mode; keeping them in sync makes it work (a no-op while nobody edits the group).
    """
    defaults = getattr(optim, "defaults", None)
    if not isinstance(defaults, dict):
        return
    for key, value in group.items():
        if key in defaults and isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = float(value)
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and len(betas) == 2 and "beta1" in defaults:
        defaults["beta1"], defaults["beta2"] = float(betas[0]), float(betas[1])


def local_state_dict(optim: Any, group: dict[str, Any]) -> dict[str, Any]:
    """A functional optimizer's state in the layout of ``torch.optim.Optimizer.state_dict()``.

    Args:
        optim: the local functional optimizer (one param group).
        group: the wrapper's param group (its hyperparameters are reported).

    Returns:
        ``{"state": {local_index: state}, "param_groups": [{..., "params": [0, ..., n-1]}]}``.
    """
    params: list[torch.Tensor] = optim.param_groups[0]["params"]
    state = {i: dict(optim.state[p]) for i, p in enumerate(params) if p in optim.state}
    hyper = {k: v for k, v in group.items() if k != "params"}
    return {"state": state, "param_groups": [{**hyper, "params": list(range(len(params)))}]}


def load_local_state(optim: Any, local: dict[torch.Tensor, Any]) -> None:
    """Load this rank's share of a global state into a functional optimizer.

    (Functional optimizers have no ``load_state_dict``; the state is keyed by parameter.)

    Tensors go to their parameter's device, except 0-d ones (such as Adam's ``"step"``), which
    stay on the CPU as torch puts them; entries that are not dicts (blanks) are skipped.
    """
    for param, value in local.items():
        if not isinstance(value, dict):
            continue
        moved = copy_to_device(value, param.device)
        for name, item in moved.items():
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                moved[name] = item.cpu()
        optim.state[param] = moved


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


def init_overlap(zero: OverlapZero) -> None:
    """The delayed initialisation (torch's ``_init_zero_for_overlap``).

    Plans the bucket assignments from the recorded DDP buckets, partitions the parameters
    accordingly, flattens each assignment's parameters into one tensor (parameters become views
    of it) and builds the local functional optimizer over this rank's parameters.

    Raises:
        AssertionError: if a bucket parameter does not require a gradient (torch's check).
        ValueError: if a DDP bucket holds a parameter ZeRO was not built with.
    """
    info = zero._overlap_info
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
    zero.optim = _build_functional_optimizer(zero, groups[0]["params"])
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
    _sync_hyperparameters(zero.param_groups[0], zero.optim)
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


def bucket_step(zero: OverlapZero, bucket: GradBucket, reduced: Any = None) -> None:
    """Update this rank's share of one DDP bucket from its reduced gradients.

    Args:
        zero: the ZeroRedundancyOptimizer (initialised, this rank assigned to the bucket).
        bucket: the DDP gradient bucket, its all-reduce complete.
        reduced: the all-reduce future's value (defaults to the bucket's buffer).

    Raises:
        AssertionError: if ZeRO has several param groups or the bucket is not assigned here
            (torch's checks).
    """
    info = zero._overlap_info
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


def broadcast_bucket(zero: OverlapZero, bucket_index: int) -> None:
    """Issue the broadcasts of one bucket, one per assigned rank in rank order (no waiting).

    Every rank must call this for the same buckets in the same order: gloo matches collectives
    by issue order, so the hooks only call it from the backward thread, in bucket order.

    Raises:
        AssertionError: if the bucket plan is incomplete (torch's checks).
    """
    info = zero._overlap_info
    if len(info.assigned_ranks_per_bucket) <= bucket_index:
        raise AssertionError("`assigned_ranks_per_bucket` is not fully constructed")
    ranks = sorted(info.assigned_ranks_per_bucket[bucket_index])
    if not ranks:
        raise AssertionError(f"Bucket {bucket_index} should be assigned to at least one rank")
    for rank in ranks:
        tensor = info.bucket_assignments_per_rank[rank][bucket_index].tensor
        if tensor is None:
            raise AssertionError
        work = dist.broadcast(tensor, group=zero.process_group, group_src=rank, async_op=True)
        assert work is not None
        info.broadcast_handles.append(work)
