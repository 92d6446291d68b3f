"""The aliases' fused ``step``, built from a kernel's declared argument order.

An algorithm's registry entry lists what its kernel takes, in order (:data:`KernelArg`):

* ``PARAMS`` / ``GRADS``: the params and gradients that have a gradient this step;
* ``state("mu")``: the ``mu`` leaves of the entry's state (found in the chain by type),
  ``state("nu_max", when="amsgrad")`` the same or ``[]`` when that hyperparameter is off,
  ``state("momentum_buffer", of=TraceState, fill="kernel")`` a lazily created buffer that is
  written back into the chain state after the call;
* ``LR``: the learning rate of this step (a schedule is evaluated, a tensor read);
* ``IMPL``: ``"auto"``;
* any other string: the value of that hyperparameter, as the alias's builder passed it.

:func:`kernel_step` turns the declaration and the hyperparameter values into one step
function. Everything constant is resolved once, when the alias is built; a step only flattens
the trees, gathers the state lists and calls the kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from functional_optim._aliases._common import FlatView, component, lr_value, replace_component
from functional_optim._base import GradientTransformation, OptState
from functional_optim._tree import PyTree

__all__ = [
    "GRADS",
    "IMPL",
    "LR",
    "PARAMS",
    "KernelArg",
    "KernelSpec",
    "SPECS",
    "StateArg",
    "fused",
    "kernel_step",
    "state",
]

Fill = Literal["kernel", "zeros"]
#: ``check(active_params, active_grads)``: raises before anything changes.
InputCheck = Callable[..., None]


@dataclass(frozen=True)
class _Special:
    name: str

    def __repr__(self) -> str:
        return self.name


PARAMS = _Special("PARAMS")
GRADS = _Special("GRADS")
LR = _Special("LR")
IMPL = _Special("IMPL")


@dataclass(frozen=True)
class StateArg:
    """A state list argument: the ``field`` leaves of a chain component (see :func:`state`)."""

    field: str
    when: str | None = None
    of: type | None = None
    fill: Fill | None = None


#: One kernel argument: a special source, a state list or a hyperparameter name.
KernelArg = _Special | StateArg | str


def state(
    field: str, when: str | None = None, of: type | None = None, fill: Fill | None = None
) -> StateArg:
    """Declare a state list argument.

    Args:
        field: the field of the state NamedTuple.
        when: a hyperparameter: pass ``[]`` when it is falsy (``max_exp_avg_sqs`` without
            ``amsgrad``).
        of: the state type holding ``field``; the entry's own state type when None.
        fill: the leaves may be None (created lazily): ``"kernel"`` lets the kernel store new
            tensors in the list, ``"zeros"`` fills them with zeros first; either way the list is
            written back into the chain state after the call.
    """
    return StateArg(field, when, of, fill)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel and its argument order, as an algorithm's registry entry declares them.

    Attributes:
        kernel: the dispatching kernel (``kernels.adam``).
        args: what the kernel takes, in order.
        state_type: the state the ``state(...)`` arguments read by default.
        check_inputs: run on the active params and grads before the kernel (Muon's 2-D check).
    """

    kernel: Callable[..., None]
    args: tuple[KernelArg, ...]
    state_type: type
    check_inputs: InputCheck | None = None
    needed: frozenset[str] = field(init=False, repr=False, compare=False)
    plan: _Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        arity = len(inspect.signature(self.kernel).parameters)
        if len(self.args) != arity:
            raise ValueError(
                f"{self.kernel.__name__} takes {arity} arguments but its entry declares "
                f"{len(self.args)}: list every argument of the kernel, in order"
            )
        for arg in self.args:
            if isinstance(arg, StateArg):
                owner = arg.of or self.state_type
                if arg.field not in getattr(owner, "_fields", ()):
                    raise ValueError(f"{owner.__name__} has no field {arg.field!r}")
        # computed once: read on every alias build (each step, with tensor hyperparameters)
        object.__setattr__(self, "needed", frozenset(self.hyperparameter_names()))
        object.__setattr__(self, "plan", _plan(self))

    def hyperparameter_names(self) -> set[str]:
        """The hyperparameters the step needs from the alias's builder."""
        names = {a for a in self.args if isinstance(a, str)}
        names |= {a.when for a in self.args if isinstance(a, StateArg) and a.when is not None}
        if LR in self.args:
            names.add("lr")
        return names


Getter = Callable[[FlatView, Any, OptState], Any]


def _lr_getter(lr: Any) -> Getter | float:
    if callable(lr):
        return lambda view, st, full: lr_value(lr, full)
    if isinstance(lr, Tensor):
        return lambda view, st, full: float(lr)  # read each step, as torch reads a tensor lr
    return float(lr)


def _state_getter(arg: StateArg, default_type: type) -> Getter:
    owner = arg.of or default_type
    field = arg.field
    if owner is default_type:
        return lambda view, st, full: view.gather(getattr(st, field))
    return lambda view, st, full: view.gather(getattr(component(full, owner), field))


def _params(view: FlatView, st: Any, full: OptState) -> list[Tensor]:
    return view.active_params


def _grads(view: FlatView, st: Any, full: OptState) -> list[Tensor]:
    return view.active_grads


def _empty(view: FlatView, st: Any, full: OptState) -> list[Tensor]:
    return []


@dataclass(frozen=True)
class _Plan:
    """A kernel declaration sorted once into what each alias build fills in."""

    base: list[Any]  # "auto" at IMPL, None elsewhere
    hyper: list[tuple[int, str]]  # position <- a hyperparameter value
    fixed: list[tuple[int, Getter]]  # params, grads, state lists read every step
    conditional: list[tuple[int, StateArg, Getter]]  # state lists with a ``when``
    lazy: list[tuple[int, StateArg]]  # lazily created buffers without a ``when``
    lr_index: int | None


def _plan(spec: KernelSpec) -> _Plan:
    plan = _Plan([None] * len(spec.args), [], [], [], [], None)
    for i, arg in enumerate(spec.args):
        if isinstance(arg, StateArg):
            getter = _state_getter(arg, spec.state_type)
            if arg.when is not None:
                plan.conditional.append((i, arg, getter))
            elif arg.fill is not None:
                plan.lazy.append((i, arg))
            else:
                plan.fixed.append((i, getter))
        elif isinstance(arg, str):
            plan.hyper.append((i, arg))
        elif arg is PARAMS:
            plan.fixed.append((i, _params))
        elif arg is GRADS:
            plan.fixed.append((i, _grads))
        elif arg is LR:
            object.__setattr__(plan, "lr_index", i)
        else:
            plan.base[i] = "auto"  # IMPL
    return plan


def _slots(
    spec: KernelSpec, values: Mapping[str, Any]
) -> tuple[list[Any], list[tuple[int, Getter]], list[tuple[int, StateArg]]]:
    """The constant arguments, the per-step getters and the lazy buffers for ``values``."""
    plan = spec.plan
    template = plan.base.copy()
    for i, name in plan.hyper:
        template[i] = values[name]
    dynamic, lazy = plan.fixed, plan.lazy  # shared, never mutated; copied when extended
    if plan.conditional:
        dynamic, lazy = dynamic.copy(), lazy.copy()
    for i, arg, getter in plan.conditional:
        if not values[arg.when]:  # type: ignore[index]
            dynamic.append((i, _empty))
        elif arg.fill is not None:
            lazy.append((i, arg))
        else:
            dynamic.append((i, getter))
    if plan.lr_index is not None:
        lr = _lr_getter(values["lr"])
        if callable(lr):
            dynamic = [*dynamic, (plan.lr_index, lr)]
        else:
            template[plan.lr_index] = lr
    return template, dynamic, lazy


def kernel_step(spec: KernelSpec, values: Mapping[str, Any]) -> Callable[..., OptState]:
    """The fused ``step(params, grads, state)`` running ``spec.kernel`` with ``values``.

    Args:
        spec: the kernel and its argument order.
        values: the hyperparameters the arguments name (see
            :meth:`KernelSpec.hyperparameter_names`).

    Raises:
        TypeError: if ``values`` misses a hyperparameter the kernel needs or has one it does not.
    """
    needed = spec.needed
    if values.keys() != needed:
        raise TypeError(
            f"{spec.kernel.__name__}'s step takes the hyperparameters {sorted(needed)}; got "
            f"{sorted(values)}"
        )
    template, dynamic, lazy = _slots(spec, values)
    kernel, state_type, check = spec.kernel, spec.state_type, spec.check_inputs
    if lazy:
        return _lazy_step(kernel, state_type, check, template, dynamic, lazy)

    def step(params: PyTree, grads: PyTree, full: OptState) -> OptState:
        _, _, args = _arguments(params, grads, full, state_type, check, template, dynamic)
        kernel(*args)
        return full

    return step


def _arguments(
    params: PyTree,
    grads: PyTree,
    full: OptState,
    state_type: type,
    check: InputCheck | None,
    template: list[Any],
    dynamic: list[tuple[int, Getter]],
) -> tuple[FlatView, Any, list[Any]]:
    """The flat view, the algorithm's state and the kernel's arguments for one step (after the
    input check)."""
    view = FlatView(params, grads)
    if check is not None:
        check(view.active_params, view.active_grads)
    st: Any = component(full, state_type)
    args = template.copy()
    for i, get in dynamic:
        args[i] = get(view, st, full)
    return view, st, args


def _field_index(state_type: type, field_name: str) -> int:
    fields: tuple[str, ...] = getattr(state_type, "_fields", ())
    return fields.index(field_name)


def _lazy_step(
    kernel: Callable[..., None],
    state_type: type,
    check: InputCheck | None,
    template: list[Any],
    dynamic: list[tuple[int, Getter]],
    lazy: Sequence[tuple[int, StateArg]],
) -> Callable[..., OptState]:
    """A step with lazily created buffers (SGD's and RMSprop's momentum): they are gathered
    with their None entries, filled (by the kernel or with zeros first) and written back into
    the chain state."""
    buffers = [
        (i, arg.of, _field_index(arg.of or state_type, arg.field), arg.fill == "zeros")
        for i, arg in lazy
    ]

    def step(params: PyTree, grads: PyTree, full: OptState) -> OptState:
        view, st, args = _arguments(params, grads, full, state_type, check, template, dynamic)
        written = []
        for i, of, index, zeros in buffers:
            owner: Any = st if of is None else component(full, of)
            leaves = view.leaves(owner[index])
            if zeros:
                for j in view.idx:
                    if leaves[j] is None:
                        p = view.params[j]
                        leaves[j] = torch.zeros_like(p, memory_format=torch.preserve_format)
            taken = view.take(leaves)
            args[i] = taken
            written.append((owner, index, zeros, leaves, taken))
        kernel(*args)
        for owner, index, zeros, leaves, taken in written:
            if not zeros:  # the kernel stores a new buffer on a param's first step
                for j, buf in zip(view.idx, taken, strict=True):
                    leaves[j] = buf
            fields = list(owner)
            fields[index] = view.unflatten(leaves)
            full = replace_component(full, type(owner)(*fields))
        return full

    return step


#: Alias name -> its kernel declaration; filled by the algorithm registry
#: (``functional_optim._registry``), read when an alias is built.
SPECS: dict[str, KernelSpec] = {}


def fused(tx: GradientTransformation, name: str, **values: Any) -> GradientTransformation:
    """``tx`` with the fused ``step`` of the registered algorithm ``name``.

    Args:
        tx: the alias's chain.
        name: the registry entry whose kernel declaration the step runs.
        values: the hyperparameters its kernel arguments name.

    Raises:
        KeyError: if no registered algorithm of that name declares a kernel.
    """
    if name not in SPECS:
        raise KeyError(f"no registered algorithm {name!r} declares a kernel")
    return tx._replace(step=kernel_step(SPECS[name], values))
