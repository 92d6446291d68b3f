"""ZeroRedundancyOptimizer's ``partition="flat"`` mode as a strategy.

The trainable parameters of each ``(dtype, device)`` are laid end to end and every rank gets one
equal, contiguous shard (parameters may straddle ranks), so the optimizer state is balanced to
within one element per buffer whatever the parameter sizes; the shards are synced by one
all-gather per buffer (on gloo: one broadcast per shard, all in flight at once). The local
optimizer must be elementwise (see :func:`dist_runtime.flat_shards.check_elementwise_optimizer`).

Gradients: by default they are taken as already averaged (DDP's all-reduce). With the DDP hook
:func:`compat_api.algorithms.ddp_comm_hooks.zero_flat_hook.zero_flat_hook` (DDP then
communicates nothing) each ready gradient bucket goes to :meth:`FlatStrategy.grads_ready`
(through :func:`flat_controller`), which sends its slices to their shard owners during the
backward pass (:class:`dist_runtime.flat_grad_exchange.GradExchange`); the step completes the
reduction: reduce-scatter + all-gather = one all-reduce's bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from compat_api._zero.layout import sync_param_groups
from compat_api._zero.strategy import ZeroContext, ZeroStrategy
from compat_api._zero.validation import refuse_sparse_grads
from dist_runtime.block_state import BlockFormat
from dist_runtime.flat_grad_exchange import GradExchange
from dist_runtime.flat_shards import FlatShards
from dist_runtime.param_sync import Waitable
from dist_runtime.piece_state import Piece
from dist_runtime.streaming_consolidation import consolidate_piece_states, load_global_state
from functional_optim.lowbit import Sharing, sharing_context

__all__ = ["FlatStrategy", "flat_controller"]


class FlatStrategy(ZeroStrategy):
    """Equal contiguous shards of flat buffers, elementwise local optimizer.

    Args:
        all_params: every parameter in global ``state_dict`` index order.
        process_group: the group to shard over.

    Attributes:
        shards: the flat buffers, this rank's pieces and their collectives.
        reduce_grads: the gradients are local (unsynced): reduce-scatter them before each step
            (set by ``zero_flat_hook``).
    """

    def __init__(self, all_params: list[torch.Tensor], process_group: Any) -> None:
        super().__init__()
        self.shards = FlatShards(all_params, process_group)
        self.consolidated: dict[int, Any] | None = None
        self.reduce_grads = False
        self._reduced = False
        self._exchange: GradExchange | None = None
        #: How the last step reduced the gradients: "exchange" (overlapped with the backward
        #: pass by the hook), "reduce_scatter" (after it) or "" (taken as already averaged).
        self.last_reduction = ""
        self._sharing: tuple[int, Sharing] | None = None

    def local_param_groups(self, zero: ZeroContext) -> list[dict[str, Any]]:
        return self.shards.local_param_groups(zero.param_groups)

    def block_sharing(self) -> Sharing:
        """Where the pieces lie in their params, for low-bit optimizer states (cached)."""
        if self._sharing is None or self._sharing[0] != len(self.shards.pieces):
            self._sharing = (len(self.shards.pieces), self.shards.block_sharing())
        return self._sharing[1]

    def block_formats(self, zero: ZeroContext) -> dict[int, BlockFormat]:
        """The codes/scales layout of each param of a low-bit local optimizer, by index (the
        groups' ``block_size`` and ``kind``: see :mod:`functional_optim.lowbit`)."""
        formats: dict[int, BlockFormat] = {}
        for group in zero.param_groups:
            if "block_size" in group and "kind" in group:
                fmt = BlockFormat(group["block_size"], 2 if group["kind"] == "int4" else 1)
                for p in group["params"]:
                    formats[self.shards.index_of[p]] = fmt
        return formats

    def lowbit_context(self) -> contextlib.AbstractContextManager[None]:
        return sharing_context(self.block_sharing())

    def init_optimizer(self, zero: ZeroContext) -> None:
        with sharing_context(self.block_sharing()):
            super().init_optimizer(zero)

    def add_param_group(self, zero: ZeroContext, new_params: list[torch.Tensor]) -> None:
        # The new parameters get flat buffers of their own; existing shards keep their state.
        self.shards.add_params(new_params)
        with sharing_context(self.block_sharing()):
            zero.optim.add_param_group(self.shards.local_param_groups([zero.param_groups[-1]])[0])

    def grads_ready(self, key: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """A DDP gradient bucket is ready: start sending its slices to their shard owners.

        Called by ``zero_flat_hook`` during the backward pass; sets :attr:`reduce_grads`.
        """
        self.reduce_grads = True
        if self._exchange is None:
            self._exchange = GradExchange(self.shards)
        self._exchange.add(key, params, grads)

    def prepare_grads(self, zero: ZeroContext) -> None:
        """Give the pieces their gradients: reduced (once per step) or attached as they are.

        With :attr:`reduce_grads` the exchange started by the hook is completed; if it did not
        cover the shards (every rank alike) the local gradients are reduce-scattered now.

        Raises:
            RuntimeError: for a sparse gradient (the pieces are views of flat buffers; see
                :func:`~compat_api._zero.validation.refuse_sparse_grads`), before anything
                changes.
        """
        refuse_sparse_grads(
            self.shards.params,
            zero._optim_constructor,
            zero._optim_defaults,
            "partition='flat'",
            "partition='sorted_greedy'",
        )
        if not self.reduce_grads:
            self.shards.attach_local_grads()
        elif not self._reduced:
            if self._exchange is not None and self._exchange.finish():
                self.last_reduction = "exchange"
            else:
                self.shards.reduce_scatter_grads(average=True)
                self.last_reduction = "reduce_scatter"
            self._reduced = True

    def local_step(
        self, zero: ZeroContext, closure: Callable[[], float] | None, kwargs: dict[str, Any]
    ) -> Any:
        """Gradients first, then the shard's update.

        A closure runs before the gradients are reduce-scattered (it may recompute them), once,
        as the elementwise optimizers call it.
        """
        sync_param_groups(zero.param_groups, zero.optim.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.prepare_grads(zero)
        with sharing_context(self.block_sharing()):  # low-bit states: blocks of whole params
            result = zero.optim.step(**kwargs)
        self._reduced = False  # the next step reduces anew
        sync_param_groups(zero.optim.param_groups, zero.param_groups)
        return loss if closure is not None else result

    def sync_params(self, zero: ZeroContext) -> None:
        self.shards.all_gather_params()

    def broadcast_from(self, zero: ZeroContext, rank: int) -> list[Waitable]:
        raise RuntimeError(
            "partition='flat' syncs every shard at once (all-gather); use `_sync_params()`"
        )

    def written_tensors(self, zero: ZeroContext) -> list[torch.Tensor]:
        # Parameters and pieces are views of the flat buffers: one copy per buffer.
        return [bucket.flat for bucket in self.shards.buckets]

    def owned_pieces(self, zero: ZeroContext) -> dict[torch.Tensor, Piece]:
        return self.shards.piece_info

    def consolidate(
        self, zero: ZeroContext, to: int, device: torch.device | None
    ) -> list[dict[str, Any]]:
        # Streamed: one rank's shard at a time, straight to the CPU.
        self.consolidated = consolidate_piece_states(
            zero.optim,
            self.shards.piece_info,
            to,
            zero.process_group,
            device,
            self.block_formats(zero),
        )
        return [] if self.consolidated is None else [{}]

    def global_state_dict(
        self, zero: ZeroContext, base: dict[str, Any], gathered: list[dict[str, Any]]
    ) -> dict[str, Any]:
        assert self.consolidated is not None
        base["state"] = dict(sorted({**base["state"], **self.consolidated}.items()))
        return base

    def load_state_dict(self, zero: ZeroContext, state_dict: dict[str, Any]) -> dict[int, Any]:
        """Load each piece's slice of ``state_dict``; the wrapper keeps no state.

        Raises:
            IndexError: if the state names a parameter index that does not exist (torch's
                type), before anything is loaded.
        """
        state = state_dict["state"]
        count = len(zero._all_params)
        for index in state:
            if not 0 <= index < count:
                raise IndexError(
                    f"state_dict has state for parameter index {index}, but the optimizer has "
                    f"only {count} parameters"
                )
        before = dict(zero.optim.state)
        try:
            with sharing_context(self.block_sharing()):
                load_global_state(
                    zero.optim, self.shards.piece_info, state, self.block_formats(zero)
                )
        except Exception:
            zero.optim.state.clear()  # a malformed entry: leave the state as it was
            zero.optim.state.update(before)
            raise
        return {}


def flat_controller(zero: Any) -> FlatStrategy:
    """The flat strategy of ``zero`` (what ``zero_flat_hook`` drives).

    Raises:
        ValueError: if ``zero`` is not a ZeroRedundancyOptimizer with ``partition="flat"``.
    """
    strategy = getattr(zero, "strategy", None)
    if not isinstance(strategy, FlatStrategy):
        raise ValueError(
            "zero_flat_hook needs a ZeroRedundancyOptimizer(..., partition='flat') as its state: "
            "its step reduce-scatters the gradients that DDP then leaves unsynchronised; got "
            f"{type(zero).__name__}. Register the hook as ddp.register_comm_hook(zero, "
            "zero_flat_hook)"
        )
    return strategy
