"""ZeroRedundancyOptimizer's extensions beyond torch: sharded clipping and sharded checkpoints.

They work the same in every mode: each reads only the strategy's ``owned_pieces`` (where each
tensor of the local optimizer lies in the global parameters) and ``shard_grads``.
"""

from __future__ import annotations

from typing import Any

import torch

from compat_api._zero.dcp_native import mark_has_state
from compat_api._zero.layout import sync_param_groups
from compat_api._zero.strategy import ZeroStrategy
from dist_runtime.dcp_state import load_shard_state_dict, shard_state_dict
from dist_runtime.flat_shards import clip_grads_by_global_norm
from dist_runtime.sharded_checkpoint import load_optimizer_shards, save_optimizer_shards

__all__ = ["ShardedExtensions"]


class ShardedExtensions:
    """Mixin of :class:`~compat_api.zero_redundancy_optimizer.ZeroRedundancyOptimizer`."""

    strategy: ZeroStrategy
    optim: Any
    param_groups: list[dict[str, Any]]
    process_group: Any
    _all_params: list[torch.Tensor]
    _default_device: torch.device

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients by their global norm, computed from the shards in one all-reduce.

        Call on all ranks before :meth:`step`. Equals ``torch.nn.utils.clip_grad_norm_`` over
        every parameter (up to rounding); only the gradients this rank's optimizer reads are
        scaled, so the parameters after the step are those of a fully clipped run.

        Args:
            max_norm: the largest allowed norm.
            norm_type: the p of the p-norm (``inf`` for the max norm).
            error_if_nonfinite: raise if the total norm is nan or inf.

        Returns:
            The total norm before clipping (0-d tensor).
        """
        return clip_grads_by_global_norm(
            self.strategy.shard_grads(self),  # type: ignore[arg-type]
            max_norm,
            norm_type,
            error_if_nonfinite,
            self.process_group,
            self._default_device,
        )

    def _pieces(self) -> Any:
        return self.strategy.owned_pieces(self)  # type: ignore[arg-type]

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state for ``torch.distributed.checkpoint`` (call on all ranks).

        The keys do not depend on the partition or the world size, so ``dcp.load`` into the
        dict of another run (another world size, any partition) reshards: each rank reads the
        chunks that overlap its own shard. ``state.<index>.<name>`` is the flattened state
        ``name`` of global parameter ``index`` (a ``ShardedTensor`` where the flat partition
        splits it, else a tensor or scalar); ``meta`` holds the sizes and hyperparameters.
        Tensors are views of the live state: ``dcp.load`` writes it in place.
        An optimizer without state is given its initial state first (a zero-gradient,
        zero-learning-rate step of the local optimizer, as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does) so that a
        fresh optimizer has load targets; the parameters do not change.

        Returns:
            A flat dict for ``dcp.save`` / ``dcp.load``.

        Example::

            >>> dcp.save(zero.sharded_state_dict(), checkpoint_id=path)
            >>> # later, at any world size:
            >>> state = zero.sharded_state_dict()
            >>> dcp.load(state, checkpoint_id=path)
            >>> zero.load_sharded_state_dict(state)

        .. note:: torch's DCP planner reads ShardedTensor attributes that torch 2.13 marks
            deprecated, so a direct ``dcp.save``/``dcp.load`` of this dict may emit torch's
            ``FutureWarning`` about ShardedTensor; :meth:`save_sharded` and
            :meth:`load_sharded` silence it.
        """
        self.strategy.check_ready()
        sync_param_groups(self.param_groups, self.optim.param_groups)
        return shard_state_dict(
            self.optim, self._pieces(), self._all_params, self.param_groups, self.process_group
        )

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`sharded_state_dict` that ``dcp.load`` filled (state and hyperparameters).

        Args:
            state_dict: the dict returned by :meth:`sharded_state_dict` of this instance, after
                ``dcp.load``.

        Raises:
            ValueError: if the param groups or parameter sizes differ from the saved ones.
        """
        self.strategy.check_ready()
        with self.strategy.lowbit_context():
            load_shard_state_dict(self.optim, self._pieces(), state_dict)
        sync_param_groups(self.optim.param_groups, self.param_groups)
        mark_has_state(self)

    def save_sharded(self, root: str, extra: dict[str, Any] | None = None) -> str:
        """Write this rank's optimizer shard with torch.distributed.checkpoint (all ranks).

        The folder-based wrapper of :meth:`sharded_state_dict`: no state is gathered, every rank
        writes its own file in parallel, then rank 0 switches ``<root>/LATEST`` to the new folder
        (a crash before that keeps the previous checkpoint; the next successful save removes the
        crashed folder, never the committed one). An optimizer without state saves none.
        Any world size and partition reloads it (:meth:`load_sharded`), and so does a plain
        optimizer (:func:`dist_runtime.sharded_checkpoint.load_plain_optimizer`).

        Args:
            root: the checkpoint root, shared by all ranks.
            extra: replicated values saved alongside (e.g. the model's ``state_dict()``).

        Returns:
            The committed checkpoint folder.
        """
        sync_param_groups(self.param_groups, self.optim.param_groups)
        return save_optimizer_shards(
            root,
            self.optim,
            self._pieces(),
            self._all_params,
            self.param_groups,
            self.process_group,
            extra,
        )

    def load_sharded(self, root: str, extra: dict[str, Any] | None = None) -> None:
        """Load the checkpoint ``<root>/LATEST`` (or a folder) written by :meth:`save_sharded`.

        Args:
            root: the checkpoint root or folder.
            extra: names to read back into (tensors are copied in place).
        """
        with self.strategy.lowbit_context():
            load_optimizer_shards(root, self.optim, self._pieces(), self.process_group, extra)
        sync_param_groups(self.optim.param_groups, self.param_groups)
        mark_has_state(self)
