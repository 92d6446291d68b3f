"""The modes of ZeroRedundancyOptimizer as objects behind one protocol.

``ZeroRedundancyOptimizer`` is a thin adapter: it builds one strategy in its constructor
(:func:`compat_api._zero.modes.make_strategy`) and forwards to it. Each strategy owns what
differs between the modes:

- :class:`PerParameterStrategy`: whole parameters per rank, planned by a pure planner (torch's
  sorted-greedy rule by default, a cost-balanced one, or the caller's), synced by a few packed
  broadcasts;
- :class:`BucketViewStrategy`: the same partition, ``parameters_as_bucket_view=True``: the
  parameters are views of one flat bucket per (device, rank), one broadcast each;
- :class:`compat_api._zero.flat.FlatStrategy`: ``partition="flat"``, equal contiguous shards;
- :class:`compat_api._zero.overlap.OverlapStrategy`: ``overlap_with_ddp=True``, the step runs
  in DDP's comm hook through an :class:`~compat_api._zero.overlap.OverlapController`.

The protocol (every method takes the adapter, a :class:`ZeroContext`, first, so that no strategy
keeps its optimizer alive through a reference cycle): local param groups and the local
optimizer, gradient preparation, the local step, the parameter sync, consolidation and
``load_state_dict``, and the pieces each rank owns (what sharded checkpoints and clipping read).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

from compat_api._zero.layout import ShardLayout, sync_param_groups
from compat_api._zero.validation import check_local_optimizer, refuse_sparse_grads
from dist_runtime.buckets import build_rank_buckets
from dist_runtime.param_sync import ShardBroadcaster, Waitable, broadcast_buckets
from dist_runtime.piece_state import Piece
from dist_runtime.state_consolidation import (
    copy_to_device,
    gather_local_state_dicts,
    merge_local_state_dicts,
    split_global_state,
)

__all__ = ["BucketViewStrategy", "PerParameterStrategy", "ZeroContext", "ZeroStrategy"]


class ZeroContext(Protocol):
    """What the strategies read from (and write to) the ``ZeroRedundancyOptimizer``."""

    optim: Any
    param_groups: list[dict[str, Any]]
    process_group: Any
    world_size: int
    rank: int
    _layout: ShardLayout
    _all_params: list[torch.Tensor]
    _optim_constructor: Callable[..., Any]
    _optim_defaults: dict[str, Any]


class ZeroStrategy(abc.ABC):
    """The base protocol, with the behaviour shared by the whole-parameter modes.

    Attributes:
        buckets: torch's ``_buckets`` (``[device][rank]`` flat tensors; bucket view only).
    """

    #: Does ``step()`` run the update (False: a DDP comm hook does).
    steps_in_step = True
    #: Does ``_local_step(gradients)`` step on explicit gradients (a functional optimizer).
    takes_gradients = False

    def __init__(self) -> None:
        self.buckets: list[list[torch.Tensor]] = []

    # -- the local optimizer -------------------------------------------------------------------

    @abc.abstractmethod
    def local_param_groups(self, zero: ZeroContext) -> list[dict[str, Any]]:
        """This rank's param groups for its local optimizer."""

    def init_optimizer(self, zero: ZeroContext) -> None:
        """Build ``zero.optim`` over :meth:`local_param_groups`."""
        # A list of groups bypasses the local optimizer's empty-parameter-list check.
        optim = zero._optim_constructor(self.local_param_groups(zero), **zero._optim_defaults)
        zero.optim = check_local_optimizer(optim, zero._optim_constructor)
        sync_param_groups(zero.optim.param_groups, zero.param_groups)

    def lowbit_context(self) -> contextlib.AbstractContextManager[None]:
        """Where the local tensors lie in their params, for low-bit optimizer states
        (:mod:`functional_optim.lowbit`); whole params by default."""
        return contextlib.nullcontext()

    def check_ready(self) -> None:  # noqa: B027 (a no-op hook)
        """Raise if the mode cannot serve state dicts yet (overlap warm-up)."""

    def check_add_param_group(self) -> None:  # noqa: B027 (a no-op hook)
        """Raise if the mode cannot take another param group (before anything changes)."""

    @abc.abstractmethod
    def add_param_group(self, zero: ZeroContext, new_params: list[torch.Tensor]) -> None:
        """Give the local optimizer its share of the group just appended to ``zero``."""

    def trainable_changed(self, zero: ZeroContext) -> None:  # noqa: B027 (a no-op hook)
        """React to parameters whose ``requires_grad`` changed since the last step."""

    def forget_plan(self) -> None:  # noqa: B027 (a no-op hook)
        """Drop cached communication plans (the partition changed)."""

    # -- gradients, step, sync -----------------------------------------------------------------

    def prepare_grads(self, zero: ZeroContext) -> None:  # noqa: B027 (a no-op hook)
        """Make the gradients the local optimizer reads available (no-op: they are in place)."""

    def shard_grads(self, zero: ZeroContext) -> list[torch.Tensor]:
        """The gradients this rank's local optimizer will read (for sharded clipping)."""
        self.prepare_grads(zero)
        return [
            p.grad
            for group in zero.optim.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def gradient_step(
        self,
        zero: ZeroContext,
        gradients: list[torch.Tensor | None],
        closure: Callable[[], float] | None,
    ) -> None:
        """Step on explicit gradients (only where :attr:`takes_gradients`)."""
        raise RuntimeError(
            "explicit gradients are only stepped with `overlap_with_ddp=True`; this mode reads "
            "each parameter's `.grad`"
        )

    def local_step(
        self, zero: ZeroContext, closure: Callable[[], float] | None, kwargs: dict[str, Any]
    ) -> Any:
        """Step the local optimizer on this rank's shard (hyperparameters synced both ways)."""
        sync_param_groups(zero.param_groups, zero.optim.param_groups)
        if closure is None:
            loss = zero.optim.step(**kwargs)
        else:
            loss = zero.optim.step(closure=closure, **kwargs)
        sync_param_groups(zero.optim.param_groups, zero.param_groups)
        return loss

    @abc.abstractmethod
    def sync_params(self, zero: ZeroContext) -> None:
        """Send every shard from its owner to all ranks and wait."""

    @abc.abstractmethod
    def broadcast_from(self, zero: ZeroContext, rank: int) -> list[Waitable]:
        """Start sending ``rank``'s shard to all ranks; handles to wait on."""

    def written_tensors(self, zero: ZeroContext) -> list[torch.Tensor]:
        """Every tensor a step (local update + sync) may write, each storage once.

        What ``undo_step_on_failure`` copies before the step: the parameters themselves here
        (the per-parameter broadcasts write every one of them).
        """
        return list(zero._all_params)

    # -- state ---------------------------------------------------------------------------------

    def owned_pieces(self, zero: ZeroContext) -> dict[torch.Tensor, Piece]:
        """Where each tensor of ``zero.optim`` lies in the global parameters."""
        index_of = zero._layout.param_to_index
        return {
            p: Piece(index_of[p], 0, p.numel(), tuple(p.shape))
            for group in zero.optim.param_groups
            for p in group["params"]
        }

    def local_state_dict(self, zero: ZeroContext) -> dict[str, Any]:
        """This rank's optimizer state in ``torch.optim`` layout (what consolidation gathers)."""
        state: dict[str, Any] = zero.optim.state_dict()
        return state

    def consolidate(
        self, zero: ZeroContext, to: int, device: torch.device | None
    ) -> list[dict[str, Any]]:
        """Gather the local state dicts on group rank ``to`` (empty elsewhere)."""
        gathered = gather_local_state_dicts(
            self.local_state_dict(zero), to, zero.process_group, device
        )
        return [] if gathered is None else gathered

    def global_state_dict(
        self, zero: ZeroContext, base: dict[str, Any], gathered: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Merge the gathered local states into ``base`` (the wrapper's own state dict)."""
        rank_param_groups = [
            [group["params"] for group in groups] for groups in zero._layout.partition()
        ]
        return merge_local_state_dicts(
            base, gathered, rank_param_groups, zero._layout.param_to_index
        )

    def load_local_state(
        self, zero: ZeroContext, local: dict[torch.Tensor, Any], saved_groups: list[dict[str, Any]]
    ) -> None:
        """Load this rank's share of a global state into the local optimizer."""
        zero.optim.load_state_dict(_local_state_dict(zero.optim, local, saved_groups))

    def load_state_dict(self, zero: ZeroContext, state_dict: dict[str, Any]) -> dict[int, Any]:
        """Load this rank's share of ``state_dict``; returns what the wrapper keeps itself.

        Raises:
            IndexError: if the state names a parameter index that does not exist (before
                anything is loaded).
            Exception: whatever the local optimizer's ``load_state_dict`` raises; its state
                and param groups are then as they were.
        """
        local, kept = split_global_state(
            state_dict["state"],
            zero._layout.index_to_param,
            zero._layout.param_to_rank,
            zero.rank,
        )
        # torch's load_state_dict rebinds `state` and `param_groups` before it can fail
        # (Adam.__setstate__'s KeyError: 'step'): put the old bindings back if it does.
        bindings = dict(vars(zero.optim))
        try:
            self.load_local_state(zero, local, state_dict["param_groups"])
        except Exception:
            vars(zero.optim).clear()
            vars(zero.optim).update(bindings)
            raise
        return kept


def _local_state_dict(
    optim: Optimizer, local: dict[torch.Tensor, Any], saved_groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """This rank's share of a global state dict, in the local optimizer's layout."""
    local_groups = optim.param_groups
    position = {p: i for i, p in enumerate(p for g in local_groups for p in g["params"])}
    state: dict[int, Any] = {}
    for param, value in local.items():
        if not isinstance(value, dict):  # None: a blank entry saved by an earlier load
            continue
        moved = copy_to_device(value, param.device, non_blocking=True)
        for name, item in moved.items():
            # Scalar tensors (e.g. Adam's "step") go to the CPU, as torch puts them.
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                moved[name] = item.cpu()
        state[position[param]] = moved
    groups = [
        {
            **{k: v for k, v in saved.items() if k != "params"},
            "params": [position[p] for p in group["params"]],
        }
        for saved, group in zip(saved_groups, local_groups)
    ]
    return {"state": state, "param_groups": groups}


class PerParameterStrategy(ZeroStrategy):
    """Whole parameters per rank (the layout's planner decides), packed broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self._broadcaster: ShardBroadcaster | None = None

    def local_param_groups(self, zero: ZeroContext) -> list[dict[str, Any]]:
        return zero._layout.partition()[zero.rank]

    def add_param_group(self, zero: ZeroContext, new_params: list[torch.Tensor]) -> None:
        self._broadcaster = None
        rank_groups = zero._layout.partition()[zero.rank]
        if len(rank_groups) == len(zero.optim.param_groups) + 1:
            zero.optim.add_param_group(rank_groups[-1])

    def forget_plan(self) -> None:
        self._broadcaster = None

    def shard_broadcaster(self, zero: ZeroContext) -> ShardBroadcaster:
        """The packed broadcasts of the current partition (built once, until it changes)."""
        if self._broadcaster is None:
            params_per_rank = [zero._layout.params_of_rank(r) for r in range(zero.world_size)]
            self._broadcaster = ShardBroadcaster(params_per_rank, zero.process_group)
        return self._broadcaster

    def broadcast_from(self, zero: ZeroContext, rank: int) -> list[Waitable]:
        return self.shard_broadcaster(zero).start(rank)

    def sync_params(self, zero: ZeroContext) -> None:
        self.shard_broadcaster(zero).sync()


class BucketViewStrategy(PerParameterStrategy):
    """``parameters_as_bucket_view=True``: one flat bucket per (device, rank) and broadcast."""

    def init_optimizer(self, zero: ZeroContext) -> None:
        super().init_optimizer(zero)
        self.rebuild(zero)

    def rebuild(self, zero: ZeroContext) -> None:
        """(Re)build the buckets from the current partition."""
        self.buckets = build_rank_buckets(zero._layout.device_to_params_per_rank)

    def add_param_group(self, zero: ZeroContext, new_params: list[torch.Tensor]) -> None:
        super().add_param_group(zero, new_params)
        self.rebuild(zero)

    def trainable_changed(self, zero: ZeroContext) -> None:
        self.rebuild(zero)

    def local_step(
        self, zero: ZeroContext, closure: Callable[[], float] | None, kwargs: dict[str, Any]
    ) -> Any:
        """The local step, refusing sparse gradients (the parameters are bucket views).

        Raises:
            RuntimeError: for a sparse gradient (see
                :func:`~compat_api._zero.validation.refuse_sparse_grads`), before anything
                changes; a closure's gradients are checked when it returns.
        """
        params = [p for group in zero.optim.param_groups for p in group["params"]]

        def check() -> None:
            refuse_sparse_grads(
                params,
                zero._optim_constructor,
                zero._optim_defaults,
                "parameters_as_bucket_view=True",
                "parameters_as_bucket_view=False",
            )

        if closure is None:
            check()
            return super().local_step(zero, None, kwargs)
        user_closure = closure

        def checked_closure() -> float:
            loss = user_closure()
            check()
            return loss

        return super().local_step(zero, checked_closure, kwargs)

    def broadcast_from(self, zero: ZeroContext, rank: int) -> list[Waitable]:
        return broadcast_buckets(self.buckets, zero.process_group, src=rank)

    def written_tensors(self, zero: ZeroContext) -> list[torch.Tensor]:
        # The trainable parameters are views of the buckets: one copy per bucket.
        return [bucket for per_rank in self.buckets for bucket in per_rank]

    def sync_params(self, zero: ZeroContext) -> None:
        for handle in broadcast_buckets(self.buckets, zero.process_group):
            handle.wait()
