"""optax-contrib's Schedule-Free wrapper (Defazio et al., 2024) and its evaluation helper.

The params the optimizer updates are the gradient points ``y = b1 * x + (1 - b1) * z``; the
state keeps ``z`` (the base optimizer's iterate) and ``x`` is recomputed from ``y`` and ``z``;
evaluate the model at ``x``: :func:`schedule_free_eval_params`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import debias, moment, store
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._transforms.hyperparams import InjectHyperparamsState
from functional_optim._transforms.scale import Schedule
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = [
    "ScaleByRmsWithCountState",
    "ScheduleFreeState",
    "scale_by_rms_debiased",
    "schedule_free",
    "schedule_free_eval_params",
]


class ScheduleFreeState(NamedTuple):
    """State of :func:`schedule_free` (optax-contrib's fields)."""

    b1: Tensor
    weight_sum: Tensor
    step_count: Tensor
    max_lr: Tensor
    base_optimizer_state: OptState
    z: PyTree


class ScaleByRmsWithCountState(NamedTuple):
    """State of :func:`scale_by_rms_debiased`: per-param counts and the second moment."""

    count: PyTree
    nu: PyTree


@transform_factory
def scale_by_rms_debiased(
    decay: float | Tensor = 0.999, eps: float | Tensor = 1e-8
) -> GradientTransformation:
    """optax's ``scale_by_rms(decay, eps, eps_in_sqrt=False, bias_correction=True)``:
    ``g / (sqrt(nu / (1 - decay**t)) + eps)``, i.e. Adam without momentum.

    Args:
        decay: decay of the second moment.
        eps: added outside the root.

    Returns:
        A ``GradientTransformation`` with state :class:`ScaleByRmsWithCountState`.
    """

    def init(params: PyTree) -> ScaleByRmsWithCountState:
        return ScaleByRmsWithCountState(_ops.zero_counts(params), tree_zeros_like(params))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(g: Tensor, count: Tensor, nu: Tensor) -> tuple[Tensor, ...]:
            new_nu = moment(g, nu, decay, 2)
            count = _ops.increment(count, inplace)
            scaling = 1 / (torch.sqrt(debias(new_nu, decay, count)) + eps)
            return scaling * g, count, store(nu, new_nu, inplace)

        return _ops.map_state(updates, state, ScaleByRmsWithCountState, leaf)

    lists = leafwise_lists("scale_by_rms_debiased", {"decay": decay, "eps": eps}, update)
    return GradientTransformation(init, update, lists=lists)


def _find_state(state: OptState) -> ScheduleFreeState | None:
    if isinstance(state, ScheduleFreeState):
        return state
    if isinstance(state, InjectHyperparamsState):
        return _find_state(state.inner_state)
    if isinstance(state, tuple):
        for child in state:
            found = _find_state(child)
            if found is not None:
                return found
    return None


def schedule_free_eval_params(state: OptState, params: PyTree) -> PyTree:
    """The params to evaluate a Schedule-Free model at: ``x = (y - (1 - b1) * z) / b1``.

    Args:
        state: the state of a :func:`schedule_free` transform (or of a chain or injected
            transform holding one).
        params: the current params ``y``.

    Returns:
        ``x``, a new pytree shaped like ``params``.

    Raises:
        ValueError: if ``state`` holds no ``ScheduleFreeState``.
    """
    sf = _find_state(state)
    if sf is None:
        raise ValueError(
            "schedule_free_eval_params requires the state of a schedule_free transform"
        )
    leaves, spec = tree_flatten(params)
    zs: list[Any] = spec.flatten_up_to(sf.z)
    b1 = sf.b1
    out = [
        None if y is None else (y - (1.0 - _ops.like(b1, y)) * z) / _ops.like(b1, y)
        for y, z in zip(leaves, zs, strict=True)
    ]
    return spec.unflatten(out)


def _copy(params: PyTree) -> PyTree:
    """A copy of the params for ``z``: detached from a ``torch.nn.Parameter`` (module params, as
    torch.optim keeps its state), kept in the graph otherwise (meta-gradients w.r.t. params)."""
    leaves, spec = tree_flatten(params)
    return spec.unflatten(
        [
            None
            if p is None
            else p.detach().clone()
            if isinstance(p, torch.nn.Parameter)
            else p.clone()
            for p in leaves
        ]
    )


def _float_dtype(params: PyTree) -> torch.dtype:
    dtypes = [
        p.dtype for p in tree_flatten(params)[0] if isinstance(p, Tensor) and p.is_floating_point()
    ]
    if not dtypes:
        return torch.get_default_dtype()
    return min(dtypes, key=lambda d: torch.finfo(d).bits)


@transform_factory
def schedule_free(
    base_optimizer: GradientTransformation,
    learning_rate: float | Tensor | Schedule,
    b1: float | Tensor = 0.9,
    weight_lr_power: float | Tensor = 2.0,
) -> GradientTransformation:
    """Make ``base_optimizer`` schedule-free (turn off its momentum first).

    Each step: ``z += base_update``; the average ``x`` moves to ``z`` with weight
    ``c = max_lr**p / sum(max_lr**p)``; the new params are ``b1 * x + (1 - b1) * z``.

    Args:
        base_optimizer: gives the update of ``z`` (e.g. ``sgd`` or Adam without momentum).
        learning_rate: the base learning rate or schedule (only weights the average here).
        b1: interpolation between ``x`` and ``z`` (in (0, 1)).
        weight_lr_power: the power of the learning rate in the averaging weights.

    Returns:
        A ``GradientTransformation`` with state :class:`ScheduleFreeState`; ``update`` needs
        ``params``.

    Raises:
        TypeError: if ``base_optimizer`` is not a ``GradientTransformation``.
        ValueError: if ``b1`` is not in (0, 1].
    """
    if not isinstance(base_optimizer, GradientTransformation):
        raise TypeError(
            f"schedule_free needs a GradientTransformation, got {type(base_optimizer).__name__}"
        )
    if not isinstance(b1, Tensor) and not 0.0 < b1 <= 1.0:
        raise ValueError(f"schedule_free needs 0 < b1 <= 1, got {b1}")

    def init(params: PyTree) -> ScheduleFreeState:
        dtype = _float_dtype(params)
        return ScheduleFreeState(
            b1=torch.as_tensor(b1, dtype=dtype),
            weight_sum=torch.zeros((), dtype=dtype),
            step_count=torch.ones((), dtype=torch.int64),
            max_lr=torch.zeros((), dtype=dtype),
            base_optimizer_state=base_optimizer.init(params),
            z=_copy(params),
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        _ops.require_params(params, "schedule_free")
        lr: Any = learning_rate(state.step_count) if callable(learning_rate) else learning_rate
        max_lr = torch.maximum(state.max_lr, torch.as_tensor(lr, dtype=state.max_lr.dtype))
        weight = max_lr**weight_lr_power
        total = state.weight_sum + weight
        ratio = torch.nan_to_num(weight / total, nan=0.0, posinf=float("inf"))
        ck = torch.where(
            weight.isnan() | total.isnan(), torch.full_like(ratio, float("nan")), ratio
        )
        base_updates, base_state = base_optimizer.update(
            updates, state.base_optimizer_state, params, inplace=inplace
        )
        leaves, spec = tree_flatten(base_updates)
        ys: list[Any] = spec.flatten_up_to(params)
        zs: list[Any] = spec.flatten_up_to(state.z)
        out: list[Any] = []
        new_z: list[Any] = []
        for u, y, z in zip(leaves, ys, zs, strict=True):
            if u is None:
                out.append(None)
                new_z.append(z)
                continue
            z_next = (z + u).to(z.dtype)
            x_prev = (y - (1.0 - b1) * z) / b1
            c = _ops.like(ck, y)
            x = (1.0 - c) * x_prev + c * z_next
            out.append(b1 * x + (1.0 - b1) * z_next - y)
            new_z.append(store(z, z_next, inplace))
        step_count = state.step_count + 1
        if inplace:
            state.max_lr.copy_(max_lr)
            state.weight_sum.copy_(total)
            state.step_count.copy_(step_count)
            max_lr, total, step_count = state.max_lr, state.weight_sum, state.step_count
        new_state = ScheduleFreeState(
            state.b1, total, step_count, max_lr, base_state, spec.unflatten(new_z)
        )
        return spec.unflatten(out), new_state

    lists = leafwise_lists("schedule_free", {"b1": b1}, update)
    return GradientTransformation(init, update, lists=lists)
