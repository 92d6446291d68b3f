"""The one check of a step's flat lists, made before anything is written (every step path).

Every path that hands flat lists to a kernel (an alias's fused ``step`` and its ``update``,
a chain's in-place ``step``, ``pure_step``) checks the params, their gradients and the state
lists the kernel will read (:func:`check_step`, through the shared :data:`CHECKER`), then runs
the kernel. torch's fused CPU
kernels trust their inputs: a gradient or a moment with fewer elements than its param is
read and written past its end. So the check is the only thing between a wrong state (built
for other params, loaded from another model) and memory corruption, and it raises torch's
exception types before a counter, a buffer or a param changes.

Cost: the full check makes a few ``map`` passes over each list (about 100 ns a tensor each on
a slow CPU: 1.8 ms for a 1000-tensor Adam step), no tensor op. :class:`StepChecker` makes it
once: once a step has passed it several times with the same lists, it keeps C++ metadata
guards of what passed (torch's ``TensorGuards``, which ``torch.compile`` checks its inputs
with: sizes, dtypes, devices, layouts) and later steps only run those (about 0.1 ms per 1000
tensors per list). They compare the tensors' current metadata, so a tensor resized in place
or a state built for other params fails them and gets the full check again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

#: torch.compile's C++ guards (None without them: every step runs the full check)
TensorGuards: Any
try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - a torch built without dynamo
    TensorGuards = None

__all__ = ["CHECKER", "Buffer", "GradRules", "Shape", "SparsePolicy", "StepChecker", "check_step"]

#: How a state list's tensors are shaped: ``"param"`` (each like its param), ``"scalar"``
#: (one element per param: a step counter), or a function of the param's shape giving the
#: buffer's shape (``None``: that param has no buffer there, as Adafactor's factored state).
Shape = Literal["param", "scalar"] | Callable[[torch.Size], "tuple[int, ...] | None"]
#: ``(name, shape, tensors)``: one state list, aligned with the params; ``name`` is for the
#: messages (torch's key, ``"exp_avg"``). ``None`` entries are buffers not created yet.
Buffer = tuple[str, Shape, Sequence["Tensor | None"]]
#: What a kernel does with sparse gradients (see :class:`GradRules`).
SparsePolicy = Literal["refuse", "accept", "require"]

_size = Tensor.size


# Plain functions, not ``operator.attrgetter``: torch.compile traces these (it cannot call an
# attrgetter), and the full check runs only until guards are built (see StepChecker).
def _dtype(t: Any) -> Any:
    return t.dtype


def _device(t: Any) -> Any:
    return t.device


def _layout(t: Any) -> Any:
    return t.layout


_META = torch.device("meta")


@dataclass(frozen=True)
class GradRules:
    """What a kernel takes besides dense gradients of its params' shape, device and dtype.

    Attributes:
        owner: the name in messages (torch's class name: ``"Adam"``).
        sparse: ``"refuse"`` sparse gradients (with ``sparse_message``), ``"accept"`` them
            (torch's SGD, Adagrad) or ``"require"`` them (SparseAdam; dense ones get
            ``sparse_message``).
        sparse_message: torch's message; ``"<owner> does not support sparse gradients"``
            when empty.
        promotes: torch's per-tensor path computes with gradients (and state) of another
            dtype than the param (SGD's ``param.add_(grad)``); the step then runs that path.
            Otherwise such a gradient is refused.
        one_dtype_when: a hyperparameter under which it does not (RMSprop's ``centered``:
            ``lerp_`` takes one dtype); see :meth:`for_values`.
    """

    owner: str
    sparse: SparsePolicy = "refuse"
    sparse_message: str = ""
    promotes: bool = False
    one_dtype_when: str | None = None

    def for_values(self, values: Mapping[str, Any]) -> GradRules:
        """These rules for a step with the hyperparameters ``values``."""
        if self.promotes and self.one_dtype_when is not None and values[self.one_dtype_when]:
            return replace(self, promotes=False, one_dtype_when=None)
        return self

    @property
    def sparse_error(self) -> str:
        """The message for a gradient of the wrong layout."""
        return self.sparse_message or f"{self.owner} does not support sparse gradients"


def check_step(
    rules: GradRules,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    buffers: Sequence[Buffer] = (),
    *,
    meta: bool = False,
) -> bool:
    """Check a step's inputs before anything is written.

    Args:
        rules: what the kernel takes (see :class:`GradRules`).
        params: the params that have a gradient this step.
        grads: their gradients, in the same order.
        buffers: the state lists the kernel reads, aligned with ``params``.
        meta: allow meta tensors (a pure update traced for shapes); a step refuses them.

    Returns:
        True when every gradient and every param-shaped buffer has its param's dtype (the
        fused kernels need it); False when one differs and ``rules.promotes``: run the
        per-tensor path then.

    Raises:
        RuntimeError: torch's type for a size mismatch, a gradient on another device (or on
            the meta device), of another dtype (unless ``rules.promotes``), or sparse when
            ``rules`` refuse it (torch's message).
        TypeError: if a state entry is not a tensor.
    """
    if not params:
        return True
    shapes = list(map(_size, params))
    if list(map(_size, grads)) != shapes:
        _raise_first_difference(
            shapes, list(map(_size, grads)), _size_error, rules.owner, "the gradient"
        )
    devices = list(map(_device, params))
    if list(map(_device, grads)) != devices or (not meta and _META in devices):
        _raise_device(rules.owner, devices, list(map(_device, grads)), meta)
    if set(map(_layout, grads)) != {torch.strided}:
        if rules.sparse == "refuse" or (rules.sparse == "require" and _any_dense(grads)):
            raise RuntimeError(rules.sparse_error)
    elif rules.sparse == "require":
        raise RuntimeError(rules.sparse_error)
    dtypes = list(map(_dtype, params))
    uniform = list(map(_dtype, grads)) == dtypes
    if not uniform and not rules.promotes:
        _raise_first_difference(
            dtypes, list(map(_dtype, grads)), _dtype_error, rules.owner, "the gradient"
        )
    for name, shape, tensors in buffers:
        if len(tensors) != len(shapes):
            raise RuntimeError(
                f"{rules.owner}: state {name!r} has {len(tensors)} entries for {len(shapes)} "
                "params; pass the state built for these params (init(params))"
            )
        if shape == "param":
            uniform = _check_like(rules, name, tensors, shapes, dtypes, devices) and uniform
        elif shape == "scalar":
            _check_scalars(rules.owner, name, tensors)
        else:
            _check_by_rule(rules.owner, name, tensors, shapes, shape)
    return uniform


def _any_dense(grads: Sequence[Tensor]) -> bool:
    return any(layout == torch.strided for layout in map(_layout, grads))


def _size_error(owner: str, what: str, i: int, got: torch.Size, shape: torch.Size) -> RuntimeError:
    return RuntimeError(
        f"{owner}: the size of {what} of param {i} ({list(got)}) must match the size of the "
        f"param ({list(shape)}); pass gradients and state built for these params "
        "(tx.init(params), or a state dict saved with them)"
    )


def _raise_first_difference(
    expected: Sequence[Any],
    got: Sequence[Any],
    error: Callable[[str, str, int, Any, Any], RuntimeError],
    owner: str,
    what: str,
) -> None:
    """Raise ``error(owner, what, i, got[i], expected[i])`` for the first ``i`` that differs."""
    for i, (want, other) in enumerate(zip(expected, got, strict=True)):
        if other != want:
            raise error(owner, what, i, other, want)


def _raise_device(
    owner: str, devices: Sequence[torch.device], got: Sequence[torch.device], meta: bool
) -> None:
    for i, (device, other) in enumerate(zip(devices, got, strict=True)):
        if other != device:
            raise RuntimeError(
                f"{owner}: the gradient of param {i} is on {other} but the param is on "
                f"{device}; move it to the param's device"
            )
        if not meta and device == _META:
            raise RuntimeError(
                f"{owner}: param {i} and its gradient are on the meta device, which holds no "
                "values: a step there would change nothing; step real tensors"
            )


def _dtype_error(
    owner: str, what: str, i: int, got: torch.dtype, dtype: torch.dtype
) -> RuntimeError:
    return RuntimeError(
        f"{owner}: {what} of param {i} has dtype {got} but the param has {dtype}; this step "
        "takes one dtype: cast it to the param's dtype"
    )


def _check_like(
    rules: GradRules,
    name: str,
    tensors: Sequence[Tensor | None],
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    devices: Sequence[torch.device],
    where: Sequence[int] | None = None,
) -> bool:
    """A param-shaped list; returns whether its dtypes are the params'.

    ``None`` entries are buffers not created yet (checked: the others); ``where`` are the
    param positions of ``tensors`` (all of them when None)."""
    owner, what = rules.owner, f"state {name!r}"
    try:
        got = list(map(_size, tensors))  # type: ignore[arg-type]
    except TypeError:  # a None entry, or not a tensor: check the tensors that are there
        if where is not None:
            _require_tensors(owner, name, tensors, where)
        kept = [j for j, t in enumerate(tensors) if t is not None]
        _require_tensors(owner, name, [tensors[j] for j in kept], kept)
        return _check_like(
            rules,
            name,
            [tensors[j] for j in kept],
            [shapes[j] for j in kept],
            [dtypes[j] for j in kept],
            [devices[j] for j in kept],
            kept,
        )
    positions = range(len(tensors)) if where is None else where
    if got != shapes:
        for j, other, shape in zip(positions, got, shapes, strict=True):
            if other != shape:
                raise _size_error(owner, what, j, other, shape)
    if list(map(_device, tensors)) != devices:
        for j, t, device in zip(positions, tensors, devices, strict=True):
            assert t is not None
            if t.device != device:
                raise RuntimeError(
                    f"{owner}: {what} of param {j} is on {t.device} but the param is on "
                    f"{device}; move the state to the params' devices"
                )
    got_dtypes = list(map(_dtype, tensors))
    if got_dtypes == dtypes:
        return True
    if not rules.promotes:
        for j, other, dtype in zip(positions, got_dtypes, dtypes, strict=True):
            if other != dtype:
                raise _dtype_error(owner, what, j, other, dtype)
    return False


def _require_tensors(
    owner: str, name: str, tensors: Sequence[object], where: Sequence[int]
) -> None:
    for j, t in zip(where, tensors, strict=True):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{owner}: state {name!r} of param {j} is a {type(t).__name__}, not a tensor; "
                "pass the state built by init(params)"
            )


def _check_scalars(owner: str, name: str, tensors: Sequence[Tensor | None]) -> None:
    """One element per param (a step counter: the fused kernels read one value)."""
    try:
        numels = list(map(Tensor.numel, tensors))  # type: ignore[arg-type]
    except TypeError:
        _require_tensors(owner, name, tensors, range(len(tensors)))
        raise
    if any(n != 1 for n in numels):
        for j, t in enumerate(tensors):
            assert t is not None
            if t.numel() != 1:
                raise RuntimeError(
                    f"{owner}: state {name!r} of param {j} must hold one value, got shape "
                    f"{list(t.shape)}; pass the state built by init(params)"
                )


def _check_by_rule(
    owner: str,
    name: str,
    tensors: Sequence[Tensor | None],
    shapes: Sequence[torch.Size],
    rule: Callable[[torch.Size], tuple[int, ...] | None],
) -> None:
    for j, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        expected = rule(shape)
        if expected is None:
            continue  # no buffer for this param's shape: the kernel does not read it
        _require_tensors(owner, name, [t], [j])
        assert t is not None
        if tuple(t.shape) != tuple(expected):
            raise RuntimeError(
                f"{owner}: the size of state {name!r} of param {j} ({list(t.shape)}) must be "
                f"{list(expected)} for a param of size {list(shape)}; pass the state built by "
                "init(params)"
            )


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
