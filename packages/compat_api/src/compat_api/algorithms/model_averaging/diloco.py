"""DiLoCo-family model averagers (ours: torch ships none of these).

* DiLoCo (Douillard et al., https://arxiv.org/abs/2311.08105): every ``period`` inner steps the
  workers average the pseudo-gradient ``s - x`` (``s`` the parameters at the last sync, ``x`` the
  local ones) and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) applies it to ``s``.
* Streaming DiLoCo (https://arxiv.org/abs/2501.18512): ``fragments`` runs of parameters synced at
  staggered offsets; with ``overlap`` the all-reduce runs during the next ``overlap_delay`` inner
  steps and the result is blended into the local parameters; ``compression`` sends the
  pseudo-gradient in bf16 or blockwise int8 with error feedback.
* SlowMo (Wang et al., https://arxiv.org/abs/1910.00643, fairscale): heavy-ball SGD as the outer
  step (:meth:`DiLoCoAverager.slowmo`).

They are :class:`~compat_api.algorithms.model_averaging.averagers.ModelAverager` subclasses, so
``PostLocalSGDOptimizer`` and the post-local SGD DDP hook use them unchanged.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> from compat_api.algorithms.model_averaging import DiLoCoAverager
    >>> averager = DiLoCoAverager(period=100)
    >>> optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters()), averager)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

import functional_optim as fo
from compat_api.algorithms.model_averaging.averagers import ModelAverager, _member_group
from dist_runtime.averaging import EMPTY_PARAMS_MESSAGE, FlatParameterCache, params_to_average
from dist_runtime.averaging import average_parameters as average_flat
from dist_runtime.collective_failure import collective_guard, is_collective_failure
from dist_runtime.fragment_plan import (
    check_fragment_count,
    check_outer_args,
    due_fragments,
    fragment_offsets,
    plan_fragments,
)
from dist_runtime.hierarchy import build_period_groups, check_hierarchy
from dist_runtime.outer_sync import OuterSync
from dist_runtime.pseudo_gradient import PseudoGradientReducer
from dist_runtime.replica_check import replicas_identical

__all__ = ["DiLoCoAverager", "HierarchicalDiLoCoAverager", "default_outer", "slowmo_averager"]

Params = Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]]

#: What a failed sync leaves (the promise of ``CollectiveFailedError``).
_KEPT = (
    "The parameters and the averager's step, synced copies, outer-optimizer state and error "
    "feedback are as they were before the call, except that a mean whose all-reduce failed "
    "is dropped (its fragment is sent again at its next slot); state_dict() works."
)


def default_outer() -> fo.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return fo.sgd(lr=0.7, momentum=0.9, nesterov=True)


def _requiring_grad(params: Params) -> list[torch.Tensor]:
    """The parameters that require grad, from ``parameters()`` or param groups, in order."""
    selected: list[torch.Tensor] = []
    for entry in params:
        group = entry["params"] if isinstance(entry, dict) else [entry]
        selected.extend(p for p in group if p.requires_grad)
    return selected


def _param_bytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


class DiLoCoAverager(ModelAverager):
    """Outer-optimizer model averaging: DiLoCo, Streaming DiLoCo and SlowMo in one class.

    Call :meth:`average_parameters` after every inner ``optimizer.step()`` (or wrap the inner
    optimizer in ``PostLocalSGDOptimizer``). At the first call after the warm-up the parameters
    are averaged (plain mean) and copied as the synced state ``s``; or, with ``params``, ``s`` is
    the starting model, copied at construction (the paper's form: no initial average when every
    rank starts from the same weights, and the first sync one period later). Then each
    fragment, at its offset in every period, sends its pseudo-gradient ``s - x`` and its outer step
    ``s <- outer(s, mean(s - x))`` is written into the parameters (at once, or ``overlap_delay``
    steps later with ``x <- alpha * x + (1 - alpha) * s``). With ``outer=fo.sgd(lr=1.0)``, one
    fragment and no compression this is :class:`PeriodicModelAverager` up to float rounding.

    Args:
        outer: the outer optimizer, any ``functional_optim.GradientTransformation`` (default
            :func:`default_outer`: Nesterov SGD, lr 0.7, momentum 0.9).
        period: inner steps between two syncs of each parameter (DiLoCo's ``H``).
        warmup_steps: steps before the first sync (as ``PeriodicModelAverager``).
        process_group: the group to average over; None for the default group.
        fragments: number of fragments, each synced at its own offset within the period.
        overlap: run each fragment's all-reduce asynchronously, applied ``overlap_delay`` inner
            steps later.
        compression: None (the parameters' dtype), ``"bf16"``, ``"int8"`` or ``"int4"``
            (blockwise scales, error feedback kept in the averager's state).
        overlap_delay: inner steps between sending a fragment and applying it (with ``overlap``).
        overlap_alpha: weight of the local parameters in the blend (with ``overlap``; 0 makes
            the outer result overwrite them).
        params: the starting parameters (a model's ``parameters()`` or param groups; those
            that require grad), to copy as ``s`` now; needs ``warmup_steps=0``. Every rank
            must build its averager at the same time (a checksum all-reduce checks that the
            replicas are identical, and averages them when they are not). Later calls must
            pass these parameters, all with a gradient.

    A sync whose collective fails (a dead or hung peer) raises
    :class:`~dist_runtime.collective_failure.CollectiveFailedError` naming the failed rank(s),
    having applied nothing; the means whose all-reduce failed are dropped, so
    :meth:`state_dict` still works. To go on in process, re-form the group and set
    :attr:`process_group` to it, then repeat the call (``PostLocalSGDOptimizer.step()`` undoes
    its local step first, so its retry is the same step).

    Attributes:
        step: calls so far (as torch's averagers).
        bytes_communicated: payload bytes this rank handed to collectives so far.
        process_group: the group averaged over; assign a re-formed group to go on after a
            failure (later syncs use it; this rank must be a member).

    Raises:
        ValueError: for ``period < 1``, a negative ``warmup_steps``, ``fragments < 1``, an
            unknown ``compression``, with ``overlap`` an ``overlap_delay`` outside
            ``[1, period)`` or an ``overlap_alpha`` outside ``[0, 1]``, or a group this rank is
            not a member of; at
            the first sync, before anything is built, for more fragments than parameters.
        TypeError: if ``outer`` is not a ``GradientTransformation``.
    """

    def __init__(
        self,
        outer: fo.GradientTransformation | None = None,
        *,
        period: int,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
        fragments: int = 1,
        overlap: bool = False,
        compression: str | None = None,
        overlap_delay: int = 1,
        overlap_alpha: float = 0.5,
        params: Params | None = None,
    ) -> None:
        check_outer_args(
            period, warmup_steps, fragments, compression, overlap, overlap_delay, overlap_alpha
        )
        if params is not None and warmup_steps != 0:
            raise ValueError(
                f"Arg ``params`` needs ``warmup_steps=0`` (got {warmup_steps}): the start copy "
                "is taken at construction; with a warm-up, the first sync after it averages."
            )
        if outer is not None and not isinstance(outer, fo.GradientTransformation):
            raise TypeError(
                f"Arg ``outer`` must be a functional_optim GradientTransformation (e.g. "
                f"fo.sgd(lr=0.7, momentum=0.9, nesterov=True)), got {type(outer).__name__}."
            )
        super().__init__(process_group)
        self.outer = outer if outer is not None else default_outer()
        self.period = period
        self.warmup_steps = warmup_steps
        self.fragments = fragments
        self.overlap = overlap
        self.compression = compression
        self.delay = overlap_delay if overlap else 0
        self.alpha = overlap_alpha if overlap else 0.0
        self._offsets = fragment_offsets(period, fragments)
        self._reducer = PseudoGradientReducer(self.process_group, compression)
        self._sync: OuterSync | None = None
        self._saved_sync: list[dict[str, Any]] | None = None
        self._setup_bytes = 0
        self._cache = FlatParameterCache(max_entries=1)
        if params is not None:
            self._start_from(_requiring_grad(params))

    @classmethod
    def slowmo(
        cls,
        period: int = 48,
        slowmo_momentum: float = 0.5,
        slowmo_lr: float = 1.0,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> DiLoCoAverager:
        """SlowMo with local SGD as the base algorithm (fairscale's defaults).

        fairscale's slow-momentum step ``m <- beta * m + (s - mean(x)) / lr_base``,
        ``s <- s - slowmo_lr * lr_base * m`` is, for a constant base learning rate, heavy-ball
        SGD on the pseudo-gradient: ``outer = fo.sgd(lr=slowmo_lr, momentum=slowmo_momentum)``.

        Args:
            period: inner steps between slow-momentum steps (``slowmo_frequency``).
            slowmo_momentum: the slow momentum factor ``beta``.
            slowmo_lr: the slow learning rate.
            warmup_steps: steps before the first sync.
            process_group: the group; None for the default group.
            **kwargs: further :class:`DiLoCoAverager` arguments (``fragments``, ...).
        """
        outer = fo.sgd(lr=slowmo_lr, momentum=slowmo_momentum)
        return cls(
            outer, period=period, warmup_steps=warmup_steps, process_group=process_group, **kwargs
        )

    @property
    def process_group(self) -> ProcessGroup:
        """The group averaged over."""
        return self._process_group

    @process_group.setter
    def process_group(self, process_group: ProcessGroup | None) -> None:
        """Average over ``process_group`` from the next sync on (e.g. a re-formed group).

        Raises:
            ValueError: if this rank is not a member (nothing changes).
        """
        group = _member_group(process_group)
        self._process_group = group
        reducer: PseudoGradientReducer | None = getattr(self, "_reducer", None)
        if reducer is not None:
            reducer.set_group(group)

    @property
    def bytes_communicated(self) -> int:
        """Cumulative payload bytes this rank handed to collectives (initial average included)."""
        return self._setup_bytes + self._reducer.bytes_sent

    @property
    def fragment_plan(self) -> list[list[int]]:
        """Parameter indices of each fragment (empty before the first sync)."""
        return [] if self._sync is None else [f.indices for f in self._sync.fragments]

    def _start_from(self, params: list[torch.Tensor]) -> None:
        if not params:
            raise ValueError(EMPTY_PARAMS_MESSAGE)
        with torch.no_grad():
            self._build(params, check_replicas=True)

    def _build(self, params: list[torch.Tensor], check_replicas: bool = False) -> bool:
        """Build the sync state; return True when this call aligned the replicas.

        The replicas are averaged, unless ``check_replicas`` and a checksum shows they are
        identical already (the start copy of ``params=``).
        """
        check_fragment_count(self.fragments, len(params))
        plan = plan_fragments([p.numel() for p in params], self.fragments)
        if self._saved_sync is not None:
            sync = OuterSync(params, plan, self.outer, self._reducer)
            sync.load_state_dict(self._saved_sync)
            self._sync, self._saved_sync = sync, None
            return False
        identical = False
        if check_replicas:
            identical, sent = replicas_identical(params, self.process_group)
            self._setup_bytes += sent
        if not identical:
            average_flat(params, self.process_group, self._cache)
            self._setup_bytes += _param_bytes(params)
        self._sync = OuterSync(params, plan, self.outer, self._reducer)
        return True

    def average_parameters(self, params: Params) -> None:
        """Sync the fragments due at this step (see the class docstring); increments ``step``.

        Args:
            params: a model's parameters or an optimizer's parameter groups (those with a
                gradient are averaged; pass the same ones every step).

        Raises:
            ValueError: if no parameter has a gradient, or there are more fragments than
                parameters (at the first sync).
            RuntimeError: if the parameters changed since the first sync.
            CollectiveFailedError: if a collective failed (a dead or hung peer), naming it;
                nothing was applied and ``step`` is unchanged (see the class docstring).
        """
        since = self.step - self.warmup_steps
        if since >= 0:
            selected = params_to_average(params)
            if not selected:
                raise ValueError(EMPTY_PARAMS_MESSAGE)
            with torch.no_grad():
                self._sync_step(since, selected)
        self.step += 1

    def _sync_step(self, since: int, params: list[torch.Tensor]) -> None:
        """Wait for every mean this step needs, then apply them (nothing applied on failure).

        The fragments are disjoint and a fragment is never applied and sent at the same step,
        so sending before applying gives what applying first gives.
        """
        with collective_guard("DiLoCoAverager.average_parameters", self.process_group, _KEPT):
            if self._sync is None and self._build(params):
                return
            sync = self._sync
            assert sync is not None
            sync.check_params(params)
            due = sync.due(self.step)
            sends = due_fragments(since, self.period, self._offsets)
            try:
                for index in due:
                    sync.wait(index)
                for index in sends:
                    sync.send(index, params, apply_at=self.step + self.delay)
                if self.delay == 0:
                    for index in sends:
                        sync.wait(index)
            except BaseException as exc:
                if is_collective_failure(exc):
                    sync.drop_failed()
                raise
        for index in due:
            sync.apply(index, params, self.alpha)
        if self.delay == 0:
            for index in sends:
                sync.apply(index, params, self.alpha)

    def state_dict(self) -> dict[str, Any]:
        """The step, the configuration and every fragment's sync state (copies).

        In-flight all-reduces are waited for so that their results are saved: a run resumed
        from this state (and the model's and inner optimizer's) continues bitwise.

        Returns:
            A dict of tensors, numbers and lists (``torch.save``-able with ``weights_only``).

        Raises:
            CollectiveFailedError: if an all-reduce in flight failed (it is dropped: the next
                call returns the state without it).
        """
        if self._sync is not None:
            sync = self._sync
            with collective_guard("DiLoCoAverager.state_dict", self.process_group, _KEPT):
                try:
                    sync.wait_all()
                except BaseException as exc:
                    if is_collective_failure(exc):
                        sync.drop_failed()
                    raise
            sync_state: list[dict[str, Any]] | None = sync.state_dict()
        else:
            sync_state = self._saved_sync
        return {
            "step": self.step,
            "period": self.period,
            "warmup_steps": self.warmup_steps,
            "fragments": self.fragments,
            "compression": self.compression,
            "delay": self.delay,
            "bytes_communicated": self.bytes_communicated,
            "sync": sync_state,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the sync state is rebuilt at the next call.

        Args:
            state_dict: a dict from :meth:`state_dict` of an averager built the same way.

        Raises:
            ValueError: if the period, fragments, compression or delay differ.
        """
        for key in ("period", "fragments", "compression", "delay"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(
                    f"the state was saved with {key}={state_dict[key]!r}, this averager has "
                    f"{key}={getattr(self, key)!r}: build it with the same arguments"
                )
        if self._sync is not None:
            self._sync.drop_failed()  # nothing may be left in flight; failures do not matter
        self.step = int(state_dict["step"])
        self._sync = None
        self._saved_sync = state_dict["sync"]
        self._setup_bytes = int(state_dict["bytes_communicated"])
        self._reducer.bytes_sent = 0


def slowmo_averager(
    period: int = 48,
    slowmo_momentum: float = 0.5,
    slowmo_lr: float = 1.0,
    warmup_steps: int = 0,
    process_group: ProcessGroup | None = None,
    **kwargs: Any,
) -> DiLoCoAverager:
    """SlowMo as a :class:`DiLoCoAverager` (same as :meth:`DiLoCoAverager.slowmo`)."""
    return DiLoCoAverager.slowmo(
        period, slowmo_momentum, slowmo_lr, warmup_steps, process_group, **kwargs
    )


class HierarchicalDiLoCoAverager(ModelAverager):
    """Two levels: plain averaging within groups every ``intra_period`` steps, DiLoCo over all.

    Like :class:`HierarchicalModelAverager` with two levels, except that the top level is a
    :class:`DiLoCoAverager`: groups of ``intra_group_size`` consecutive ranks (a node) average
    their parameters every ``intra_period`` steps, and every ``period`` steps all ranks run the
    outer step (the intra-group average is skipped at those steps; the outer step overrides it).

    Args:
        outer: the outer optimizer of the top level (default :func:`default_outer`).
        period: steps between two outer syncs over all ranks.
        intra_period: steps between two averagings within a group (below ``period``).
        intra_group_size: ranks per group; must divide the size of ``process_group``.
        warmup_steps: steps before any averaging.
        process_group: the top-level group; None for the default group.
        **kwargs: further :class:`DiLoCoAverager` arguments for the top level.

    Raises:
        ValueError: for an ``intra_period`` below 1 or not below ``period``, a group size that
            does not divide the group, and the :class:`DiLoCoAverager` errors.
    """

    def __init__(
        self,
        outer: fo.GradientTransformation | None = None,
        *,
        period: int,
        intra_period: int,
        intra_group_size: int,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(intra_period, bool) or not isinstance(intra_period, int):
            raise ValueError(f"Arg ``intra_period`` must be an integer, got {intra_period!r}.")
        if not 1 <= intra_period < period:
            raise ValueError(
                f"Arg ``intra_period`` ({intra_period}) must be at least 1 and below ``period`` "
                f"({period}): the groups average more often than all ranks sync."
            )
        self._top = DiLoCoAverager(
            outer,
            period=period,
            warmup_steps=warmup_steps,
            process_group=process_group,
            **kwargs,
        )
        super().__init__(process_group)
        levels = check_hierarchy(
            {intra_period: intra_group_size, period: dist.get_world_size(self.process_group)},
            dist.get_world_size(self.process_group),
        )
        self.intra_group: ProcessGroup = build_period_groups(levels, self.process_group)[
            intra_period
        ]
        self.period = period
        self.intra_period = intra_period
        self.warmup_steps = warmup_steps
        self._intra_bytes = 0
        self._cache = FlatParameterCache(max_entries=1)

    @property
    def bytes_communicated(self) -> int:
        """Payload bytes this rank handed to collectives, both levels together."""
        return self._intra_bytes + self._top.bytes_communicated

    def average_parameters(self, params: Params) -> None:
        """Average within the group and/or run the outer sync when due; increments ``step``.

        Args:
            params: a model's parameters or an optimizer's parameter groups.
        """
        since = self.step - self.warmup_steps
        if since > 0 and since % self.intra_period == 0 and since % self.period != 0:
            selected = params_to_average(params)
            if not selected:
                raise ValueError(EMPTY_PARAMS_MESSAGE)
            average_flat(selected, self.intra_group, self._cache)
            self._intra_bytes += _param_bytes(selected)
        self._top.step = self.step
        self._top.average_parameters(params)
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        """The top level's state plus the intra-group bytes."""
        return {"top": self._top.state_dict(), "intra_bytes": self._intra_bytes}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self._top.load_state_dict(state_dict["top"])
        self.step = self._top.step
        self._intra_bytes = int(state_dict["intra_bytes"])
