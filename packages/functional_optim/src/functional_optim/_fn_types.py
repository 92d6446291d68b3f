"""The function types of a ``GradientTransformation`` (:mod:`functional_optim._base`).

Their own module, below everything that builds a step, so that the step builders
(:mod:`functional_optim._fusion`) can name them without importing :mod:`functional_optim._base`.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

from functional_optim._tree import PyTree

__all__ = ["InitFn", "OptState", "StepFn", "UpdateFn"]

#: A transform state: a (nested tuple of) typed NamedTuple(s) whose leaves are tensors.
OptState: TypeAlias = Any


class InitFn(Protocol):
    """``init(params) -> state``."""

    def __call__(self, params: PyTree) -> OptState: ...


class UpdateFn(Protocol):
    """``update(updates, state, params=None, *, inplace=False) -> (updates, state)``."""

    def __call__(
        self, updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]: ...


class StepFn(Protocol):
    """``step(params, grads, state) -> state``: update ``params`` and ``state`` in place."""

    def __call__(self, params: PyTree, grads: PyTree, state: OptState) -> OptState: ...
