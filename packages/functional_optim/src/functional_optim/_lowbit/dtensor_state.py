"""Low-bit state of sharded DTensor params in ``state_dict()``: a layout DCP can reshard.

Live, a ``Shard(0)`` param's local shard keeps the codes and scales of the blocks it touches
(:mod:`.layout`); a block two ranks share is on both. ``fo.Optimizer.state_dict()`` gives
instead, per param and moment:

* ``<key>_codes``: one ``uint8`` code per element (4-bit codes unpacked), a DTensor with the
  param's shape and placements, so DCP splits it like the param;
* ``<key>_scales``: every block's scale (plain, the same on every rank: one MAX all-reduce of
  the blocks each rank holds), which DCP saves once.

``load_state_dict`` turns both back into the local shard's blocks (of whatever mesh the params
are on now). ``state_dict()`` is a collective for such params (DCP calls it on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._lowbit.placements import _dtensor_placement
from functional_optim._lowbit.regions import (
    elements_to_region,
    region_to_elements,
    touched_blocks,
)
from functional_optim._shard_context import _group_names

__all__ = ["export_sharded", "import_sharded"]

_CODES = "_codes"


def _sharded(p: Any) -> bool:
    return hasattr(p, "placements") and any(not pl.is_replicate() for pl in p.placements)


def _format(group: dict[str, Any]) -> tuple[int, int]:
    return int(group["block_size"]), 2 if group.get("kind") == "int4" else 1


def _keys(entry: dict[str, Any]) -> list[str]:
    return [k[: -len(_CODES)] for k in entry if k.endswith(_CODES) and f"{k[:-6]}_scales" in entry]


def export_sharded(
    param_groups: Sequence[dict[str, Any]], state: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """``state`` (torch's per-param dicts by index) with the low-bit entries of sharded
    DTensor params in their layout-free form (see the module docstring)."""
    out = dict(state)
    index = 0
    for group in param_groups:
        for p in group["params"]:
            entry = state.get(index)
            index += 1
            if entry is None or not _sharded(p) or not _keys(entry):
                continue
            place, dim = _dtensor_placement(p, f"param {index - 1}")
            block, per_byte = _format(group)
            local = p._local_tensor
            start, stop = place.offset, place.offset + local.numel()
            new = dict(entry)
            for key in _keys(entry):
                codes = region_to_elements(entry[key + _CODES], start, stop, block, per_byte)
                new[key + _CODES] = type(p).from_local(
                    codes.view(local.shape),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
                scales = entry[f"{key}_scales"]
                full = torch.zeros(-(-place.numel // block), device=scales.device)
                first, _ = touched_blocks(start, stop, block)
                full[first : first + scales.numel()] = scales
                if dim is not None:
                    (name,) = _group_names(p.device_mesh, (dim,))
                    full = torch.ops._c10d_functional.all_reduce(full, "max", name)
                    full = torch.ops._c10d_functional.wait_tensor(full)
                new[f"{key}_scales"] = full
            out[index - 1] = new
    return out


def import_sharded(
    param_groups: Sequence[dict[str, Any]], state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``state_dict`` with the layout-free low-bit entries of sharded DTensor params turned
    back into their local shards' blocks (other entries untouched)."""
    state = state_dict.get("state", {})
    new_state = dict(state)
    for group, saved in zip(param_groups, state_dict.get("param_groups", []), strict=False):
        for p, i in zip(group["params"], saved["params"], strict=False):
            entry = state.get(i)
            if entry is None or not _sharded(p) or not _keys(entry):
                continue
            codes0 = entry[_keys(entry)[0] + _CODES]
            if not hasattr(codes0, "_local_tensor") and codes0.numel() != p.numel():
                continue  # already this rank's blocks
            place, _ = _dtensor_placement(p, f"param {i}")
            block, per_byte = _format(saved if "block_size" in saved else group)
            local = p._local_tensor
            start, stop = place.offset, place.offset + local.numel()
            first, end = touched_blocks(start, stop, block)
            new = dict(entry)
            for key in _keys(entry):
                codes: Tensor = entry[key + _CODES]
                if hasattr(codes, "_local_tensor"):
                    elements = codes._local_tensor.reshape(-1)
                else:  # a whole parameter's codes
                    elements = codes.reshape(-1)[start:stop]
                new[key + _CODES] = elements_to_region(elements, start, stop, block, per_byte)
                new[f"{key}_scales"] = entry[f"{key}_scales"][first:end].clone()
            new_state[i] = new
    return {**state_dict, "state": new_state}
