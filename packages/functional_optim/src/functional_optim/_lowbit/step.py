"""The fused ``step`` of :func:`~.transform.quantized_state`, batch by batch (see there)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from functional_optim._kernel_runner import running_with
from functional_optim._lowbit import blockwise
from functional_optim._lowbit.adam_maths import EagerAdam
from functional_optim._lowbit.fused_step import fused_step
from functional_optim._lowbit.layout import cached_layout
from functional_optim._lowbit.placements import group_placements
from functional_optim._lowbit.state_tree import (
    NON_NEGATIVE,
    FieldRef,
    get_field,
    per_param_fields,
    replace_fields,
    up_to,
)
from functional_optim._tree import NAMESPACE, NONE_IS_LEAF, TreeSpec, tree_flatten, tree_unflatten

__all__ = ["ONE_PASS_KINDS", "check_grads", "moment_refs", "quantized_step"]

#: the kinds whose Adam / AdamW step on CPU is one C++ pass (:mod:`.fused_step`)
ONE_PASS_KINDS = ("int8", "fp8", "int4")

#: the compiled codec takes batches this many times larger (fewer calls: each costs ~0.2 ms)
COMPILED_BATCH_FACTOR = 4


def check_grads(params: Sequence[Tensor], grads: Sequence[Any]) -> None:
    """Every gradient has its param's shape; quantised params are contiguous."""
    for j, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is not None and g.shape != p.shape:
            raise ValueError(
                f"the gradient of param {j} has shape {list(g.shape)} but the param has "
                f"{list(p.shape)}; nothing was changed"
            )


def moment_refs(
    inner: Any, moments: Sequence[Any], tree: TreeSpec
) -> tuple[list[FieldRef], list[FieldRef]]:
    """The inner state's moment fields (in the order of ``moments``) and its other per-param
    fields."""
    refs = {ref.key: ref for ref in per_param_fields(inner, tree)}
    keys = [type(m)._fields[0][: -len("_codes")] for m in moments]
    moment = [refs[k] for k in keys]
    return moment, [r for r in refs.values() if r.key not in keys]


def _flat(
    leaves: list[Tensor | None],
    quant: list[bool],
    sizes: list[int],
    total: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, list[Tensor | None]]:
    """One buffer of ``total`` units holding every quantised param's run (``sizes`` units
    each, in order), and the leaves as views into it (copied there unless they are)."""
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += n
    present = [(j, t) for j, t in enumerate(leaves) if quant[j] and t is not None]
    if present:
        j0, t0 = present[0]
        base = t0.storage_offset() - starts[j0]
        storage = t0.untyped_storage()
        if (
            base >= 0
            and storage.nbytes() >= (base + total) * t0.element_size()
            and all(
                t.untyped_storage().data_ptr() == storage.data_ptr()
                and t.storage_offset() == base + starts[j]
                and t.numel() == sizes[j]
                for j, t in present
            )
        ):
            flat = torch.empty(0, dtype=dtype, device=device).set_(storage, base, (total,), (1,))
            return flat, leaves
    flat = torch.zeros(total, dtype=dtype, device=device)  # code 0 / scale 0: zeros
    out: list[Tensor | None] = list(leaves)
    for j, t in enumerate(leaves):
        if quant[j] and t is not None:
            view = flat[starts[j] : starts[j] + sizes[j]]
            view.copy_(t)
            out[j] = view
    return flat, out


def _group_tensors(inner: Any, refs: Sequence[FieldRef]) -> list[Tensor]:
    """The tensor leaves of ``inner`` outside its per-param fields (group-level state)."""
    bare = replace_fields(inner, dict.fromkeys(refs))
    leaves = optree.tree_leaves(bare, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    return [x for x in leaves if isinstance(x, Tensor)]


class _Run:
    """One step's lists: params, grads, moment and scalar leaves, and the results."""

    def __init__(
        self,
        spec: Any,
        params: list[Tensor],
        grads: list[Any],
        inner: Any,
        moments: list[Any],
        tree: TreeSpec,
    ) -> None:
        self.spec, self.params, self.grads, self.tree = spec, params, grads, tree
        self.moment_refs, self.scalar_refs = moment_refs(inner, moments, tree)
        self.inner = inner
        self.fp32 = [up_to(tree, get_field(inner, r)) for r in self.moment_refs]
        self.scalars = [up_to(tree, get_field(inner, r)) for r in self.scalar_refs]
        self.new_scalars = [list(s) for s in self.scalars]
        group = _group_tensors(inner, [*self.moment_refs, *self.scalar_refs])
        self.group = group
        self.group_start = [t.clone() for t in group]
        self.calls = 0

    def call(
        self,
        js: list[int],
        pp: list[Tensor],
        gg: list[Any],
        moments: list[list[Any]],
        split: set[int],
    ) -> list[list[Any]]:
        """Run the inner step on pieces ``pp`` (of params ``js``); returns the new moment
        leaves per field and records the scalar ones."""
        if self.calls:  # group-level state advances once per step, not once per batch
            for t, t0 in zip(self.group, self.group_start, strict=True):
                t.copy_(t0)
        self.calls += 1
        values: dict[FieldRef, Any] = {}
        for ref, leaves in zip(self.moment_refs, moments, strict=True):
            values[ref] = leaves
        for ref, leaves in zip(self.scalar_refs, self.scalars, strict=True):
            values[ref] = [
                leaves[j].clone() if j in split and isinstance(leaves[j], Tensor) else leaves[j]
                for j in js
            ]
        new = self.spec.tx.step(pp, gg, replace_fields(self.inner, values))
        self.last = new
        for k, ref in enumerate(self.scalar_refs):
            got = get_field(new, ref)
            for j, x in zip(js, got, strict=True):
                self.new_scalars[k][j] = x
        return [list(get_field(new, ref)) for ref in self.moment_refs]


def quantized_step(spec: Any, params: Any, grads: Any, state: Any) -> Any:
    """The fused step (see :mod:`.transform`)."""
    inner, *moments = state
    leaves, tree = tree_flatten(params)
    g_leaves = up_to(tree, grads)
    check_grads(leaves, g_leaves)
    placements, slots, all_reduce_max = group_placements(leaves)
    quant = [spec.quantised(p, pl) for p, pl in zip(leaves, placements, strict=True)]
    sizes = [p.numel() if q else 0 for p, q in zip(leaves, quant, strict=True)]
    compiled = spec.compiled(sum(sizes), leaves)
    batch = spec.batch * COMPILED_BATCH_FACTOR if compiled else spec.batch
    layout = cached_layout(tuple(sizes), tuple(placements), spec.bs, batch)
    run = _Run(spec, leaves, g_leaves, inner, moments, tree)
    cmaps = [spec.cmap(r) for r in run.moment_refs]
    codecs = [spec.codec(cmap, batch if compiled else 0) for cmap in cmaps]
    device = leaves[0].device if leaves else torch.device("cpu")
    checked = []
    for k, (m, ref) in enumerate(zip(moments, run.moment_refs, strict=True)):
        c_leaves, s_leaves, run.fp32[k] = spec.check_fit(
            ref, leaves, quant, layout, up_to(tree, m[0]), up_to(tree, m[1]), run.fp32[k]
        )
        checked.append((c_leaves, s_leaves))
    plain = [j for j, q in enumerate(quant) if not q]
    if plain:
        new = run.call(
            plain,
            [leaves[j] for j in plain],
            [g_leaves[j] for j in plain],
            [[f[j] for j in plain] for f in run.fp32],
            set(),
        )
        for f, got in zip(run.fp32, new, strict=True):
            for j, x in zip(plain, got, strict=True):
                f[j] = x
    bs = spec.bs
    stash: list[tuple[int, int, int, Tensor]] = []  # field, slot, flat block, values
    partial = torch.zeros(len(moments) * slots, device=device) if slots else None
    quantised = [j for j, q in enumerate(quant) if q]
    codes = [c for c, _ in checked]
    scales = [s for _, s in checked]
    codes_flat: list[Tensor] = []
    scales_flat: list[Tensor] = []
    fused = False
    if spec.kind in ONE_PASS_KINDS and spec.compile is not False:
        second = [r.key in NON_NEGATIVE for r in run.moment_refs]
        fused = fused_step(run, quantised, g_leaves, layout, checked, second, bs, spec.kind, cmaps)
    if not fused:
        for k, cmap in enumerate(cmaps):
            runs = [blockwise.code_bytes(layout.region[j][1], cmap) for j in range(len(leaves))]
            total = blockwise.code_bytes(layout.elements, cmap)
            cf, codes[k] = _flat(codes[k], quant, runs, total, torch.uint8, device)
            blocks = [b[1] for b in layout.blocks]
            sf, scales[k] = _flat(
                scales[k], quant, blocks, layout.elements // bs, torch.float32, device
            )
            codes_flat.append(cf)
            scales_flat.append(sf)
        # low-bit Adam on CPU: the C++ step's maths on every path (see .adam_maths)
        same_maths = spec.kind in ONE_PASS_KINDS and device.type == "cpu"
        with running_with(EagerAdam()) if same_maths else contextlib.nullcontext():
            flat = (codes, scales, codes_flat, scales_flat)
            shared = (stash, partial, slots)
            _batches(spec, run, layout, leaves, g_leaves, cmaps, codecs, flat, shared)
    if partial is not None:
        full = all_reduce_max(partial)
        for k, slot, block, kept in stash:
            at = k * slots + slot
            blockwise.quantize(
                kept, full[at : at + 1], cmaps[k], codes_flat[k], scales_flat[k], bs, block * bs
            )
    values: dict[Any, Any] = {}
    for ref, f in zip(run.moment_refs, run.fp32, strict=True):
        values[ref] = tree_unflatten(tree, f)
    for ref, f in zip(run.scalar_refs, run.new_scalars, strict=True):
        values[ref] = tree_unflatten(tree, f)
    base = run.last if run.calls else inner
    new_inner = replace_fields(base, values)
    new_moments = [
        type(m)(tree_unflatten(tree, c), tree_unflatten(tree, s))
        for m, c, s in zip(moments, codes, scales, strict=True)
    ]
    return (new_inner, *new_moments)


def _batches(
    spec: Any,
    run: _Run,
    layout: Any,
    leaves: list[Tensor],
    g_leaves: list[Any],
    cmaps: list[Any],
    codecs: list[Any],
    flat: tuple[list[list[Any]], list[list[Any]], list[Tensor], list[Tensor]],
    shared: tuple[list[tuple[int, int, int, Tensor]], Tensor | None, int],
) -> None:
    """The batched step: dequantise a batch of blocks, run the inner step on its pieces,
    requantise (blocks shared with other ranks are kept in ``stash`` and ``partial``)."""
    codes, scales, codes_flat, scales_flat = flat
    stash, partial, slots = shared
    seen: dict[int, int] = {}
    for batch in layout.batches:
        for j, *_ in batch.pieces:
            seen[j] = seen.get(j, 0) + 1
    split = {j for j, n in seen.items() if n > 1}
    bs = spec.bs
    for batch in layout.batches:
        js = [j for j, *_ in batch.pieces]
        pp = [leaves[j].view(-1)[lo:hi] for j, lo, hi, _ in batch.pieces]
        gg = [
            None if g_leaves[j] is None else g_leaves[j].reshape(-1)[lo:hi]
            for j, lo, hi, _ in batch.pieces
        ]
        vals = [
            codec.dequantize(cf, sf, batch.start, batch.stop)
            for cf, sf, codec in zip(codes_flat, scales_flat, codecs, strict=True)
        ]
        # moments in their param's dtype, as torch.optim keeps them (fp32 values cast to it)
        piece_moments = []
        for k, v in enumerate(vals):
            piece_moments.append(
                [
                    None if codes[k][j] is None else v[e : e + hi - lo].to(p.dtype)
                    for p, (j, lo, hi, e) in zip(pp, batch.pieces, strict=True)
                ]
            )
        new = run.call(js, pp, gg, piece_moments, split)
        for k, v in enumerate(vals):
            for (j, lo, hi, e), given, got in zip(
                batch.pieces, piece_moments[k], new[k], strict=True
            ):
                if got is None:
                    continue
                home = v[e : e + hi - lo]
                if given is None or got.data_ptr() != home.data_ptr():
                    home.copy_(got.reshape(-1))
                if codes[k][j] is None:  # created by this step: its run of the flat buffers
                    start, length = layout.region[j]
                    per = 2 if cmaps[k].bits == 4 else 1
                    codes[k][j] = codes_flat[k][start // per : (start + length) // per]
                    b0, nb = layout.blocks[j]
                    scales[k][j] = scales_flat[k][b0 : b0 + nb]
            first = batch.start // bs
            for slot, block in layout.shared:
                if first <= block < batch.stop // bs:
                    stash.append(
                        (k, slot, block, v[(block - first) * bs : (block - first + 1) * bs].clone())
                    )
            absmax = codecs[k].quantize(v, codes_flat[k], scales_flat[k], batch.start)
            for k2, slot, block, _ in stash:
                if k2 == k and first <= block < batch.stop // bs:
                    assert partial is not None
                    at = k * slots + slot
                    partial[at] = torch.maximum(partial[at], absmax[block - first])
