"""The pure ``update`` of :func:`~.transform.quantized_state`: whole params dequantised, the
inner transform's update, requantised (the functional path, not the memory-lean one)."""

from __future__ import annotations

from typing import Any

import torch

from functional_optim._base import OptState
from functional_optim._lowbit import blockwise
from functional_optim._lowbit.layout import GroupLayout
from functional_optim._lowbit.placements import group_placements
from functional_optim._lowbit.state_tree import FieldRef, get_field, replace_fields, up_to
from functional_optim._lowbit.step import moment_refs
from functional_optim._tree import PyTree, tree_flatten, tree_unflatten

__all__ = ["pure_update"]


def pure_update(
    spec: Any, updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
) -> tuple[PyTree, OptState]:
    """The pure update: whole params dequantised, the inner update, requantised."""
    inner, *moments = state
    leaves, tree = tree_flatten(params if params is not None else updates)
    placements, slots, _ = group_placements(leaves)
    if slots:
        raise ValueError(
            "the pure update of low-bit states needs whole params; step sharded params with "
            "fo.Optimizer (the fused step)"
        )
    quant = [spec.quantised(p, pl) for p, pl in zip(leaves, placements, strict=True)]
    layout = GroupLayout(
        [p.numel() if q else 0 for p, q in zip(leaves, quant, strict=True)],
        placements,
        spec.bs,
        spec.batch,
    )
    refs, _ = moment_refs(inner, moments, tree)
    full: dict[FieldRef, Any] = {}
    for ref, m in zip(refs, moments, strict=True):
        cmap = spec.cmap(ref)
        fp32 = up_to(tree, get_field(inner, ref))
        out = []
        for j, (p, c, s) in enumerate(
            zip(leaves, up_to(tree, m[0]), up_to(tree, m[1]), strict=True)
        ):
            if c is None:
                out.append(fp32[j])
                continue
            region = blockwise.dequantize(c, s, cmap, spec.bs, 0, layout.region[j][1])
            pad = layout.pad_front[j]
            out.append(region[pad : pad + p.numel()].view(p.shape))
        full[ref] = tree_unflatten(tree, out)
    new_updates, new_inner = spec.tx.update(
        updates, replace_fields(inner, full), params, inplace=inplace
    )
    fields: dict[FieldRef, Any] = {}
    new_moments = []
    for ref, m in zip(refs, moments, strict=True):
        cmap = spec.cmap(ref)
        got = up_to(tree, get_field(new_inner, ref))
        keep: list[Any] = []
        codes: list[Any] = []
        scales: list[Any] = []
        for j, (p, x) in enumerate(zip(leaves, got, strict=True)):
            if not quant[j] or x is None:
                keep.append(x if not quant[j] else None)
                codes.append(None)
                scales.append(None)
                continue
            length = layout.region[j][1]
            region = torch.zeros(length, dtype=torch.float32, device=x.device)
            pad = layout.pad_front[j]
            region[pad : pad + p.numel()] = x.reshape(-1)
            c = spec.empty_codes(ref, length, x.device)
            s = torch.zeros(layout.blocks[j][1], device=x.device)
            blockwise.quantize(
                region, blockwise.block_absmax(region, spec.bs), cmap, c, s, spec.bs, 0
            )
            keep.append(None)
            codes.append(c)
            scales.append(s)
        fields[ref] = tree_unflatten(tree, keep)
        new_moments.append(type(m)(tree_unflatten(tree, codes), tree_unflatten(tree, scales)))
    return new_updates, (replace_fields(new_inner, fields), *new_moments)
