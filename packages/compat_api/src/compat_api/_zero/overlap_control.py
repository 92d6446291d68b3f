"""The DDP hooks' controller and the strategy of ZeroRedundancyOptimizer's overlap mode.

:class:`OverlapController` is the only thing the hooks of
:mod:`compat_api.algorithms.ddp_comm_hooks.ddp_zero_hook` talk to (:func:`overlap_controller`
gives it); :class:`OverlapStrategy` is the mode behind the ZeroRedundancyOptimizer adapter. The
state and the per-bucket functions they use live in :mod:`compat_api._zero.overlap`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket

from compat_api._zero.functional import load_local_state, local_state_dict
from compat_api._zero.overlap import (
    OverlapInfo,
    OverlapStatus,
    OverlapZero,
    broadcast_bucket,
    bucket_step,
    init_overlap,
    local_step,
    save_bucket_info,
)
from compat_api._zero.strategy import PerParameterStrategy, ZeroContext
from dist_runtime.param_sync import Waitable

__all__ = ["OverlapController", "OverlapStrategy", "overlap_controller"]


class OverlapController:
    """The DDP comm hooks' handle on a ZeRO instance built with ``overlap_with_ddp=True``.

    The hooks of :mod:`compat_api.algorithms.ddp_comm_hooks.ddp_zero_hook` drive the state
    machine through these methods only. As in torch, the hook (through its controller) keeps the
    ZeRO instance alive: a training loop may hold only the DDP module. ZeRO itself never refers
    to its controllers, so this forms no reference cycle.

    Args:
        zero: the ZeroRedundancyOptimizer.
        info: its :class:`OverlapInfo` (torch's ``_overlap_info``).
    """

    def __init__(self, zero: OverlapZero, info: OverlapInfo) -> None:
        self.zero = zero
        self.info = info

    @property
    def initialized(self) -> bool:
        """Whether the local optimizer exists (the warm-up is over)."""
        return self.info.status == OverlapStatus.INITIALIZED

    def shard_buckets(self) -> None:
        """Slice each DDP bucket over several ranks (``shard_buckets=True`` of the hooks)."""
        self.info.shard_buckets = True
        self.info.total_size = 0

    def setup(self, ddp_has_rebuilt_buckets: bool, bucket: GradBucket) -> None:
        """Advance the warm-up: record DDP's final buckets for one pass, then initialise ZeRO."""
        info = self.info
        if not ddp_has_rebuilt_buckets:
            if info.status != OverlapStatus.UNINITIALIZED:
                raise AssertionError
            return
        if info.status == OverlapStatus.UNINITIALIZED:
            info.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
        if info.status == OverlapStatus.DDP_HAS_REBUILT_BUCKETS:
            if bucket.index() == 0 and len(info.params_per_bucket) > 0:
                self.zero._init_zero_for_overlap()  # type: ignore[attr-defined]
            else:
                save_bucket_info(info, bucket)

    def record(self, bucket: GradBucket, fut: torch.futures.Future[Any]) -> int:
        """Check that buckets arrive as 0, 1, 2, ... and remember this one; return its index."""
        info = self.info
        index: int = bucket.index()
        if len(info.assigned_ranks_per_bucket) <= index:
            raise AssertionError("`assigned_ranks_per_bucket` is not fully constructed")
        if info.bucket_indices_seen:
            if info.bucket_indices_seen[-1] != index - 1:
                raise AssertionError("Bucket indices are not in incremental order")
        elif index != 0:
            raise AssertionError("Bucket indices do not start from 0")
        info.bucket_indices_seen.append(index)
        info.bucket_index_to_bucket[index] = bucket
        info.bucket_index_to_future[index] = fut
        return index

    @property
    def num_buckets(self) -> int:
        """The number of DDP buckets."""
        return len(self.info.params_per_bucket)

    def updates_here(self, bucket_index: int) -> bool:
        """Whether this rank updates (part of) bucket ``bucket_index``."""
        return self.zero.rank in self.info.assigned_ranks_per_bucket[bucket_index]

    def init(self) -> None:
        """The delayed initialisation (torch's ``_init_zero_for_overlap``)."""
        init_overlap(self.zero, self.info)

    def bucket_step(self, bucket: GradBucket, reduced: Any = None) -> None:
        """Update this rank's share of one DDP bucket (see :func:`bucket_step`)."""
        bucket_step(self.zero, self.info, bucket, reduced)

    def broadcast_bucket(self, bucket_index: int) -> None:
        """Issue the broadcasts of one bucket (see :func:`broadcast_bucket`)."""
        broadcast_bucket(self.zero.process_group, self.info, bucket_index)

    def finish_iteration(self) -> None:
        """Wait for this iteration's broadcasts and forget its buckets."""
        self.info.wait_for_broadcasts()
        self.info.clear_per_iter_info()

    # -- failures ----------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Before the iteration's first bucket step: snapshot it if ZeRO undoes failed steps."""
        self.zero._step_guard.begin_iteration(self.zero, self.zero.undo_step_on_failure)

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Run one hook call under ZeRO's failure policy.

        A failed collective raises :class:`~dist_runtime.collective_failure.
        CollectiveFailedError` naming the failed rank; with ``undo_step_on_failure`` the
        iteration's work still in flight is waited for and every bucket step of the iteration
        is undone first. On any error the iteration is forgotten.
        """
        try:
            with self.zero._step_guard.overlap_guard(self.zero, self.settle):
                yield
        except BaseException:
            self.info.broadcast_handles.clear()
            self.info.clear_per_iter_info()
            raise

    def settle(self) -> None:
        """Wait for every step and broadcast of this iteration, ignoring their errors.

        After a failure, the steps still running in future callbacks and the broadcasts still
        receiving would otherwise write into the parameters after they are restored.
        """
        info = self.info
        waits: list[Callable[[], Any]] = [f.wait for f in info.bucket_index_to_future.values()]
        waits += [handle.wait for handle in info.broadcast_handles]
        for wait in waits:
            with contextlib.suppress(Exception):  # failed work writes nothing more
                wait()


class OverlapStrategy(PerParameterStrategy):
    """``overlap_with_ddp=True``: DDP's comm hook steps a functional optimizer bucket by bucket.

    The local optimizer is built by :meth:`OverlapController.init` once DDP's buckets are
    final; :meth:`step` only warns (torch's behaviour).

    Args:
        world_size: the size of the process group.
    """

    steps_in_step = False
    takes_gradients = True

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.info = OverlapInfo(world_size)

    def init_optimizer(self, zero: ZeroContext) -> None:
        """Nothing yet: the DDP hooks call ``_init_zero_for_overlap`` after the warm-up."""

    def check_ready(self) -> None:
        """Raise torch's RuntimeError while the instance is warming up."""
        if self.info.status != OverlapStatus.INITIALIZED:
            raise RuntimeError(
                "This method should not be called until this ZeroRedundancyOptimizer instance "
                "has been fully initialized"
            )

    def check_add_param_group(self) -> None:
        raise RuntimeError(
            "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single "
            "parameter group"
        )

    def gradient_step(
        self,
        zero: ZeroContext,
        gradients: list[torch.Tensor | None],
        closure: Callable[[], float] | None,
    ) -> None:
        if closure is not None:
            raise AssertionError(
                "`closure` is not supported when using a local functional optimizer"
            )
        local_step(zero, gradients)  # type: ignore[arg-type]

    def broadcast_from(self, zero: ZeroContext, rank: int) -> list[Waitable]:
        raise AssertionError(
            "`_broadcast_params_from_rank()` should not be used if `overlap_with_ddp=True`; "
            "instead, the broadcasting should happen in the DDP communication hook"
        )

    def written_tensors(self, zero: ZeroContext) -> list[torch.Tensor]:
        # The bucket parameters are views of one flat tensor per (bucket, rank) assignment.
        return [
            assignment.tensor
            for assignments in self.info.bucket_assignments_per_rank
            for assignment in assignments.values()
            if assignment.tensor is not None
        ]

    def local_state_dict(self, zero: ZeroContext) -> dict[str, Any]:
        return local_state_dict(zero.optim, zero.param_groups[0])

    def load_local_state(
        self, zero: ZeroContext, local: dict[torch.Tensor, Any], saved_groups: list[dict[str, Any]]
    ) -> None:
        load_local_state(zero.optim, local)  # functional optimizers have no load_state_dict


def overlap_controller(zero: Any) -> OverlapController:
    """The controller the DDP ZeRO hooks drive.

    Raises:
        ValueError: if ``zero`` was not built with ``overlap_with_ddp=True`` (torch's message).
    """
    strategy = getattr(zero, "strategy", None)
    if not isinstance(strategy, OverlapStrategy):
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
            "this hook properly"
        )
    return OverlapController(zero, strategy.info)
