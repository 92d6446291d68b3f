"""The one check of a step's flat lists, made before anything is written (every step path).

Every path that hands flat lists to a kernel (an alias's fused ``step`` and its ``update``,
a chain's in-place ``step``, ``pure_step``) checks the params, their gradients and the state
lists the kernel will read (:func:`check_step`, through the shared
:data:`functional_optim._step_checks.CHECKER`), then runs the kernel. torch's fused CPU
kernels trust their inputs: a gradient or a moment with fewer elements than its param is
read and written past its end. So the check is the only thing between a wrong state (built
for other params, loaded from another model) and memory corruption, and it raises torch's
exception types before a counter, a buffer or a param changes.

The check makes a few ``map`` passes over each list, no tensor op; the steps run it through
:class:`functional_optim._step_checks.StepChecker`, which replaces it by C++ guards once a list
layout has passed it several times (its cost is described there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["Buffer", "GradRules", "Shape", "SparsePolicy", "check_step"]

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
# attrgetter), and the full check runs only until guards are built (see _step_checks.StepChecker).
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
