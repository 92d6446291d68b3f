"""Drop-in ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch 2.13).

A thin adapter: the constructor picks one strategy object per mode
(:mod:`compat_api._zero.modes`) and every method forwards to it:

- :class:`~compat_api._zero.strategy.PerParameterStrategy`: whole parameters per rank, planned
  by a pure planner (:mod:`dist_runtime.partition`, :mod:`dist_runtime.cost_partition`);
- :class:`~compat_api._zero.strategy.BucketViewStrategy`: ``parameters_as_bucket_view=True``;
- :class:`~compat_api._zero.flat.FlatStrategy`: ``partition="flat"``;
- :class:`~compat_api._zero.overlap.OverlapStrategy`: ``overlap_with_ddp=True``.

torch's private API lives in :mod:`compat_api._zero.private_api`, our sharded clipping and
checkpoints in :mod:`compat_api._zero.extensions`, the argument checks in
:mod:`compat_api._zero.validation`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from compat_api._zero.dcp_native import (
    ZeroState,
    dcp_state_dict,
    load_named_state_dict,
    mark_has_state,
    uses_param_names,
)
from compat_api._zero.extensions import ShardedExtensions
from compat_api._zero.functional import functional_constructor
from compat_api._zero.join import ZeroJoinHook
from compat_api._zero.layout import ShardLayout, sync_param_groups, weakly
from compat_api._zero.modes import make_strategy, pop_partition
from compat_api._zero.private_api import TorchPrivateAPI
from compat_api._zero.step_guard import StepGuard
from compat_api._zero.validation import (
    check_default_group,
    check_optimizer_class,
    check_param_group,
    check_same_dense_type,
    check_saved_groups,
    flatten_params,
)
from dist_runtime.dcp_optimizer_state import called_by_dcp_get
from dist_runtime.process_group import group_rank, group_size, resolve_group

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


def _broadcast_object(
    obj: Any, src_rank: int, group: Any = None, device: torch.device | None = None
) -> Any:
    """Broadcast a picklable object from global rank ``src_rank`` (torch's module helper)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src_rank, group=group, device=device)
    return holder[0]


class ZeroRedundancyOptimizer(TorchPrivateAPI, ShardedExtensions, Optimizer, Joinable):
    r"""Wrap an optimizer and shard its state across the ranks of a process group (ZeRO-1).

    Each rank's local optimizer (``self.optim``) updates only the parameters assigned to that
    rank (about ``1 / world_size`` of them, chosen by torch's sorted-greedy rule, so the
    assignment equals torch's), then every rank broadcasts its updated parameters to the others.
    Usable with :class:`~torch.nn.parallel.DistributedDataParallel` and with
    :class:`~torch.distributed.algorithms.Join` for uneven inputs.

    Args:
        params: an iterable of tensors or of param-group dicts; all parameters must share one
            dense tensor type.
        optimizer_class: the local optimizer class (any ``torch.optim.Optimizer`` subclass).
        process_group: the group to shard over (default: WORLD).
        parameters_as_bucket_view: pack each rank's trainable parameters per device into one
            flat bucket, re-pointing ``param.data`` at bucket views, and sync one bucket per
            (device, rank).
        overlap_with_ddp: run the step inside DDP's backward pass instead of in :meth:`step`:
            register :func:`~compat_api.algorithms.ddp_comm_hooks.ddp_zero_hook.hook_with_zero_step`
            (or ``..._interleaved``) on the DDP module; ``optimizer_class`` is replaced by its
            functional counterpart (:data:`compat_api.utils.functional_optim_map`), one param
            group only; the first 2 iterations (3 with ``static_graph``) do not update.
        **defaults: forwarded to ``optimizer_class``, except our extension ``partition``:
            ``"sorted_greedy"`` (default, torch's rule), ``"flat"``, ``"cost_balanced"`` or a
            planner callable (see below).

    ``partition="flat"``: equal contiguous shards of the concatenated parameters (elementwise
    optimizers only); with ``ddp.register_comm_hook(zero, zero_flat_hook)`` DDP sends nothing and
    :meth:`step` reduce-scatters the gradients and all-gathers the parameters (one all-reduce's
    volume). ``partition="cost_balanced"``: whole parameters (for ``torch.optim.Muon``,
    ``Adafactor``...), the local optimizer's cost balanced per rank
    (:func:`dist_runtime.cost_partition.cost_for_optimizer`). A callable
    ``partition(group_sizes, world_size) -> plan[g][r]`` gets each group's parameter shapes and
    returns the indices each rank updates. Sharded checkpoints (:meth:`save_sharded`,
    :meth:`sharded_state_dict`) reload at any partition and world size.

    A collective that fails in :meth:`step` (a dead or hung peer) raises
    :class:`~dist_runtime.collective_failure.CollectiveFailedError` naming the failed rank(s).
    With ``undo_step_on_failure = True`` (opt-in, on the class or an instance; off by default
    because it copies every parameter and the local optimizer state each step: 1.1-1.6x the
    step time measured on one rank, where all the state is local) the step is undone first:
    parameters and optimizer state are bitwise as before the call, so it can be retried after
    re-forming the group. With ``overlap_with_ddp=True`` the same holds for the iteration the
    DDP comm hook steps: the error leaves ``backward()`` and every bucket step of the iteration
    is undone (the DDP module must be rebuilt over the re-formed group).

    Raises:
        TypeError / ValueError: for bad ``params``, mixed dense types, sparse parameters, an
            unusable ``optimizer_class`` (torch's types and messages) or a bad ``partition``.
        ValueError: with ``overlap_with_ddp=True``, if ``optimizer_class`` has no functional
            counterpart (torch's message).

    Example::

        >>> opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
        >>> ddp(inputs).sum().backward()
        >>> opt.step()
    """

    #: Undo a step whose collective failed (see above); the constructor stays torch's.
    undo_step_on_failure: bool = False

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer],
        process_group: Any | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        params, self._all_params = flatten_params(params)
        check_same_dense_type(self._all_params)
        self.partition, planner = pop_partition(defaults, optimizer_class, overlap_with_ddp)
        if overlap_with_ddp:
            constructor = functional_constructor(optimizer_class)
        else:
            constructor = check_optimizer_class(optimizer_class)
        check_default_group(process_group)
        group = resolve_group(process_group)

        # Optimizer.__init__ calls add_param_group: until `initialized`, that only registers.
        self.initialized = False
        Optimizer.__init__(self, params, defaults)
        self.state = ZeroState(self, self.state)  # what DSD reads (see _zero/dcp_native.py)
        Joinable.__init__(self)

        self.process_group: Any = group
        self.world_size: int = group_size(group)
        self.rank: int = group_rank(group)
        self.global_rank: int = dist.get_global_rank(group, self.rank)
        self._layout = ShardLayout(
            self.world_size,
            weakly(self._get_param_groups),
            weakly(self._get_all_params),
            *([] if planner is None else [planner]),
        )
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._default_device = self._all_params[0].device
        self._optim_defaults = defaults
        self._optim_constructor = constructor
        self.parameters_as_bucket_view = parameters_as_bucket_view
        if overlap_with_ddp and parameters_as_bucket_view:
            logger.warning(
                "`parameters_as_bucket_view=True` will be ignored since "
                "`overlap_with_ddp=True`; instead, a different bucketing strategy will be used"
            )
        self.strategy = make_strategy(
            self.partition,
            self._all_params,
            group,
            self.world_size,
            parameters_as_bucket_view,
            overlap_with_ddp,
        )
        # The overlap mode builds its optimizer later (the DDP hooks call _init_zero_for_overlap).
        self.strategy.init_optimizer(self)
        self._all_state_dicts: list[dict[str, Any]] = []
        self._step_guard = StepGuard()
        self.initialized = True

    # -- the optimizer API -----------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group and repartition; the new parameters go to the least-loaded ranks.

        Earlier groups keep their ranks (the greedy totals carry over in group order), so the
        local optimizers keep their state. With ``partition="flat"`` the new group's trainable
        parameters are laid out in new flat buffers, sharded the same way.

        Args:
            param_group: the parameters (same dense type as the others) and their options.

        Raises:
            TypeError / ValueError: for a malformed group (nothing is changed).
            RuntimeError: with ``overlap_with_ddp=True`` (one param group only; torch's message).

        .. warning:: Call it on all ranks, with the same group: the parameter sync after each
            step expects every rank to hold the same partition, and a rank that skipped the call
            would wait forever in its broadcasts.
        """
        if not self.initialized:
            super().add_param_group(param_group)
            return
        self.strategy.check_add_param_group()
        new_params = check_param_group(param_group, self._all_params[0])
        super().add_param_group(param_group)
        self._all_params.extend(new_params)
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._clear_cache()
        self._step_guard.reset()
        self.strategy.add_param_group(self, new_params)

    def _local_step(
        self,
        gradients: list[torch.Tensor | None] | None = None,
        closure: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> float | None:
        """Step the local optimizer on this rank's shard, without syncing parameters.

        With ``overlap_with_ddp=True`` the DDP hooks pass ``gradients`` (``None`` entries leave
        their parameters alone) for the local functional optimizer.
        """
        if gradients is not None and self.strategy.takes_gradients:
            self.strategy.gradient_step(self, gradients, closure)
            mark_has_state(self)
            return None
        Join.notify_join_context(self)
        self._refresh_trainable()
        if gradients is not None:
            raise AssertionError(
                "Specifying `gradients` should not be used when `overlap_with_ddp=False`"
            )
        loss: float | None = self.strategy.local_step(self, closure, kwargs)
        mark_has_state(self)
        return loss

    def _refresh_trainable(self) -> None:
        """Rebuild what depends on ``requires_grad`` (the buckets) if it changed."""
        is_trainable_mask = self._get_is_trainable_mask()
        if is_trainable_mask != self._is_trainable_mask:
            logger.warning(
                "ZeroRedundancyOptimizer detected that the trainable parameters changed; "
                "rebuilding the parameter buckets if enabled"
            )
            self.strategy.trainable_changed(self)
            self._is_trainable_mask = is_trainable_mask
            self._step_guard.reset()

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, **kwargs: Any
    ) -> float | None:
        """Update this rank's shard with the local optimizer, then sync all shards.

        Args:
            closure: re-evaluates the model and returns the loss (optional for most
                optimizers); extra keyword arguments go to the local optimizer's ``step``.

        Returns:
            The local optimizer's return value (the loss when a closure is given).

        Raises:
            CollectiveFailedError: if a collective failed (a dead or hung peer), naming it. With
                :attr:`undo_step_on_failure` the step is undone first (parameters and optimizer
                state bitwise as before the call); otherwise they may be partially updated.
        """
        if not self.strategy.steps_in_step:
            logger.warning(
                "`step()` should not be included in the training loop when `overlap_with_ddp=True`"
            )
            return None
        with self._step_guard.guard(self, self.undo_step_on_failure):
            loss = self._local_step(closure=closure, **kwargs)
            self._sync_params()
        return loss

    # -- Join --------------------------------------------------------------------------------------

    def join_hook(self, **_kwargs: Any) -> JoinHook:
        """The ZeRO join hook: a joined rank keeps stepping so the broadcasts still match.

        Gradients must be set before the hook runs (DDP's join hook does it). Takes no options.
        """
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter."""
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        """The process group the shards are synced over."""
        return self.process_group

    # -- state dicts -------------------------------------------------------------------------------

    def _staging_device(self) -> torch.device | None:
        """Where pickled state travels: the parameters' device for NCCL, else the CPU."""
        if self._default_device.type != "cpu" and "nccl" in str(
            dist.get_backend(self.process_group)
        ):
            return self._default_device
        return None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state on group rank ``to`` (call it on all ranks).

        Afterwards :meth:`state_dict` on rank ``to`` returns the full state, in the layout of a
        plain optimizer over all the parameters.

        Args:
            to: the receiving group rank.

        Raises:
            ValueError: if ``to`` is not a rank of the group (raised on every rank, no hang).
        """
        self.strategy.check_ready()
        sync_param_groups(self.param_groups, self.optim.param_groups)
        self._all_state_dicts = self.strategy.consolidate(self, to, self._staging_device())

    def state_dict(self) -> dict[str, Any]:
        """The global optimizer state as of the last :meth:`consolidate_state_dict` to this rank.

        Called by ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (on
        every rank), it returns this rank's share instead, unconsolidated (see
        :mod:`compat_api._zero.dcp_native`).

        Raises:
            RuntimeError: if the state was not consolidated on this rank (torch's message).
        """
        self.strategy.check_ready()
        # DSD calls state_dict() exactly as a user does: only its caller tells them apart
        # (why a look at the stack, and not DSD's `_patched_state_dict`: see called_by_dcp_get).
        if called_by_dcp_get():
            return dcp_state_dict(self, self.strategy)
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on all ranks beforehand "
                "if you meant to save the global state."
            )
        return self.strategy.global_state_dict(self, super().state_dict(), self._all_state_dicts)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global state dict (from :meth:`state_dict`, or a plain optimizer's).

        Each rank keeps only the state of the parameters it owns, loaded through the local
        optimizer's own ``load_state_dict`` (torch writes ``optim.state`` directly instead), so
        optimizers that keep their state elsewhere, such as ``functional_optim.Optimizer``, load
        it too; for ``torch.optim`` optimizers the loaded values are the same as torch's. Unlike
        torch, the argument is not modified. A dict whose params are names (what
        ``set_optimizer_state_dict`` passes) is this rank's share of a DCP checkpoint: each rank
        loads the pieces it owns (see :mod:`compat_api._zero.dcp_native`).

        Args:
            state_dict: the global optimizer state.

        Raises:
            ValueError: if the groups or their sizes do not match (``torch.optim`` messages),
                or the groups were saved by another optimizer (they lack hyperparameters of
                the local optimizer, e.g. SGD's state dict for Adam), before anything is loaded.
            IndexError: if the state names a parameter index that does not exist (before
                anything is loaded).
        """
        self.strategy.check_ready()
        if uses_param_names(state_dict):
            load_named_state_dict(self, self.strategy, state_dict)
            return
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError(
                "loaded state dict contains a parameter group that doesn't match the size of "
                "optimizer's group"
            )
        check_saved_groups(saved_groups, self.optim)
        kept = self.strategy.load_state_dict(self, state_dict)
        super().load_state_dict({**state_dict, "state": kept})
        sync_param_groups(saved_groups, self.param_groups)
        sync_param_groups(self.param_groups, self.optim.param_groups)
        mark_has_state(self)
