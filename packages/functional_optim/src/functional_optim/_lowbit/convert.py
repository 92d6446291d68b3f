"""Convert ``fo.Optimizer`` state dicts between low-bit and fp32 moments.

A low-bit param's state has ``<key>_codes`` and ``<key>_scales`` where an fp32 optimizer has
``<key>`` (:mod:`.transform`). :func:`dequantized_state_dict` gives the fp32 form (loadable
into ``torch.optim.AdamW``, ``fo.adamw``, ...); :func:`quantized_state_dict` the low-bit form
(loadable into ``fo.adamw8bit`` & co). Dequantising is exact (the values the low-bit optimizer
steps with); quantising rounds each element to the nearest code of its block: the error is
at most half the largest gap between neighbouring codes times the block's scale (see
:func:`max_error`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._lowbit import blockwise
from functional_optim._lowbit.codes import code_map
from functional_optim._lowbit.state_tree import NON_NEGATIVE
from functional_optim._lowbit.transform import check_lowbit_args

__all__ = ["dequantized_state_dict", "max_error", "quantized_state_dict"]

_LOWBIT_KEYS = ("kind", "block_size", "min_size")


def max_error(kind: str, key: str) -> float:
    """The largest rounding error of quantising field ``key``, relative to its block's scale
    (half the largest gap between neighbouring codes)."""
    table = code_map(kind, key not in NON_NEGATIVE).table
    finite = torch.unique(table[table.abs() <= 1])  # int8's unused codes lie above 1
    return float((finite[1:] - finite[:-1]).max()) / 2


def _groups_of(state_dict: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {i: g for g in state_dict["param_groups"] for i in g["params"]}


def dequantized_state_dict(
    state_dict: dict[str, Any], params: Sequence[Tensor | torch.Size]
) -> dict[str, Any]:
    """The fp32 form of a low-bit optimizer's ``state_dict()``.

    Args:
        state_dict: from ``fo.Optimizer(params, fo.adamw8bit(...)).state_dict()``.
        params: the params (or their shapes) in state-dict index order.

    Returns:
        A new state dict: ``<key>`` (fp32, the param's shape) instead of the codes and scales,
        and param groups without ``kind`` / ``block_size`` / ``min_size``.
    """
    groups = _groups_of(state_dict)
    out = copy.copy(state_dict)
    out["state"] = {}
    for index, entry in state_dict["state"].items():
        group = groups[index]
        shape = torch.Size(
            params[index].shape if isinstance(params[index], Tensor) else params[index]
        )
        new = {}
        for name, value in entry.items():
            if name.endswith("_scales"):
                continue
            if not name.endswith("_codes"):
                new[name] = value
                continue
            key = name[: -len("_codes")]
            cmap = code_map(group["kind"], key not in NON_NEGATIVE)
            scales = entry[f"{key}_scales"]
            region = blockwise.dequantize(
                value, scales, cmap, group["block_size"], 0, scales.numel() * group["block_size"]
            )
            new[key] = region[: shape.numel()].view(shape).clone()
        out["state"][index] = new
    out["param_groups"] = [
        {k: v for k, v in g.items() if k not in _LOWBIT_KEYS} for g in state_dict["param_groups"]
    ]
    return out


def quantized_state_dict(
    state_dict: dict[str, Any],
    kind: str = "int8",
    block_size: int = 256,
    min_size: int = 4096,
) -> dict[str, Any]:
    """The low-bit form of an fp32 optimizer's ``state_dict()`` (torch's or ``fo``'s).

    Args:
        state_dict: e.g. from ``torch.optim.AdamW(...).state_dict()``.
        kind, block_size, min_size: as the low-bit optimizer that will load it.

    Returns:
        A new state dict: every param-shaped fp32 entry of a param with at least ``min_size``
        elements becomes ``<key>_codes`` / ``<key>_scales`` (error: :func:`max_error` times
        the block scale); the param groups get ``kind``, ``block_size`` and ``min_size``.
    """
    check_lowbit_args(kind, block_size, min_size)
    out = copy.copy(state_dict)
    out["state"] = {}
    for index, entry in state_dict["state"].items():
        new: dict[str, Any] = {}
        sizes = {v.numel() for k, v in entry.items() if isinstance(v, Tensor) and k != "step"}
        for name, value in entry.items():
            big = isinstance(value, Tensor) and value.is_floating_point()
            if not big or name == "step" or value.numel() < max(min_size, 2) or len(sizes) != 1:
                new[name] = value
                continue
            cmap = code_map(kind, name not in NON_NEGATIVE)
            blocks = -(-value.numel() // block_size)
            region = torch.zeros(blocks * block_size, dtype=torch.float32, device=value.device)
            region[: value.numel()] = value.reshape(-1)
            codes = torch.zeros(blockwise.code_bytes(region.numel(), cmap), dtype=torch.uint8)
            scales = torch.zeros(blocks)
            absmax = blockwise.block_absmax(region, block_size)
            blockwise.quantize(region, absmax, cmap, codes, scales, block_size, 0)
            new[f"{name}_codes"], new[f"{name}_scales"] = codes, scales
        out["state"][index] = new
    out["param_groups"] = [
        {**g, "kind": kind, "block_size": block_size, "min_size": min_size}
        for g in state_dict["param_groups"]
    ]
    return out
