"""Lazy per-parameter state set-up shared by the TorchScript functional optimizers.

Every ``FunctionalX`` keeps torch's state format, ``Dict[Tensor, Dict[str, Tensor]]`` keyed by
param, and turns ``(params, gradients)`` into the flat lists a kernel takes. These helpers do
that once for all of them (torch's eight ``_FunctionalX`` classes each copy it twice, in ``step``
and ``step_param``). All functions are TorchScript-compatible and called from scripted classes.

API (stable):

``step_dtype(fused) -> dtype``
    dtype of a new ``"step"`` tensor: float32 for fused kernels, else float64 when the default
    dtype is float64 and float32 otherwise (torch's ``_get_scalar_dtype``).
``new_step(param, fused) -> Tensor``
    A zero 0-d step tensor: on ``param``'s device for fused kernels, on CPU otherwise.
``ensure_state(state, param, keys, fills, with_step, fused) -> Dict[str, Tensor]``
    ``state[param]``, created if missing as ``{"step": 0 (if with_step), keys[j]:
    full_like(param, fills[j])}`` in that order.
``gather(state, params, gradients, keys, fills, with_step, fused)
    -> (params_with_grad, grads, buffers, steps)``
    Skips params whose gradient is None (no state is created for them), creates missing state,
    and returns ``buffers[j]`` = the ``keys[j]`` tensors of the params with a gradient and
    ``steps`` (empty when ``with_step`` is False).
``check_lengths(params, gradients)``
    Raises torch's ``ValueError`` when the two lists differ in length.
``check_not_empty(params, allow_empty)``
    Raises torch's ``ValueError("optimizer got an empty parameter list")``.
``make_param_group(params, allow_empty) -> Dict[str, List[Tensor]]``
    ``{"params": params}`` after :func:`check_not_empty`.
``pick_impl(params, foreach, fused, has_fused) -> str``
    The kernel path, resolved once at construction.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._local_shards import check_local_step, has_dtensor, local_tensors
from functional_optim.kernels._dispatch import resolve_impl


def step_dtype(fused: bool) -> torch.dtype:
    """Return the dtype of a new step tensor (torch's ``_get_scalar_dtype``)."""
    if fused:
        return torch.float32
    # torch.get_default_dtype() is not scriptable; a new 0-d tensor carries the default dtype.
    if torch.zeros(()).dtype == torch.float64:
        return torch.float64
    return torch.float32


def new_step(param: Tensor, fused: bool) -> Tensor:
    """Return a zero 0-d step: on ``param``'s device when ``fused``, else on CPU."""
    if fused:
        return torch.zeros((), dtype=step_dtype(fused), device=param.device)
    return torch.zeros((), dtype=step_dtype(fused))


def ensure_state(
    state: Dict[Tensor, Dict[str, Tensor]],
    param: Tensor,
    keys: List[str],
    fills: List[float],
    with_step: bool,
    fused: bool,
) -> Dict[str, Tensor]:
    """Return ``state[param]``, creating it if missing.

    Args:
        state: the optimizer state, keyed by param.
        param: the parameter.
        keys: names of the buffers shaped like ``param``.
        fills: initial value of each buffer (same length as ``keys``).
        with_step: whether the state holds a ``"step"`` tensor.
        fused: whether a fused kernel will read the step (see :func:`new_step`).

    Returns:
        The state dict of ``param``.
    """
    found = state.get(param)
    if found is not None:
        return found
    entry: Dict[str, Tensor] = {}
    if with_step:
        entry["step"] = new_step(param, fused)
    for j in range(len(keys)):
        fill = fills[j]
        if fill == 0.0:
            entry[keys[j]] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            entry[keys[j]] = torch.full_like(param, fill, memory_format=torch.preserve_format)
    state[param] = entry
    return entry


def gather(
    state: Dict[Tensor, Dict[str, Tensor]],
    params: List[Tensor],
    gradients: List[Optional[Tensor]],
    keys: List[str],
    fills: List[float],
    with_step: bool,
    fused: bool,
) -> Tuple[List[Tensor], List[Tensor], List[List[Tensor]], List[Tensor]]:
    """Build a kernel's flat lists for the params that have a gradient.

    Args:
        state: the optimizer state, keyed by param; missing entries are created.
        params: all params, in order.
        gradients: one gradient or None per param (same length as ``params``).
        keys: buffer names to collect, e.g. ``["exp_avg", "exp_avg_sq"]``.
        fills: initial value of each buffer when created.
        with_step: whether to create and collect ``"step"``.
        fused: whether a fused kernel will run (step placement and dtype).

    Returns:
        ``(params_with_grad, grads, buffers, steps)``; ``buffers[j]`` lists the ``keys[j]``
        tensors in order and ``steps`` is empty when ``with_step`` is False. DTensor params,
        gradients and buffers are returned as their local tensors (eager mode).
    """
    params_with_grad: List[Tensor] = []
    grads: List[Tensor] = []
    buffers: List[List[Tensor]] = [[] for _ in range(len(keys))]
    steps: List[Tensor] = []
    for i in range(len(params)):
        grad = gradients[i]
        if grad is not None:
            param = params[i]
            entry = ensure_state(state, param, keys, fills, with_step, fused)
            params_with_grad.append(param)
            grads.append(grad)
            for j in range(len(keys)):
                buffers[j].append(entry[keys[j]])
            if with_step:
                steps.append(entry["step"])
    if not torch.jit.is_scripting() and has_dtensor(params_with_grad):  # type: ignore[attr-defined]
        check_local_step(params_with_grad, grads, "functional optimizer")
        params_with_grad = local_tensors(params_with_grad)
        grads = local_tensors(grads)
        buffers = [local_tensors(b) for b in buffers]
    return params_with_grad, grads, buffers, steps


def check_lengths(params: List[Tensor], gradients: List[Optional[Tensor]]) -> None:
    """Raise torch's ``ValueError`` if ``gradients`` and ``params`` differ in length."""
    if len(params) != len(gradients):
        raise ValueError(
            "the gradients passed in does not equal to the size of the parameters!"
            + "Params length: "
            + str(len(params))
            + ". "
            + "Gradients length: "
            + str(len(gradients))
        )


def check_not_empty(params: List[Tensor], allow_empty: bool) -> None:
    """Raise torch's ``ValueError`` for an empty param list unless ``allow_empty``."""
    if len(params) == 0 and not allow_empty:
        raise ValueError("optimizer got an empty parameter list")


def make_param_group(params: List[Tensor], allow_empty: bool) -> Dict[str, List[Tensor]]:
    """Return the single param group ``{"params": params}``.

    Raises:
        ValueError: if ``params`` is empty and not ``allow_empty`` (torch's message).
    """
    check_not_empty(params, allow_empty)
    return {"params": params}


def pick_impl(params: List[Tensor], foreach: bool, fused: bool, has_fused: bool) -> str:
    """Resolve the kernel path once: explicit ``fused``/``foreach`` flags win (fused first, as
    in torch's functional API), else the fastest for the device (fused on CPU). The kernels
    step a DTensor's local shard, a plain tensor: any fused kernel takes it."""
    if fused:
        return resolve_impl("fused", params, has_fused)
    if foreach:
        return "foreach"
    return resolve_impl("auto", params, has_fused, True, True)
