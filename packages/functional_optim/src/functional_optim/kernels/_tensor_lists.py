"""Small TorchScript-compatible helpers for the multi-tensor and fused kernel paths.

``group_by_device_dtype(tensors) -> List[List[int]]``
    Indices of ``tensors`` grouped by (device, dtype) in first-seen order, like torch's
    ``Optimizer._group_tensors_by_device_and_dtype`` (foreach fast paths and fused kernels need
    one device and dtype per call). Gather a group with ``_dispatch.take``.
``real_views(tensors) -> List[Tensor]``
    A new list where each complex tensor is replaced by ``torch.view_as_real`` of it (torch's
    ``_view_as_real``, without mutating the caller's list).
``has_complex(tensors) -> bool``
    Whether any tensor is complex.
``has_sparse(tensors) -> bool``
    Whether any tensor is sparse.
``increment_steps(steps)``
    Adds 1 to every 0-d step of one (device, dtype) group, in torch's foreach way.
``check_lengths(kernel, params, lists, names)``
    Raises ``ValueError`` unless every list in ``lists`` has one tensor per param.
"""

from operator import attrgetter
from typing import List

import torch
from torch import Tensor

_DEVICE = attrgetter("device")
_DTYPE = attrgetter("dtype")


@torch.jit.unused
def _one_device_dtype(tensors: List[Tensor]) -> bool:
    """Eager: whether every tensor has the first one's device and dtype (two ``map`` passes, a
    third of the loop's cost on 1000 tensors; run by every fused step)."""
    return len(set(map(_DEVICE, tensors))) == 1 and len(set(map(_DTYPE, tensors))) == 1


def group_by_device_dtype(tensors: List[Tensor]) -> List[List[int]]:
    """Group the indices of ``tensors`` by (device, dtype), keeping first-seen order.

    Args:
        tensors: the tensors to group (usually the params).

    Returns:
        One list of indices per distinct (device, dtype); a single group in the common case.
    """
    n = len(tensors)
    if n == 0:
        return []
    first = tensors[0]
    same = True
    if not torch.jit.is_scripting():  # type: ignore[attr-defined]
        same = _one_device_dtype(tensors)
    else:
        for t in tensors:
            if t.device != first.device or t.dtype != first.dtype:
                same = False
                break
    if same:
        return [list(range(n))]
    keys: List[str] = []
    groups: List[List[int]] = []
    for i in range(n):
        t = tensors[i]
        key = str(t.device) + "|" + str(t.dtype)
        found = -1
        for k in range(len(keys)):
            if keys[k] == key:
                found = k
                break
        if found < 0:
            keys.append(key)
            groups.append([i])
        else:
            groups[found].append(i)
    return groups


def real_views(tensors: List[Tensor]) -> List[Tensor]:
    """Return a new list with every complex tensor replaced by its real view."""
    out: List[Tensor] = []
    for t in tensors:
        if torch.is_complex(t):
            out.append(torch.view_as_real(t))
        else:
            out.append(t)
    return out


def has_complex(tensors: List[Tensor]) -> bool:
    """Return whether any of ``tensors`` is complex."""
    # A loop, not any(<generator>): TorchScript has no generator expressions.
    for t in tensors:  # noqa: SIM110
        if torch.is_complex(t):
            return True
    return False


def has_sparse(tensors: List[Tensor]) -> bool:
    """Return whether any of ``tensors`` is sparse."""
    # A loop, not any(<generator>): TorchScript has no generator expressions.
    for t in tensors:  # noqa: SIM110
        if t.is_sparse:
            return True
    return False


def increment_steps(steps: List[Tensor]) -> None:
    """Add 1 in place to the non-empty group ``steps`` (one device), as torch's foreach Adam does.

    On CPU one wrapped CPU scalar serves all steps, as in torch (same overload, same result).
    """
    if steps[0].is_cpu:
        torch._foreach_add_(steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
    else:
        torch._foreach_add_(steps, 1)


def check_lengths(
    kernel: str, params: List[Tensor], lists: List[List[Tensor]], names: List[str]
) -> None:
    """Raise ``ValueError`` unless each of ``lists`` holds exactly one tensor per param.

    Args:
        kernel: the kernel's name, for the message.
        params: the parameters.
        lists: the per-param lists (grads, state buffers, steps).
        names: the name of each list in ``lists``.

    Raises:
        ValueError: if a list's length differs from ``len(params)``.
    """
    for j in range(len(lists)):
        if len(lists[j]) != len(params):
            raise ValueError(
                kernel
                + ": expected one tensor per param in "
                + names[j]
                + " ("
                + str(len(params))
                + "), got "
                + str(len(lists[j]))
            )


def scalar_value(t: Tensor) -> float:
    """A 0-d state tensor (a step count) as the number the maths uses: ``float(t.item())``;
    under ``torch.compile`` the tensor itself (as torch's ``_get_value``), so that reading it
    does not break the graph. TorchScript takes the first branch only."""
    if not torch.jit.is_scripting() and torch.compiler.is_compiling():  # type: ignore[attr-defined]
        return t  # type: ignore[return-value]
    return float(t.item())
