"""The shared check of a step's flat lists (:data:`CHECKER`), made once per layout.

Every step path checks its lists with :func:`~functional_optim._input_checks.check_step`
(the pure checks, :mod:`functional_optim._input_checks`) through the shared :data:`CHECKER`
before anything is written. The full check makes a few ``map`` passes over each list (about
100 ns a tensor each on a slow CPU: 1.8 ms for a 1000-tensor Adam step), no tensor op.
:class:`StepChecker` makes it once: once a step has passed it several times with the same
lists, it keeps C++ metadata guards of what passed (torch's ``TensorGuards``, which
``torch.compile`` checks its inputs with: sizes, dtypes, devices, layouts) and later steps only
run those (about 0.1 ms per 1000 tensors per list). They compare the tensors' current metadata,
so a tensor resized in place or a state built for other params fails them and gets the full
check again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._input_checks import Buffer, GradRules, Shape, SparsePolicy, check_step

#: torch.compile's C++ guards (None without them: every step runs the full check)
TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch built without dynamo
    TensorGuards = None

#: The pure checks (:mod:`functional_optim._input_checks`) stay importable from here, the module
#: the step paths, the docs and the tests name.
__all__ = ["CHECKER", "Buffer", "GradRules", "Shape", "SparsePolicy", "StepChecker", "check_step"]


class _Seen:
    """A list layout's streak of passed full checks, and its guards once built."""

    __slots__ = ("guards", "needed", "streak", "uniform")

    def __init__(self) -> None:
        self.streak = 0
        self.needed = StepChecker.STREAK
        self.guards: list[Any] | None = None
        self.uniform = True


class StepChecker:
    """:func:`check_step` for steps that see the same kind of lists again and again.

    After a layout (the rules and the lengths of the lists) passed the full check
    :attr:`STREAK` times, the tensors of the last passing step become the reference of C++
    guards (``TensorGuards``: sizes, dtypes, devices, layouts, ``requires_grad``; not
    strides). A later step whose lists all match them is the same as a step that passed,
    index by index, and skips the full check; any other step takes it. Guards that fail
    are dropped and the streak to rebuild them doubles (building costs about 15 full checks),
    so lists that keep changing do not pay for guards they cannot use.

    The entries are keyed by the layout and a few properties of the first and last params (so
    that two optimizers, or ``fo.Optimizer`` and ``pure_step`` over one model, keep guards of
    their own); the key proves nothing: a match of the guards is a match of metadata the full
    check accepted, whichever step it came from.
    """

    #: Passed full checks of one layout before its guards are built.
    STREAK = 8
    _MAX_SEEN = 16
    _MAX_NEEDED = 1024

    def __init__(self) -> None:
        self._seen: dict[tuple[object, ...], _Seen] = {}

    def __call__(
        self,
        rules: GradRules,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        buffers: Sequence[Buffer] = (),
        *,
        meta: bool = False,
    ) -> bool:
        """:func:`check_step` (same arguments, result and errors), through the guards when
        they hold."""
        if torch.compiler.is_compiling():  # dynamo guards the metadata itself
            return check_step(rules, params, grads, buffers, meta=meta)
        lists = [params, grads, *(tensors for _, _, tensors in buffers)]
        kinds = tuple((name, shape) for name, shape, _ in buffers)
        key = (rules, meta, kinds, tuple(map(len, lists)), _caller(params))
        seen = self._seen.get(key)
        if seen is not None and seen.guards is not None:
            if _hold(seen.guards, lists):
                return seen.uniform
            seen.guards, seen.streak = None, 0
            seen.needed = min(2 * seen.needed, self._MAX_NEEDED)
        uniform = check_step(rules, params, grads, buffers, meta=meta)
        if seen is None:
            if len(self._seen) >= self._MAX_SEEN:
                del self._seen[next(iter(self._seen))]
            seen = self._seen[key] = _Seen()
        seen.streak += 1
        if seen.streak >= seen.needed and TensorGuards is not None:
            seen.guards = _guards(lists)
            seen.uniform = uniform
        return uniform


def _caller(params: Sequence[Tensor]) -> tuple[object, ...]:
    """What tells two callers of one layout apart (``fo.Optimizer``'s params require grad,
    ``tx.step``'s need not), read from the first and last params only."""
    if not params:
        return ()
    first, last = params[0], params[-1]
    return (first.shape, first.dtype, first.device, first.requires_grad, last.shape)


def _guards(lists: Sequence[Sequence[Tensor | None]]) -> list[Any] | None:
    """One ``TensorGuards`` per list (exact sizes, any strides); None when a list holds a
    None (a buffer not created yet)."""
    out = []
    for tensors in lists:
        present = [t for t in tensors if isinstance(t, Tensor)]
        if len(present) != len(tensors):
            return None
        sizes = [list(t.shape) for t in present]
        strides = [[None] * t.dim() for t in present]
        out.append(TensorGuards(*present, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides))
    return out


def _hold(guards: Sequence[Any], lists: Sequence[Sequence[Tensor | None]]) -> bool:
    """Whether every list matches its guards (the metadata of a step that passed)."""
    try:
        return all(g.check(*tensors) for g, tensors in zip(guards, lists, strict=True))
    except (TypeError, RuntimeError):  # a None where a tensor was: not the same lists
        return False


#: The checker every step path shares (its entries are keyed by layout and first param).
CHECKER = StepChecker()
