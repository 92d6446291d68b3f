"""DiLoCo after a data-parallel warm start (the DiLoCo paper's regime).

Douillard et al. (https://arxiv.org/abs/2311.08105) start DiLoCo from a model pre-trained with
plain data parallelism. :class:`WarmStartDiLoCoAverager` runs both phases on one schedule: for
the first ``warm_start_steps`` steps :meth:`~WarmStartDiLoCoAverager.average_gradients` replaces
every gradient by its mean over the group before the inner step (what DDP's ``allreduce_hook``
does), so the replicas stay identical; at the end of that phase their values become the synced
copy ``s`` (a checksum all-reduce confirms the replicas agree; they are averaged if not), and
DiLoCo's outer syncs follow every ``period`` steps from there. With a DDP module and
``post_localSGD_hook`` (``start_localSGD_iter=warm_start_steps``) in place of
``average_gradients`` the schedule is the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

import functional_optim as fo
from compat_api.algorithms.model_averaging.diloco import DiLoCoAverager, Params
from dist_runtime.averaging import params_to_average
from dist_runtime.grad_mean import allreduce_grad_mean

__all__ = ["WarmStartDiLoCoAverager"]


def check_warm_start_steps(warm_start_steps: int) -> None:
    """Raise ValueError unless ``warm_start_steps`` is a non-negative integer."""
    if (
        isinstance(warm_start_steps, bool)
        or not isinstance(warm_start_steps, int)
        or warm_start_steps < 0
    ):
        raise ValueError(
            f"Arg ``warm_start_steps`` must be a non-negative integer (data-parallel steps "
            f"before DiLoCo; 0 for none), got {warm_start_steps!r}."
        )


class WarmStartDiLoCoAverager(DiLoCoAverager):
    """``warm_start_steps`` data-parallel steps, then :class:`DiLoCoAverager`.

    Per step: ``backward()``, :meth:`average_gradients`, ``optimizer.step()``,
    :meth:`average_parameters`. Steps ``0 .. W-1`` (``W = warm_start_steps``) average the
    gradients; at the call of step ``W - 1`` the parameters become the synced copy, and the
    outer syncs run at steps ``W - 1 + period``, ``W - 1 + 2 period``, ... With ``W = 0`` this
    is :class:`DiLoCoAverager` (its first call averages the replicas and takes the copy).

    Args:
        outer: the outer optimizer (default: DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9).
        period: inner steps between two outer syncs.
        warm_start_steps: data-parallel steps first (>= 0).
        **kwargs: further :class:`DiLoCoAverager` arguments (``fragments``, ``compression``,
            ``process_group``, ...), not ``warmup_steps`` or ``params``.

    Raises:
        ValueError: for a negative or non-integer ``warm_start_steps`` or a ``warmup_steps`` /
            ``params`` argument (checked before anything is built), and the
            :class:`DiLoCoAverager` errors.
    """

    def __init__(
        self,
        outer: fo.GradientTransformation | None = None,
        *,
        period: int,
        warm_start_steps: int,
        **kwargs: Any,
    ) -> None:
        check_warm_start_steps(warm_start_steps)
        for name in ("warmup_steps", "params"):
            if name in kwargs:
                raise ValueError(
                    f"WarmStartDiLoCoAverager takes no ``{name}``: the synced copy is taken "
                    "at the end of the ``warm_start_steps`` data-parallel steps."
                )
        super().__init__(outer, period=period, warmup_steps=max(0, warm_start_steps - 1), **kwargs)
        self.warm_start_steps = warm_start_steps
        self._grad_bytes = 0

    @property
    def bytes_communicated(self) -> int:
        """Payload bytes this rank handed to collectives: gradients, checksum and syncs."""
        return self._grad_bytes + super().bytes_communicated

    @property
    def in_warm_start(self) -> bool:
        """Whether the next step is a data-parallel one."""
        return self.step < self.warm_start_steps

    def average_gradients(self, params: Iterable[torch.Tensor] | Params) -> None:
        """Average the gradients over the group during the warm start (else do nothing).

        Call it after ``backward()`` and before ``optimizer.step()``.

        Args:
            params: a model's parameters or param groups (those with a gradient).
        """
        if self.in_warm_start:
            selected = params_to_average(params)
            self._grad_bytes += allreduce_grad_mean(selected, self.process_group)

    def _build(self, params: list[torch.Tensor], check_replicas: bool = False) -> bool:
        # After a warm start the replicas agree: a checksum, not a full average.
        return super()._build(params, check_replicas=check_replicas or self.warm_start_steps > 0)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`DiLoCoAverager.state_dict` plus the gradient bytes."""
        state = super().state_dict()
        state["warm_start_steps"] = self.warm_start_steps
        state["grad_bytes"] = self._grad_bytes
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: if it was saved with another ``warm_start_steps`` (and the
                :class:`DiLoCoAverager` checks).
        """
        if state_dict["warm_start_steps"] != self.warm_start_steps:
            raise ValueError(
                f"the state was saved with warm_start_steps={state_dict['warm_start_steps']}, "
                f"this averager has {self.warm_start_steps}: build it with the same arguments"
            )
        super().load_state_dict(state_dict)
        self._grad_bytes = int(state_dict["grad_bytes"])
