"""The aliases' fused ``step``, built from a kernel's declared argument order.

An algorithm's registry entry declares what its kernel takes, in order
(:mod:`functional_optim._aliases._kernel_spec`: ``PARAMS``, ``GRADS``, ``state(...)``, ``LR``,
``IMPL`` and hyperparameter names). :func:`kernel_step` turns the declaration and the
hyperparameter values into one step function. Everything constant is resolved once, when the
alias is built; a step only flattens the trees, gathers the state lists and calls the kernel.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from functional_optim._aliases._common import (
    AUTO,
    KernelPath,
    component,
    lr_value,
    replace_component,
)
from functional_optim._aliases._kernel_spec import (
    GRADS,
    IMPL,
    LR,
    PARAMS,
    Getter,
    KernelArg,
    KernelSpec,
    StateArg,
    state,
)
from functional_optim._base import GradientTransformation, OptState, UpdateFn
from functional_optim._input_checks import Buffer, GradRules, Shape, check_step
from functional_optim._kernel_runner import run_kernel
from functional_optim._lists import LeafView
from functional_optim._step_checks import CHECKER
from functional_optim._tree import PyTree, tree_leaves

#: The declaration names (:mod:`functional_optim._aliases._kernel_spec`) stay importable from
#: here, where registry entries (and the README) take them.
__all__ = [
    "AUTO",
    "GRADS",
    "IMPL",
    "KernelPath",
    "LR",
    "PARAMS",
    "KernelArg",
    "KernelSpec",
    "StateArg",
    "kernel_step",
    "kernel_update",
    "state",
    "with_kernel",
    "written_state",
]


def _lr_getter(lr: Any) -> Getter | float:
    if callable(lr):
        return lambda view, st, full: lr_value(lr, full)
    if isinstance(lr, Tensor):
        return lambda view, st, full: float(lr)  # read each step, as torch reads a tensor lr
    return float(lr)


def _empty(view: LeafView, st: Any, full: OptState) -> list[Tensor]:
    return []


@dataclass(frozen=True)
class _Slots:
    """One alias build's arguments: constants, per-step getters, buffers to check."""

    template: list[Any]
    dynamic: list[tuple[int, Getter]]
    lazy: list[tuple[int, StateArg]]
    checked: list[tuple[int, str, Shape]]  # position, name in messages, shape
    lr: Getter | None  # read after the check (a schedule counts the step)
    rules: GradRules  # the spec's, for these hyperparameters
    guard: Callable[[list[Tensor]], None] | None  # torch's step-time checks of the path


def _label(spec: KernelSpec, arg: StateArg) -> str:
    """The name of a state list in messages: torch's key where the entry gives one."""
    return spec.state_names.get(arg.of or spec.state_type, {}).get(arg.field, arg.field)


def _slots(spec: KernelSpec, values: Mapping[str, Any], path: KernelPath = AUTO) -> _Slots:
    """The constant arguments, the per-step getters and the lazy buffers for ``values``, on
    the kernel path ``path``."""
    plan = spec.plan
    template = plan.base.copy()
    if plan.impl_index is not None:
        template[plan.impl_index] = path.impl
    elif path.impl != "auto":
        raise ValueError(
            f"{spec.kernel.__name__} has one path only; it cannot run impl={path.impl!r}"
        )
    for i, name, flag in plan.hyper:
        template[i] = bool(values[name]) if flag else values[name]
    dynamic, lazy = plan.fixed, plan.lazy  # shared, never mutated; copied when extended
    checked = [(i, _label(spec, arg), arg.shape) for i, arg in plan.checked]
    if plan.conditional:
        dynamic, lazy = dynamic.copy(), lazy.copy()
    for i, arg, getter in plan.conditional:
        if not values[arg.when]:  # type: ignore[index]
            dynamic.append((i, _empty))
        elif arg.fill is not None:
            lazy.append((i, arg))
        else:
            dynamic.append((i, getter))
            checked.append((i, _label(spec, arg), arg.shape))
    lr_get = None
    if plan.lr_index is not None:
        lr = _lr_getter(values["lr"])
        if callable(lr):
            lr_get = lr
        else:
            template[plan.lr_index] = lr
    assert spec.rules is not None
    rules = spec.rules.for_values(values)
    return _Slots(template, dynamic, lazy, checked, lr_get, rules, path.guard)


class _Buffers:
    """The lazily created buffers of one step, gathered with their None entries."""

    def __init__(self, spec: KernelSpec, slots: _Slots, view: LeafView, st: Any, full: OptState):
        self.entries: list[tuple[int, Any, int, bool, list[Any], list[Any]]] = []
        for i, arg in slots.lazy:
            owner: Any = st if arg.of is None else component(full, arg.of)
            index = _field_index(arg.of or spec.state_type, arg.field)
            leaves = view.spec_leaves(owner[index])
            self.entries.append((i, owner, index, arg.fill == "zeros", leaves, view.take(leaves)))
        self.labels = [_label(spec, arg) for _, arg in slots.lazy]

    def checked(self) -> list[Buffer]:
        return [
            (label, "param", taken)
            for label, (*_, taken) in zip(self.labels, self.entries, strict=True)
        ]

    def fill(self, view: LeafView, args: list[Any]) -> None:
        """Zeros for the None entries of ``"zeros"`` buffers; the lists into ``args``."""
        for i, _, _, zeros, leaves, taken in self.entries:
            if zeros:
                for k, j in enumerate(view.idx):
                    if leaves[j] is None:
                        p = view.all_params[j]
                        leaves[j] = taken[k] = torch.zeros_like(
                            p, memory_format=torch.preserve_format
                        )
            args[i] = taken

    def write_back(self, view: LeafView, full: OptState) -> OptState:
        """The chain state with the (possibly new) buffers."""
        for _, owner, index, zeros, leaves, taken in self.entries:
            if not zeros:  # the kernel stores a new buffer on a param's first step
                for j, buf in zip(view.idx, taken, strict=True):
                    leaves[j] = buf
            fields = list(owner)
            fields[index] = view.spec.unflatten(leaves)
            full = replace_component(full, type(owner)(*fields))
        return full


def _check(
    spec: KernelSpec,
    slots: _Slots,
    view: LeafView,
    args: list[Any],
    lazy: _Buffers | None,
    meta: bool = False,
) -> bool:
    """:func:`check_step` on what the kernel will get (before anything is written)."""
    if spec.check_inputs is not None:
        spec.check_inputs(view.params, view.grads)
    buffers: list[Buffer] = [(label, shape, args[i]) for i, label, shape in slots.checked]
    if lazy is not None:
        buffers += lazy.checked()
    # under a torch.func transform the tensors are wrappers: the plain check, no guards
    check = check_step if torch._C._functorch.peek_interpreter_stack() is not None else CHECKER
    return check(slots.rules, view.params, view.grads, buffers, meta=meta)


def kernel_step(
    spec: KernelSpec, values: Mapping[str, Any], path: KernelPath = AUTO
) -> Callable[..., OptState]:
    """The fused ``step(params, grads, state)`` running ``spec.kernel`` with ``values``.

    Every step first checks the gradients and the state lists against the params
    (:func:`functional_optim._input_checks.check_step`): a mismatch raises before a counter, a
    buffer or a param changes. Gradients (or state) of another dtype than their param, where
    torch's per-tensor path takes them, run the kernel's ``"single"`` path.

    Args:
        spec: the kernel and its argument order.
        values: the hyperparameters the arguments name (see
            :meth:`KernelSpec.hyperparameter_names`).
        path: the kernel's ``impl`` and torch's step-time checks of that path (run after the
            input checks, before a schedule counts the step or anything changes).

    Raises:
        TypeError: if ``values`` misses a hyperparameter the kernel needs or has one it does not.
        ValueError: a ``path`` other than ``"auto"`` for a kernel without ``impl``.
    """
    needed = spec.needed
    if values.keys() != needed:
        raise TypeError(
            f"{spec.kernel.__name__}'s step takes the hyperparameters {sorted(needed)}; got "
            f"{sorted(values)}"
        )
    slots = _slots(spec, values, path)
    kernel, state_type, guard = spec.kernel, spec.state_type, slots.guard
    lr_index, impl_index, roles = spec.plan.lr_index, spec.plan.impl_index, spec.plan.roles

    def step(params: PyTree, grads: PyTree, full: OptState) -> OptState:
        view, st, args = _arguments(params, grads, full, state_type, slots)
        lazy = _Buffers(spec, slots, view, st, full) if slots.lazy else None
        if not _check(spec, slots, view, args, lazy) and impl_index is not None:
            args[impl_index] = "single"  # torch's per-tensor path promotes other dtypes
        if guard is not None:
            guard(view.params)
        if slots.lr is not None:
            args[lr_index] = slots.lr(view, st, full)  # type: ignore[index]
        if lazy is None:
            run_kernel(kernel, args, roles)
            return full
        lazy.fill(view, args)
        run_kernel(kernel, args, roles)
        return lazy.write_back(view, full)

    _SPEC_OF[step] = spec
    return step


#: kernel step -> its declaration (read by ``pure_step`` through :func:`written_state`)
_SPEC_OF: weakref.WeakKeyDictionary[Callable[..., Any], KernelSpec] = weakref.WeakKeyDictionary()


def written_state(step: Callable[..., Any] | None, full: OptState) -> list[Any] | None:
    """The leaves of ``full`` that ``step``'s kernel writes (every state list it declares;
    ``None`` for a buffer not made yet), or None when ``step`` is not a :func:`kernel_step`."""
    spec = _SPEC_OF.get(step) if step is not None else None
    if spec is None:
        return None
    out: list[Any] = []
    for arg in spec.args:
        if isinstance(arg, StateArg):
            out += tree_leaves(getattr(component(full, arg.of or spec.state_type), arg.field))
    return out


def kernel_update(spec: KernelSpec, values: Mapping[str, Any], update: UpdateFn) -> UpdateFn:
    """``update`` after the checks :func:`kernel_step` makes (meta tensors allowed: a pure
    update may be traced for shapes).

    Args:
        spec: the kernel declaration (its state lists and rules).
        values: the hyperparameters (which optional state lists exist).
        update: the chain's pure ``update``.
    """
    slots = _slots(spec, values)
    state_type = spec.state_type

    def checked(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        reference = updates if params is None else params
        view, st, args = _arguments(reference, updates, state, state_type, slots)
        lazy = _Buffers(spec, slots, view, st, state) if slots.lazy else None
        _check(spec, slots, view, args, lazy, meta=True)
        return update(updates, state, params, inplace=inplace)

    return checked


def _arguments(
    params: PyTree, grads: PyTree, full: OptState, state_type: type, slots: _Slots
) -> tuple[LeafView, Any, list[Any]]:
    """The flat view, the algorithm's state and the kernel's arguments for one step (the
    lazily created buffers and a schedule's learning rate not yet filled in)."""
    view = LeafView(params, grads)
    st: Any = component(full, state_type)
    args = slots.template.copy()
    for i, get in slots.dynamic:
        args[i] = get(view, st, full)
    return view, st, args


def _field_index(state_type: type, field_name: str) -> int:
    fields: tuple[str, ...] = getattr(state_type, "_fields", ())
    return fields.index(field_name)


def with_kernel(
    tx: GradientTransformation,
    spec: KernelSpec,
    values: Mapping[str, Any],
    path: KernelPath = AUTO,
) -> GradientTransformation:
    """``tx`` with the fused ``step`` of ``spec`` and its ``update`` checked as that step is.

    Args:
        tx: the alias's chain.
        spec: the kernel declaration.
        values: the hyperparameters its kernel arguments name.
        path: the step's kernel path (torch's ``foreach``/``fused`` flags); ``update`` is the
            chain's pure maths whatever the path.
    """
    return tx._replace(
        step=kernel_step(spec, values, path), update=kernel_update(spec, values, tx.update)
    )
