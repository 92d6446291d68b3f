"""Undo an optimizer step whose collective failed, so the caller can retry it.

A distributed step mutates local data before (or while) it communicates: a local optimizer
updates its shard, then a broadcast or all-gather writes the other ranks' shards into the
parameters in place. When a peer dies half-way, the parameters hold a mix of old, new and
partly received values. :func:`rollback_on_failure` copies what the step may write (parameters
and optimizer state) before it runs and copies it back, in place, when a collective fails, then
raises :class:`~dist_runtime.collective_failure.CollectiveFailedError`. Tensors keep their
identity and storage (views into flat buffers stay valid), so an in-process retry after
re-forming the group sees exactly the pre-step state.

Cost: one copy of the given parameters and of their optimizer state per step (memory
bandwidth only; see ``benchmarks/step_rollback.py``). Pass only the tensors the step can write.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> with rollback_on_failure("ZeroRedundancyOptimizer.step", optim, params, group):
    ...     optim.step()
    ...     broadcaster.sync()
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from dist_runtime.collective_failure import collective_guard, is_collective_failure

__all__ = ["OptimizerSnapshot", "restore_on_failure", "rollback_on_failure"]

ROLLED_BACK = "Parameters and optimizer state are as they were before the call."


def _copy_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _fits(buffer: Any, value: torch.Tensor) -> bool:
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.shape == value.shape
        and buffer.dtype == value.dtype
        and buffer.device == value.device
    )


class _Copies:
    """Tensor copies into reused buffers, batched into one ``_foreach_copy_`` call."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    def save_into(self, buffer: Any, value: Any) -> Any:
        """Queue ``value`` into ``buffer`` when it fits (no allocation), else copy it now."""
        if isinstance(value, torch.Tensor) and _fits(buffer, value):
            self.targets.append(buffer)
            self.sources.append(value.detach())
            return buffer
        return _copy_value(value)

    def run(self) -> None:
        if self.targets:
            with torch.no_grad():
                torch._foreach_copy_(self.targets, self.sources)
        self.targets, self.sources = [], []


class OptimizerSnapshot:
    """Copies of some parameters and of an optimizer's state, restorable in place.

    Keep one snapshot and call :meth:`capture` before every step: the copies go into the
    buffers of the previous capture (no allocation, no page faults after the first step).

    Args:
        optimizer: the optimizer whose state and hyperparameters to save (None: parameters
            only).
        params: the tensors whose values to save (e.g. every parameter a sync writes into).
        state_params: the keys of ``optimizer.state`` to save (default: every tensor of its
            param groups).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        params: Iterable[torch.Tensor],
        state_params: Iterable[torch.Tensor] | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._params = list(params)
        self._keys: Sequence[torch.Tensor] = []
        if optimizer is not None:
            self._keys = (
                [p for g in optimizer.param_groups for p in g["params"]]
                if state_params is None
                else list(state_params)
            )
        self._param_copies: list[torch.Tensor | None] = [None] * len(self._params)
        self._state: list[dict[str, Any] | None] = [None] * len(self._keys)
        self._groups: list[dict[str, Any]] = []
        # What the last full capture saw: (targets, sources) of every state tensor, the other
        # state entries, and the state layout. A later capture whose state tensors are the same
        # objects (optimizers update them in place) is one _foreach_copy_.
        self._plan: tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[int, str]]] | None
        self._plan = None
        self._layout: list[int] = []
        self._tensor_slots: list[tuple[int, str]] = []
        self.capture()

    def _capture_fast(self) -> bool:
        """Capture through the plan of the previous capture; False if the state changed shape."""
        if self._plan is None or self._optimizer is None:
            return False
        state = self._optimizer.state
        live_states = [state.get(key) for key in self._keys]
        if [-1 if s is None else len(s) for s in live_states] != self._layout:
            return False
        targets, sources, others = self._plan
        for (i, name), source in zip(self._tensor_slots, sources):
            live = live_states[i]
            if live is None or live.get(name) is not source:
                return False
        params = [p.detach() for p in self._params]
        copies = [c for c in self._param_copies if c is not None]
        if len(copies) != len(params) or any(
            c.shape != p.shape or c.dtype != p.dtype for c, p in zip(copies, params)
        ):
            return False
        with torch.no_grad():
            torch._foreach_copy_(copies + targets, params + sources)
        for i, name in others:
            saved, live = self._state[i], live_states[i]
            assert saved is not None
            assert live is not None
            saved[name] = _copy_value(live[name])
        self._capture_groups()
        return True

    def _capture_groups(self) -> None:
        assert self._optimizer is not None
        self._groups = [
            {k: _copy_value(v) for k, v in g.items() if k != "params"}
            for g in self._optimizer.param_groups
        ]

    def capture(self) -> None:
        """Save the current values (reusing the buffers of the previous capture)."""
        if self._capture_fast():
            return
        copies = _Copies()
        self._param_copies = [
            copies.save_into(buffer, p.detach())
            for buffer, p in zip(self._param_copies, self._params)
        ]
        if self._optimizer is None:
            copies.run()
            return
        state = self._optimizer.state
        self._tensor_slots = []
        others: list[tuple[int, str]] = []
        self._layout = []
        for i, key in enumerate(self._keys):
            live = state.get(key)
            if live is None:
                self._state[i] = None
                self._layout.append(-1)
                continue
            self._layout.append(len(live))
            previous = self._state[i] or {}
            saved = {}
            for name, value in live.items():
                saved[name] = copies.save_into(previous.get(name), value)
                if isinstance(value, torch.Tensor):
                    self._tensor_slots.append((i, name))
                else:
                    others.append((i, name))
            self._state[i] = saved
        copies.run()
        self._capture_groups()
        # The plan for the next capture: every state tensor and its buffer, in slot order.
        targets, sources = [], []
        for i, name in self._tensor_slots:
            saved_state, live = self._state[i], state.get(self._keys[i])
            assert saved_state is not None
            assert live is not None
            targets.append(saved_state[name])
            sources.append(live[name])
        self._plan = (targets, sources, others)

    def restore(self) -> None:
        """Copy every saved value back in place (tensors keep their identity and storage)."""
        saved = [copy for copy in self._param_copies if copy is not None]
        with torch.no_grad():
            torch._foreach_copy_(self._params, saved)
        if self._optimizer is None:
            return
        state = self._optimizer.state
        for key, saved_state in zip(self._keys, self._state):
            if saved_state is None:
                state.pop(key, None)  # the step created it
                continue
            live = state.get(key)
            if live is None:
                state[key] = {k: _copy_value(v) for k, v in saved_state.items()}
                continue
            for name in [n for n in live if n not in saved_state]:
                del live[name]
            for name, value in saved_state.items():
                old = live.get(name)
                if isinstance(value, torch.Tensor) and _fits(old, value):
                    with torch.no_grad():
                        old.copy_(value)
                else:
                    live[name] = _copy_value(value)
        for group, saved_group in zip(self._optimizer.param_groups, self._groups):
            for name, value in saved_group.items():
                old = group.get(name)
                if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
                    with torch.no_grad():
                        old.copy_(value)
                else:
                    group[name] = _copy_value(value)


@contextlib.contextmanager
def rollback_on_failure(
    operation: str,
    optimizer: torch.optim.Optimizer | None,
    params: Iterable[torch.Tensor],
    process_group: ProcessGroup | None = None,
    state_params: Iterable[torch.Tensor] | None = None,
    snapshot: OptimizerSnapshot | None = None,
) -> Iterator[OptimizerSnapshot]:
    """Snapshot, run the block, and restore the snapshot if a collective in it fails.

    Args:
        operation: what the block does, for the error message.
        optimizer: the optimizer the block steps (None: parameters only).
        params: every tensor the block may write (updated and received parameters).
        process_group: the group the block communicates over (None for WORLD).
        state_params: the optimizer-state keys the block may change (default: all).
        snapshot: a snapshot kept from an earlier step over the same tensors: captured again
            into its buffers (no allocation) and ``params``/``state_params`` are ignored.

    Yields:
        The snapshot (e.g. to restore it by hand).

    Raises:
        CollectiveFailedError: after restoring, when a collective in the block failed. Other
            exceptions propagate unchanged and nothing is restored.
    """
    if snapshot is None:
        snapshot = OptimizerSnapshot(optimizer, params, state_params)
    else:
        snapshot.capture()
    with restore_on_failure(operation, snapshot, process_group):
        yield snapshot


@contextlib.contextmanager
def restore_on_failure(
    operation: str,
    snapshot: OptimizerSnapshot,
    process_group: ProcessGroup | None = None,
    settle: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Run the block; if a collective in it fails, restore ``snapshot`` (captured before).

    For a step that spans several calls (e.g. DDP comm hooks, one per bucket): capture the
    snapshot before the first write, guard the call where failures surface.

    Args:
        operation: what the block does, for the error message.
        snapshot: the values to put back, already captured.
        process_group: the group the block communicates over (None for WORLD).
        settle: called before restoring, to wait for communication still in flight that could
            write into the saved tensors after the restore (it must not raise).

    Raises:
        CollectiveFailedError: after restoring, when a collective in the block failed. Other
            exceptions propagate unchanged and nothing is restored.
    """
    with collective_guard(operation, process_group, kept=ROLLED_BACK):
        try:
            yield
        except BaseException as exc:
            if is_collective_failure(exc):
                if settle is not None:
                    settle()
                snapshot.restore()
            raise
