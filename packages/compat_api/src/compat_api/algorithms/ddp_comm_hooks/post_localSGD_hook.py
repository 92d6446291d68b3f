"""Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook``.

The DDP half of post-local SGD: gradients are averaged globally for ``start_localSGD_iter``
iterations, then only within ``subgroup`` (or not at all); a model averager run after the
optimizer step (e.g. ``compat_api.algorithms.model_averaging.averagers.PeriodicModelAverager``)
keeps the replicas close.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
    >>> ddp_model.register_comm_hook(state, post_localSGD_hook)
"""

# No ``from __future__ import annotations`` here: DDP compares the hook's annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dist_runtime.averaging import allreduce_mean_future

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


def _check_member(group: Optional[ProcessGroup], name: str) -> None:
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of ``{name}``: its "
            "gradient all-reduce would fail on this rank. Pass a group that contains this rank "
            "(or None)."
        )


class PostLocalSGDState:
    """State of :func:`post_localSGD_hook`: global gradient all-reduce, then local.

    Gradients are all-reduced over ``process_group`` (None: the default group) until
    ``start_localSGD_iter`` iterations have run, then over ``subgroup`` (None: the intra-node
    subgroups, created on first use; needs CUDA to know the node size) when
    ``post_local_gradient_allreduce`` is true, or not synchronised at all when it is false.

    Args:
        process_group: the global group, or None.
        subgroup: the local group, or None.
        start_localSGD_iter: iterations of global all-reduce before local SGD starts.
        post_local_gradient_allreduce: whether to all-reduce within ``subgroup`` afterwards.

    Raises:
        ValueError: if this rank is not a member of a given ``process_group`` or ``subgroup``.
    """

    __slots__ = [
        "iter",
        "post_local_gradient_allreduce",
        "process_group",
        "start_localSGD_iter",
        "subgroup",
    ]

    def __init__(
        self,
        process_group: Optional[ProcessGroup],
        subgroup: Optional[ProcessGroup],
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        _check_member(process_group, "process_group")
        _check_member(subgroup, "subgroup")
        logger.info(
            "Local SGD starts after %s iterations of global all-reduce", start_localSGD_iter
        )
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0

    def maybe_increase_iter(
        self,
        bucket: dist.GradBucket,  # type: ignore[name-defined]
    ) -> None:
        """Count an iteration when its last bucket (bucket 0, reduced last) comes through."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Local SGD starts now, after %s iterations.", self.iter)


def post_localSGD_hook(
    state: PostLocalSGDState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for post-local SGD (register with ``register_comm_hook``).

    Args:
        state: the :class:`PostLocalSGDState`.
        bucket: DDP's gradient bucket (one flat tensor).

    Returns:
        A future holding the bucket's averaged (or untouched) gradients.
    """
    tensor = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_mean_future(tensor, state.process_group)
    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    if state.subgroup is None:
        # Intra-node subgroups, as in torch (raises without CUDA: pass ``subgroup`` on CPU).
        state.subgroup, _ = dist.new_subgroups()  # type: ignore[no-untyped-call]
    return allreduce_mean_future(tensor, state.subgroup)
