"""What ZeRO's step does when a collective fails: name the rank, and optionally undo.

Without the opt-in, a failed step raises
:class:`~dist_runtime.collective_failure.CollectiveFailedError` saying the state may be partly
updated. With ``undo_step_on_failure`` a snapshot of what the strategy can write
(:meth:`written_tensors`) and of the local optimizer state is restored before raising
(:func:`~dist_runtime.step_rollback.restore_on_failure`). The snapshot is reused while the
tensors it copies stay the same.

Two entry points: :meth:`StepGuard.guard` around ``step()``; with ``overlap_with_ddp=True`` the
step spans the DDP comm hook's calls, so the hooks call :meth:`StepGuard.begin_iteration` before
the iteration's first bucket step and run each call under :meth:`StepGuard.overlap_guard`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dist_runtime.collective_failure import collective_guard
from dist_runtime.step_rollback import OptimizerSnapshot, restore_on_failure

__all__ = ["OVERLAP_STEP", "STEP", "StepGuard"]

STEP = "ZeroRedundancyOptimizer.step"
#: The step of ``overlap_with_ddp=True``, run by the DDP comm hook in the backward pass.
OVERLAP_STEP = "ZeroRedundancyOptimizer.step (overlap_with_ddp, in the DDP comm hook)"
_UNDO_HINT = (
    "reload the latest sharded checkpoint on every rank (`load_sharded`) before training on, or "
    "set `ZeroRedundancyOptimizer.undo_step_on_failure = True` to have a failed step rolled back."
)
#: What a failed step without ``undo_step_on_failure`` leaves, and how to get back.
PARTIAL = (
    "Parameters and optimizer state may be partially updated (some shards stepped or received, "
    f"others not): {_UNDO_HINT}"
)
#: The DDP module of the overlap mode cannot run another backward pass after a failed one.
_REBUILD_DDP = (
    "The DistributedDataParallel module cannot be used again: after re-forming the group, "
    "rebuild it and the ZeroRedundancyOptimizer over the new group."
)
OVERLAP_PARTIAL = (
    "Parameters and optimizer state may be partially updated (some buckets stepped or "
    f"received, others not): {_UNDO_HINT} {_REBUILD_DDP}"
)


class StepGuard:
    """Guards one ZeRO optimizer's steps; holds the reusable snapshot of the last undoable step."""

    def __init__(self) -> None:
        self._cached: tuple[tuple[int, ...], OptimizerSnapshot] | None = None
        # The snapshot of the overlap iteration in progress (None: no undo).
        self._taken: OptimizerSnapshot | None = None

    def reset(self) -> None:
        """Drop the snapshot (the partition, buckets or param groups changed)."""
        self._cached = None

    def _capture(self, zero: Any) -> OptimizerSnapshot:
        """Snapshot what the next step may write, into the buffers of the last one if it fits."""
        written = zero.strategy.written_tensors(zero)
        local = [p for group in zero.optim.param_groups for p in group["params"]]
        key = tuple(map(id, [*written, *local]))
        if self._cached is not None and self._cached[0] == key:
            snapshot = self._cached[1]
            snapshot.capture()
        else:
            snapshot = OptimizerSnapshot(zero.optim, written)
            self._cached = (key, snapshot)
        return snapshot

    @contextlib.contextmanager
    def guard(self, zero: Any, undo: bool) -> Iterator[None]:
        """Run the body (local step + parameter sync) under the failure policy.

        Args:
            zero: the :class:`~compat_api.zero_redundancy_optimizer.ZeroRedundancyOptimizer`.
            undo: restore parameters and optimizer state before raising.
        """
        snapshot = None
        if undo:
            zero._refresh_trainable()  # before the snapshot: a rebuild replaces the buckets
            snapshot = self._capture(zero)
        with _policy(STEP, PARTIAL, zero.process_group, snapshot):
            yield

    def begin_iteration(self, zero: Any, undo: bool) -> None:
        """Overlap mode: snapshot before the iteration's first bucket step (with ``undo``)."""
        self._taken = self._capture(zero) if undo else None

    @contextlib.contextmanager
    def overlap_guard(self, zero: Any, settle: Callable[[], None]) -> Iterator[None]:
        """Overlap mode: run one comm hook call of the iteration under the failure policy.

        Args:
            zero: the ZeroRedundancyOptimizer (``overlap_with_ddp=True``).
            settle: waits for this iteration's communication still in flight (never raises);
                run before restoring the snapshot of :meth:`begin_iteration`, if one was taken.
        """
        with _policy(OVERLAP_STEP, OVERLAP_PARTIAL, zero.process_group, self._taken, settle):
            yield


@contextlib.contextmanager
def _policy(
    operation: str,
    partial: str,
    process_group: Any,
    snapshot: OptimizerSnapshot | None,
    settle: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Name the failed rank; restore ``snapshot`` first if there is one."""
    if snapshot is None:
        with collective_guard(operation, process_group, kept=partial):
            yield
    else:
        with restore_on_failure(operation, snapshot, process_group, settle):
            yield
