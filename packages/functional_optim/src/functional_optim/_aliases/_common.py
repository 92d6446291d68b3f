"""Shared pieces of the aliases: torch's checks, torch's chain layout, flat views for kernels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, chain, identity
from functional_optim._transforms._leaf import is_traced
from functional_optim._transforms.scale import (
    ScaleByScheduleState,
    Schedule,
    scale,
    scale_by_learning_rate,
)
from functional_optim._transforms.weight_decay import add_decayed_weights

LearningRate = float | Tensor | Schedule
S = TypeVar("S")
L = TypeVar("L", bound=LearningRate)


def scalar_lr(lr: L) -> L:
    """``lr`` with a 1-element tensor as a 0-d view of it (torch takes either; the list maths
    scale by 0-d tensors). Floats, 0-d tensors and schedules are returned as they are."""
    if isinstance(lr, Tensor) and lr.dim() != 0 and lr.numel() == 1:
        return cast(L, lr.reshape(()))
    return lr


def check_lr(lr: L) -> L:
    """torch's learning-rate checks (a schedule is accepted as is).

    Returns:
        ``lr`` for the chain: a 1-element tensor as a 0-d view (:func:`scalar_lr`).

    Raises:
        ValueError: torch's messages (``Invalid learning rate: -1``).
    """
    if callable(lr) or is_traced(lr):  # a vmapped lr (a sweep) has no readable value
        return scalar_lr(lr)
    value = cast("float | Tensor", lr)  # not a schedule here
    if isinstance(value, Tensor) and value.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not value >= 0.0:
        raise ValueError(f"Invalid learning rate: {value}")
    return scalar_lr(lr)


def check_nonneg(value: float, what: str) -> None:
    """Raise torch's ``ValueError(f"Invalid {what}: {value}")`` for a negative value."""
    if not value >= 0.0:
        raise ValueError(f"Invalid {what}: {value}")


def check_betas(betas: Any) -> None:
    """torch.optim.Adam/Adamax's ``betas`` range checks, then their number: torch unpacks
    ``beta1, beta2 = betas`` at its first step and raises there; this raises at construction.

    Raises:
        ValueError: a beta out of ``[0, 1)`` (torch's message), or more than two betas.
        IndexError: fewer than two (torch's, from ``betas[1]``).
    """
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if len(betas) != 2:
        raise ValueError(
            f"too many values to unpack (expected 2): betas must be (beta1, beta2), got {betas}"
        )


def maximize_tx(maximize: bool) -> GradientTransformation:
    """``scale(-1.0)`` (torch's ``grad = -grad``) when maximizing, else ``identity()``."""
    return scale(-1.0) if maximize else identity()


def torch_chain(
    maximize: bool,
    weight_decay: float | Tensor,
    lr: LearningRate,
    *scalers: GradientTransformation,
) -> GradientTransformation:
    """torch.optim's order as a chain: ``(maximize, add_decayed_weights(weight_decay),
    *scalers, scale_by_learning_rate(lr))``; the fused steps find the states they need by
    type (:func:`component`), not by position."""
    return chain(
        maximize_tx(maximize),
        add_decayed_weights(weight_decay),
        *scalers,
        scale_by_learning_rate(lr),
    )


def component(state: OptState, state_type: type[S]) -> S:
    """The first component of a chain's state that is a ``state_type``.

    The fused steps read the state they update by its type, so an alias's chain can gain or
    reorder components without renumbering anything.

    Raises:
        TypeError: if the chain holds no such component (a state from another transform).
    """
    for s in state:
        if isinstance(s, state_type):
            return s
    raise TypeError(
        f"expected a chain state holding a {state_type.__name__}; got "
        f"({', '.join(type(s).__name__ for s in state)}): pass the state from this "
        "transform's init/update"
    )


def replace_component(state: OptState, new: Any) -> tuple[Any, ...]:
    """``state`` with its first component of ``type(new)`` replaced by ``new``."""
    out = list(state)
    for i, s in enumerate(out):
        if isinstance(s, type(new)):
            out[i] = new
            return tuple(out)
    raise TypeError(f"the chain state holds no {type(new).__name__}")


def lr_value(lr: LearningRate, state: OptState) -> float:
    """The learning rate of this step as a Python float (the kernels take floats).

    For a schedule, evaluates it at the count of the chain's ``ScaleByScheduleState`` (found
    in ``state``) and increments that count in place.
    """
    if callable(lr):
        schedule_state = component(state, ScaleByScheduleState)
        value = float(lr(schedule_state.count))
        schedule_state.count.add_(1)
        return value
    return float(lr)


def as_float(x: float | Tensor) -> float:
    """A hyperparameter as a Python float (tensors are read once, outside the pure path)."""
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


# --- torch's implementation switches: foreach, fused, capturable, differentiable -------------

#: Run on a step's active params (those with a gradient) before anything changes: raises
#: torch's step-time errors for the chosen path.
StepGuard = Callable[[list[Tensor]], None]


@dataclass(frozen=True)
class KernelPath:
    """The kernel path an alias build runs, as torch's flags choose it.

    Attributes:
        impl: the kernel's ``impl``: ``"auto"`` (neither ``foreach`` nor ``fused`` given),
            ``"single"``, ``"foreach"`` or ``"fused"``.
        guard: torch's step-time checks of that path (None when there are none).
    """

    impl: str = "auto"
    guard: StepGuard | None = None


#: The default: the fastest path for the tensors at hand, no step-time checks.
AUTO = KernelPath()

#: What torch's capturable device check names, per alias: (per-tensor path, foreach path).
_CAPTURABLE_WHAT: dict[str, tuple[str, str]] = {
    "asgd": ("params, mus, etas, and state_steps", "params, mus, etas, and state_steps"),
    "nadam": ("params, mu_products and state_steps", "params, mu_products, and state_steps"),
}
#: Aliases whose per-tensor capturable check leaves ``xla`` out of the devices (Adadelta) and
#: whose foreach check keeps it (RMSprop, Rprop), as torch 2.13's.
_NO_XLA_SINGLE = frozenset({"adadelta"})
_XLA_FOREACH = frozenset({"rmsprop", "rprop"})
#: torch's multi-tensor SGD runs with ``differentiable=True``; every other raises.
_FOREACH_DIFFERENTIABLE = frozenset({"sgd"})


def impl_for(foreach: Any, fused: Any = None, differentiable: Any = False) -> str:
    """The kernel ``impl`` torch's flags select (torch reads them as truthy values).

    ``fused`` -> ``"fused"``; ``foreach`` -> ``"foreach"``; ``differentiable`` or an explicit
    ``foreach=False`` / ``fused=False`` -> ``"single"`` (torch's for-loop); neither given ->
    ``"auto"`` (this package's default: the fastest path for the tensors).
    """
    if fused:
        return "fused"
    if foreach:
        return "foreach"
    if differentiable or foreach is not None or fused is not None:
        return "single"
    return "auto"


def check_fused(fused: Any, foreach: Any, differentiable: Any) -> None:
    """torch's construction checks of ``fused=True`` (SGD, Adam, AdamW, Adagrad), in its order.

    Raises:
        RuntimeError: torch's messages.
    """
    if fused:
        if differentiable:
            raise RuntimeError("`fused` does not support `differentiable`")
        if foreach:
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")


def check_tensor_for_foreach(name: str, value: Any, foreach: Any, capturable: Any) -> None:
    """torch.optim.Adam's refusal of a tensor ``lr``/``betas[i]`` on the non-capturable
    foreach path (``name`` as torch's message spells it: ``"lr"``, ``"betas[0]"``).

    Raises:
        ValueError: torch's message.
    """
    if isinstance(value, Tensor) and foreach and not capturable:
        raise ValueError(
            f"{name} as a Tensor is not supported for capturable=False and foreach=True"
        )


def _privateuse1() -> str:
    return str(torch._C._get_privateuse1_backend_name())


def _runs_foreach(impl: str, params: Sequence[Tensor]) -> bool:
    """Whether torch takes its multi-tensor path: asked for, or by default when every param
    is on a foreach device (torch's ``_default_to_fused_or_foreach``)."""
    if impl == "foreach":
        return True
    if impl != "auto":
        return False
    devices = ("cuda", "xpu", "mtia", _privateuse1())
    return all(p.device.type in devices for p in params)


def _guard(name: str, impl: str, capturable: bool, differentiable: bool) -> StepGuard:
    def guard(params: list[Tensor]) -> None:
        if not params:  # torch's paths check nothing without a gradient
            return
        foreach = _runs_foreach(impl, params)
        if capturable and not torch.compiler.is_compiling():
            xla = name in _XLA_FOREACH if foreach else name not in _NO_XLA_SINGLE
            devices = ["cuda", "xpu", "hpu", _privateuse1()] + (["xla"] if xla else [])
            if not all(p.device.type in devices for p in params):
                default = "params and state_steps"
                what = _CAPTURABLE_WHAT.get(name, (default, default))[int(foreach)]
                raise AssertionError(
                    f"If capturable=True, {what} must be on supported devices: {devices}."
                )
        if differentiable and foreach and name not in _FOREACH_DIFFERENTIABLE:
            raise AssertionError("_foreach ops don't support autograd")

    return guard


def kernel_path(
    name: str,
    *,
    foreach: Any = None,
    fused: Any = None,
    capturable: Any = False,
    differentiable: Any = False,
) -> KernelPath:
    """The path and the step-time checks torch's flags give the alias ``name``.

    The path is :func:`impl_for`'s. ``capturable=True`` raises torch's ``AssertionError`` at a
    step whose params are not on a capturable device (CPU included), on the per-tensor and
    foreach paths as torch does (this package's kernels read the step count on the host:
    on a capturable device they run their usual paths); ``differentiable=True`` with
    ``foreach=True`` raises torch's ``"_foreach ops don't support autograd"`` (not SGD's).
    """
    impl = impl_for(foreach, fused, differentiable)
    checked_capturable = bool(capturable) and impl != "fused"  # torch's fused path checks none
    checked_differentiable = bool(differentiable) and impl == "foreach"  # else the for-loop
    if not (checked_capturable or checked_differentiable):
        return KernelPath(impl)
    return KernelPath(impl, _guard(name, impl, checked_capturable, bool(differentiable)))


def scalar_betas(betas: Any) -> Any:
    """torch.optim.Adam's stored ``betas``: a tuple, 1-element tensors as 0-d (``_to_scalar``).

    Anything but a tuple or list is returned as it is (the checks then raise as torch's)."""
    if not isinstance(betas, (tuple, list)):
        return betas
    return tuple(b.squeeze() if isinstance(b, Tensor) and b.dim() != 0 else b for b in betas)
