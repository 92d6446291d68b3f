"""Argument checks and the parameter claims of :func:`dist_runtime.optimizer_in_backward`.

Everything here runs before a hook is registered, so bad input changes nothing.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from dist_runtime.backward_step_wrappers import wrapper_kind
from functional_optim import GradientTransformation
from functional_optim import Optimizer as TransformOptimizer

__all__ = [
    "ClipMode",
    "OptimizerFactory",
    "check_options",
    "claim",
    "is_claimed",
    "build_optimizer",
    "named_params",
    "release",
]


class _Owner(Protocol):
    removed: bool


ClipMode = Literal["previous", "two_pass"]
OptimizerFactory = Callable[[list[Tensor]], Any] | GradientTransformation
_CLIP_MODES = ("previous", "two_pass")
# id(param) -> (param, handle) for the params of every live handle (both weak)
_CLAIMED: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Any]]] = {}


def is_claimed(p: Tensor) -> bool:
    """Whether ``p`` steps in backward in a live (not removed) handle."""
    entry = _CLAIMED.get(id(p))
    if entry is None:
        return False
    param, handle = entry[0](), entry[1]()
    return param is p and handle is not None and not handle.removed


def named_params(model_or_params: Any) -> list[tuple[str, Tensor]]:
    """The params to step, named by FQN (a module) or position (a list); checked."""
    if isinstance(model_or_params, nn.Module):
        inner = getattr(model_or_params, "module", model_or_params)
        root = inner if wrapper_kind(model_or_params) == "ddp" else model_or_params
        named = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("optimizer_in_backward got a module without trainable parameters")
        return named
    if isinstance(model_or_params, Tensor) or not isinstance(model_or_params, Iterable):
        raise TypeError(
            "model_or_params should be an nn.Module or an iterable of Tensors, but got "
            f"{type(model_or_params).__name__}"
        )
    named = [(str(i), p) for i, p in enumerate(model_or_params)]
    if not named:
        raise ValueError("optimizer_in_backward got an empty parameter list")
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(
                f"optimizer_in_backward can only step Tensors, but param {name} is "
                f"{type(p).__name__}"
            )
        if not p.requires_grad:
            raise ValueError(f"param {name} does not require grad: it would never be stepped")
        if not p.is_leaf:
            raise ValueError(f"can't optimize a non-leaf Tensor (param {name})")
    return named


def check_options(accumulation_steps: Any, clip_grad_norm: Any, clip_mode: Any) -> None:
    """Raise TypeError/ValueError for bad ``optimizer_in_backward`` options."""
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(
            f"accumulation_steps must be an int, got {type(accumulation_steps).__name__}"
        )
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if clip_mode not in _CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {_CLIP_MODES}, got {clip_mode!r}")
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, int | float):
            raise TypeError(
                f"clip_grad_norm must be a number or None, got {type(clip_grad_norm).__name__}"
            )
        if not (math.isfinite(clip_grad_norm) and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be positive and finite, got {clip_grad_norm}")


def build_optimizer(make: OptimizerFactory, p: Tensor, name: str) -> torch.optim.Optimizer:
    """``p``'s own optimizer, from a factory or a transform; checked."""
    made = make if isinstance(make, GradientTransformation) else make([p])
    if isinstance(made, GradientTransformation):
        made = TransformOptimizer([p], made)
    if not isinstance(made, torch.optim.Optimizer):
        raise TypeError(
            "make_optimizer must return a torch.optim.Optimizer or a GradientTransformation, "
            f"got {type(made).__name__} for param {name}"
        )
    held = [q for group in made.param_groups for q in group["params"]]
    if len(held) != 1 or held[0] is not p:
        raise ValueError(
            f"make_optimizer([param]) must return an optimizer over exactly that param, got one "
            f"over {len(held)} tensor(s) for param {name}"
        )
    closure_tx = isinstance(made, TransformOptimizer) and getattr(
        made.transform.step, "needs_closure", False
    )
    if closure_tx or isinstance(made, torch.optim.LBFGS):
        raise ValueError("an optimizer that re-evaluates a closure (LBFGS) cannot step in backward")
    return made


def claim(p: Tensor, owner: _Owner) -> None:
    """Record that ``p`` steps in ``owner`` (until :func:`release` or ``owner.removed``)."""
    _CLAIMED[id(p)] = (weakref.ref(p), weakref.ref(owner))


def release(p: Tensor) -> None:
    """Forget ``p``'s claim."""
    entry = _CLAIMED.get(id(p))
    if entry is not None and entry[0]() is p:
        del _CLAIMED[id(p)]
