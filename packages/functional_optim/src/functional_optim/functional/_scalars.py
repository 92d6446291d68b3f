"""State set-up for functional optimizers whose state holds 0-d scalars besides ``step``.

NAdam keeps ``mu_product`` and ASGD ``eta`` and ``mu`` per param, next to the buffers shaped
like the param. ``gather_with_scalars`` creates that state the first time a param has a
gradient, in torch's key order (``step``, the scalars, the buffers), and returns the kernel's
flat lists. TorchScript-compatible; called from the scripted classes.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._local_shards import check_local_step, has_dtensor, local_tensors
from functional_optim.functional._state import step_dtype


def _scalar(value: float, param: Tensor, on_device: bool) -> Tensor:
    """A 0-d ``value`` in the step dtype: on ``param``'s device when ``on_device``, else CPU."""
    if on_device:
        return torch.full((), value, dtype=step_dtype(False), device=param.device)
    return torch.full((), value, dtype=step_dtype(False))


def _ensure(
    state: Dict[Tensor, Dict[str, Tensor]],
    param: Tensor,
    scalar_keys: List[str],
    scalar_fills: List[float],
    keys: List[str],
    on_device: bool,
) -> Dict[str, Tensor]:
    """``state[param]``, created in torch's key order if missing."""
    found = state.get(param)
    if found is not None:
        return found
    entry: Dict[str, Tensor] = {"step": _scalar(0.0, param, on_device)}
    for j in range(len(scalar_keys)):
        entry[scalar_keys[j]] = _scalar(scalar_fills[j], param, on_device)
    for j in range(len(keys)):
        entry[keys[j]] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state[param] = entry
    return entry


def gather_with_scalars(
    state: Dict[Tensor, Dict[str, Tensor]],
    params: List[Tensor],
    gradients: List[Optional[Tensor]],
    scalar_keys: List[str],
    scalar_fills: List[float],
    keys: List[str],
    on_device: bool,
) -> Tuple[List[Tensor], List[Tensor], List[List[Tensor]], List[List[Tensor]], List[Tensor]]:
    """Build a kernel's flat lists for the params that have a gradient.

    Args:
        state: the optimizer state, keyed by param; missing entries are created.
        params: all params, in order.
        gradients: one gradient or None per param.
        scalar_keys: names of the 0-d state entries (after ``step``).
        scalar_fills: initial value of each scalar.
        keys: names of the zero-initialised buffers shaped like the param.
        on_device: create ``step`` and the scalars on the param's device (else on CPU).

    Returns:
        ``(params_with_grad, grads, scalars, buffers, steps)``; ``scalars[j]`` lists the
        ``scalar_keys[j]`` tensors and ``buffers[j]`` the ``keys[j]`` tensors. DTensor params,
        gradients and buffers are returned as their local tensors (eager mode).
    """
    params_with_grad: List[Tensor] = []
    grads: List[Tensor] = []
    scalars: List[List[Tensor]] = [[] for _ in range(len(scalar_keys))]
    buffers: List[List[Tensor]] = [[] for _ in range(len(keys))]
    steps: List[Tensor] = []
    for i in range(len(params)):
        grad = gradients[i]
        if grad is not None:
            param = params[i]
            entry = _ensure(state, param, scalar_keys, scalar_fills, keys, on_device)
            params_with_grad.append(param)
            grads.append(grad)
            for j in range(len(scalar_keys)):
                scalars[j].append(entry[scalar_keys[j]])
            for j in range(len(keys)):
                buffers[j].append(entry[keys[j]])
            steps.append(entry["step"])
    if not torch.jit.is_scripting() and has_dtensor(params_with_grad):  # type: ignore[attr-defined]
        check_local_step(params_with_grad, grads, "functional optimizer")
        params_with_grad = local_tensors(params_with_grad)
        grads = local_tensors(grads)
        buffers = [local_tensors(b) for b in buffers]
    return params_with_grad, grads, scalars, buffers, steps
