"""The declaration of a kernel's arguments, as an algorithm's registry entry writes it.

An algorithm's registry entry lists what its kernel takes, in order (:data:`KernelArg`):

* ``PARAMS`` / ``GRADS``: the params and gradients that have a gradient this step;
* ``state("mu")``: the ``mu`` leaves of the entry's state (found in the chain by type),
  ``state("nu_max", when="amsgrad")`` the same or ``[]`` when that hyperparameter is off,
  ``state("momentum_buffer", of=TraceState, fill="kernel")`` a lazily created buffer that is
  written back into the chain state after the call;
* ``LR``: the learning rate of this step (a schedule is evaluated, a tensor read);
* ``IMPL``: the path torch's flags chose (:class:`~functional_optim._aliases._common.KernelPath`:
  ``"auto"`` unless the alias was given ``foreach``/``fused``/``differentiable``);
* any other string: the value of that hyperparameter, as the alias's builder passed it.

A :class:`KernelSpec` sorts its declaration once (its ``plan``);
:func:`functional_optim._aliases._kernel_step.kernel_step` turns it and the hyperparameter
values into one step function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor

from functional_optim._aliases._common import component
from functional_optim._base import OptState
from functional_optim._input_checks import GradRules, Shape
from functional_optim._kernel_runner import Role
from functional_optim._lists import LeafView

__all__ = [
    "GRADS",
    "IMPL",
    "LR",
    "PARAMS",
    "Getter",
    "InputCheck",
    "KernelArg",
    "KernelSpec",
    "StateArg",
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
    shape: Shape = "param"


#: One kernel argument: a special source, a state list or a hyperparameter name.
KernelArg = _Special | StateArg | str


def state(
    field: str,
    when: str | None = None,
    of: type | None = None,
    fill: Fill | None = None,
    shape: Shape | None = None,
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
        shape: how its tensors are shaped, checked before every step
            (:data:`functional_optim._input_checks.Shape`): ``"scalar"`` for ``count`` (the
            per-leaf step counters), ``"param"`` for any other field when None.
    """
    if shape is None:
        shape = "scalar" if field == "count" else "param"
    return StateArg(field, when, of, fill, shape)


@dataclass(frozen=True)
class KernelSpec:
    """A kernel and its argument order, as an algorithm's registry entry declares them.

    Attributes:
        kernel: the dispatching kernel (``kernels.adam``).
        args: what the kernel takes, in order.
        state_type: the state the ``state(...)`` arguments read by default.
        check_inputs: run on the active params and grads before the kernel (Muon's 2-D check).
        rules: the gradients the kernel takes (sparse, other dtypes) and the name in messages;
            every step checks its inputs against them and the declared state shapes
            (:func:`functional_optim._input_checks.check_step`) before anything is written.
        state_names: state type -> (field -> torch's key): the names the messages use.
    """

    kernel: Callable[..., None]
    args: tuple[KernelArg, ...]
    state_type: type
    check_inputs: InputCheck | None = None
    rules: GradRules | None = None
    state_names: Mapping[type, Mapping[str, str]] = field(default_factory=dict)
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
        if self.rules is None:
            object.__setattr__(self, "rules", GradRules(self.kernel.__name__))
        # computed once: read on every alias build (each step, with tensor hyperparameters)
        object.__setattr__(self, "needed", frozenset(self.hyperparameter_names()))
        object.__setattr__(self, "plan", _plan(self))

    def hyperparameter_names(self) -> set[str]:
        """The hyperparameters the step needs from the alias's builder."""
        names = {a for a in self.args if isinstance(a, str)}
        names |= {a.when for a in self.args if isinstance(a, StateArg) and a.when is not None}
        if LR in self.args:
            names.add("lr")
        if self.rules is not None and self.rules.one_dtype_when is not None:
            names.add(self.rules.one_dtype_when)
        return names


Getter = Callable[[LeafView, Any, OptState], Any]


def _state_getter(arg: StateArg, default_type: type) -> Getter:
    owner = arg.of or default_type
    field = arg.field
    if owner is default_type:
        return lambda view, st, full: view.gather(getattr(st, field))
    return lambda view, st, full: view.gather(getattr(component(full, owner), field))


def _params(view: LeafView, st: Any, full: OptState) -> list[Tensor]:
    return list(view.params)  # a kernel runner refills the list it is given


def _grads(view: LeafView, st: Any, full: OptState) -> list[Tensor]:
    return view.grads


@dataclass(frozen=True)
class _Plan:
    """A kernel declaration sorted once into what each alias build fills in."""

    base: list[Any]  # "auto" at IMPL, None elsewhere
    hyper: list[tuple[int, str, bool]]  # position <- a hyperparameter value (as a bool?)
    fixed: list[tuple[int, Getter]]  # params, grads, state lists read every step
    conditional: list[tuple[int, StateArg, Getter]]  # state lists with a ``when``
    lazy: list[tuple[int, StateArg]]  # lazily created buffers without a ``when``
    checked: list[tuple[int, StateArg]]  # state lists without a ``when``: checked each step
    lr_index: int | None
    impl_index: int | None
    roles: tuple[Role, ...]  # what the kernel does with each argument (``run_kernel``)


def _role(arg: KernelArg) -> Role:
    if isinstance(arg, StateArg):
        return "write" if arg.shape == "param" else "count" if arg.shape == "scalar" else "other"
    return "write" if arg is PARAMS else "read" if arg is GRADS else None


def _plan(spec: KernelSpec) -> _Plan:
    roles = tuple(_role(arg) for arg in spec.args)
    plan = _Plan([None] * len(spec.args), [], [], [], [], [], None, None, roles)
    kinds = list(inspect.signature(spec.kernel).parameters.values())
    for i, arg in enumerate(spec.args):
        if isinstance(arg, StateArg):
            getter = _state_getter(arg, spec.state_type)
            if arg.when is not None:
                plan.conditional.append((i, arg, getter))
            elif arg.fill is not None:
                plan.lazy.append((i, arg))
            else:
                plan.fixed.append((i, getter))
                plan.checked.append((i, arg))
        elif isinstance(arg, str):
            # torch reads its flags as truthy values (``amsgrad="yes"``); the kernels take bools
            plan.hyper.append((i, arg, kinds[i].annotation in (bool, "bool")))
        elif arg is PARAMS:
            plan.fixed.append((i, _params))
        elif arg is GRADS:
            plan.fixed.append((i, _grads))
        elif arg is LR:
            object.__setattr__(plan, "lr_index", i)
        else:
            plan.base[i] = "auto"  # IMPL
            object.__setattr__(plan, "impl_index", i)
    return plan
