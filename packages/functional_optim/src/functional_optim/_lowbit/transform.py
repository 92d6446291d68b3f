"""``quantized_state(tx, kind, block_size)``: any element-wise transform with low-bit moments.

The moments (per-param, param-shaped state: Adam's ``exp_avg`` / ``exp_avg_sq``, Lion's and
SGD's momentum, ...) of every floating-point param with at least ``min_size`` elements (of the
*whole* parameter, however it is sharded) are kept as codes and blockwise scales
(:mod:`.codes`, :mod:`.blockwise`); smaller params keep the inner transform's fp32 state.

The fused ``step`` walks the quantised params in batches of whole blocks (about 256K
elements): it dequantises a batch's moments, runs the inner transform's fused step on the
batch's pieces of params, gradients and moments (views), and requantises; the fp32 values of
a batch exist only while it is stepped. Blocks shared with other ranks (see :mod:`.layout`)
are finished after the last batch with one MAX all-reduce. The pure ``update`` dequantises
whole params (it is the differentiable, functional path, not the memory-lean one).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState
from functional_optim._lowbit import blockwise
from functional_optim._lowbit.codes import KINDS, CodeMap, code_map
from functional_optim._lowbit.layout import GroupLayout, Placement
from functional_optim._lowbit.placements import group_placements
from functional_optim._lowbit.state_tree import (
    NON_NEGATIVE,
    FieldRef,
    get_field,
    moment_type,
    per_param_fields,
    replace_fields,
    up_to,
)
from functional_optim._lowbit.step import quantized_step
from functional_optim._lowbit.update import pure_update
from functional_optim._recipes import transform_factory
from functional_optim._tree import NAMESPACE, NONE_IS_LEAF, PyTree, tree_flatten, tree_unflatten

__all__ = ["quantized_state"]

BATCH_ELEMENTS = 1 << 18
#: groups with at least this many full batches run the compiled codec (``compile=None``)
COMPILE_MIN_BATCHES = 4


@functools.cache
def _codec(cmap: CodeMap, block_size: int, compiled_run: int) -> blockwise.RunCodec:
    return blockwise.RunCodec(cmap, block_size, compiled_run)


@functools.cache
def _inductor_available() -> bool:
    """Whether torch.compile's inductor can build kernels here (a C++ compiler for CPU)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:
        return False
    return True


def check_lowbit_args(kind: str, block_size: int, min_size: int) -> None:
    """The constructor checks (``ValueError`` before anything is built)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 2
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"min_size must be a non-negative int, got {min_size!r}")


class _Spec:
    """One transform's constants: code maps, block size, threshold."""

    def __init__(
        self,
        tx: GradientTransformation,
        kind: str,
        block_size: int,
        min_size: int,
        compile: bool | None,
    ):
        self.tx, self.kind, self.bs, self.min_size = tx, kind, block_size, min_size
        self.batch = BATCH_ELEMENTS
        self.compile = compile

    def compiled(self, elements: int, params: Sequence[Tensor]) -> bool:
        """Whether a group of ``elements`` quantised elements runs the compiled codec."""
        if self.compile is not None:
            return self.compile
        if elements < COMPILE_MIN_BATCHES * self.batch or not params:
            return False
        return params[0].device.type in ("cpu", "cuda") and _inductor_available()

    def codec(self, cmap: CodeMap, compiled_run: int) -> blockwise.RunCodec:
        return _codec(cmap, self.bs, compiled_run)

    def cmap(self, ref: FieldRef) -> CodeMap:
        return code_map(self.kind, ref.key not in NON_NEGATIVE)

    def quantised(self, p: Tensor, place: Placement) -> bool:
        return place.numel >= max(self.min_size, 2)

    def empty_codes(self, ref: FieldRef, elements: int, device: torch.device) -> Tensor:
        """Codes of ``elements`` zeros (code 0 is exact zero in every map)."""
        size = blockwise.code_bytes(elements, self.cmap(ref))
        return torch.zeros(size, dtype=torch.uint8, device=device)

    def check_fit(
        self,
        ref: FieldRef,
        params: Sequence[Tensor],
        quant: Sequence[bool],
        layout: GroupLayout,
        codes: list[Any],
        scales: list[Any],
        fp32: list[Any],
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """The moment's leaves, checked against the layout of this step. A param whose state
        was laid out otherwise (another sharding, block size or threshold) is laid out anew
        if its state is still initial, else refused."""
        cmap = self.cmap(ref)
        codes, scales, fp32 = list(codes), list(scales), list(fp32)
        for j, p in enumerate(params):
            c, s, f = codes[j], scales[j], fp32[j]
            length, blocks = layout.region[j][1], layout.blocks[j][1]
            if quant[j]:
                ok = f is None and (
                    (c is None and s is None)
                    or (
                        c is not None
                        and s is not None
                        and c.numel() == blockwise.code_bytes(length, cmap)
                        and s.numel() == blocks
                    )
                )
            else:
                ok = c is None and s is None and (f is None or f.shape == p.shape)
            if ok:
                continue
            if not _pristine(c, s, f):
                raise ValueError(
                    f"the {ref.key!r} state of param {j} was laid out for another sharding, "
                    f"block size or min_size than this step's (block_size={self.bs}, "
                    f"min_size={self.min_size}); load it with the settings it was saved with"
                )
            if quant[j]:
                codes[j] = self.empty_codes(ref, length, p.device)
                scales[j] = torch.zeros(blocks, device=p.device)
                fp32[j] = None
            else:
                codes[j] = scales[j] = None
                fp32[j] = torch.zeros_like(p)
        return codes, scales, fp32


def _local(p: Tensor) -> Tensor:
    local = getattr(p, "_local_tensor", None)
    return local if isinstance(local, Tensor) else p


def _meta_like(p: Tensor) -> Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device="meta")


def _is_moment(leaves: Sequence[Any], params: Sequence[Tensor]) -> bool:
    shaped = [
        leaf is None or (isinstance(leaf, Tensor) and leaf.shape == p.shape and p.numel() > 1)
        for leaf, p in zip(leaves, params, strict=True)
    ]
    return all(shaped) and any(p.numel() > 1 for p in params)


def _real(leaf: Any, device: torch.device) -> Any:
    if isinstance(leaf, Tensor) and leaf.device.type == "meta":
        return torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)
    return leaf


def _check_zero_start(tx: GradientTransformation, dtype: torch.dtype) -> None:
    """Moments must start at zero (their codes start as code zero)."""
    probe = [torch.zeros(2, dtype=dtype)]
    state = tx.init(probe)
    spec = tree_flatten(probe)[1]
    for ref in per_param_fields(state, spec):
        leaf = up_to(spec, get_field(state, ref))[0]
        if isinstance(leaf, Tensor) and leaf.shape == (2,) and bool(leaf.ne(0).any()):
            raise ValueError(
                f"quantized_state needs moments that start at zero; {ref.key!r} starts at "
                f"{leaf.tolist()}"
            )


def _init(spec: _Spec, params: PyTree) -> OptState:
    leaves, tree = tree_flatten(params)
    for j, p in enumerate(leaves):
        if isinstance(p, Tensor) and not p.is_floating_point():
            raise ValueError(
                f"param {j} has dtype {p.dtype}; low-bit optimizer states need floating-point "
                "params"
            )
    inner = spec.tx.init(tree_unflatten(tree, [_meta_like(p) for p in leaves]))
    placements, _, _ = group_placements(leaves)
    local = [_local(p) for p in leaves]
    quant = [spec.quantised(p, pl) for p, pl in zip(local, placements, strict=True)]
    layout = GroupLayout(
        [p.numel() if q else 0 for p, q in zip(local, quant, strict=True)],
        placements,
        spec.bs,
        BATCH_ELEMENTS,
    )
    values: dict[FieldRef, Any] = {}
    moments: list[Any] = []
    for ref in per_param_fields(inner, tree):
        field = up_to(tree, get_field(inner, ref))
        if not _is_moment(field, leaves):
            values[ref] = tree_unflatten(
                tree, [_real(x, _local(p).device) for x, p in zip(field, leaves, strict=True)]
            )
            continue
        new: list[Any] = []
        codes: list[Any] = []
        scales: list[Any] = []
        for j, (x, p) in enumerate(zip(field, leaves, strict=True)):
            lazy = x is None
            if quant[j]:
                new.append(None)
                length = layout.region[j][1]
                codes.append(None if lazy else spec.empty_codes(ref, length, _local(p).device))
                scales.append(
                    None if lazy else torch.zeros(layout.blocks[j][1], device=_local(p).device)
                )
            else:
                new.append(None if lazy else torch.zeros_like(p))
                codes.append(None)
                scales.append(None)
        values[ref] = tree_unflatten(tree, new)
        moments.append(
            moment_type(ref.key)(tree_unflatten(tree, codes), tree_unflatten(tree, scales))
        )
    inner = replace_fields(inner, values)
    inner = _materialise(inner, leaves)
    return (inner, *moments)


def _materialise(inner: OptState, leaves: Sequence[Tensor]) -> OptState:
    """``inner`` with every meta tensor left by the meta ``init`` made real (zeros)."""
    device = _local(leaves[0]).device if leaves else torch.device("cpu")
    return optree.tree_map(
        lambda x: _real(x, device), inner, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE
    )


def _pristine(*tensors: Any) -> bool:
    """Whether the given state tensors still hold their initial values (all zero: code 0 is
    exact zero)."""
    return all(
        not isinstance(t, Tensor) or not t.numel() or not bool(t.ne(0).any()) for t in tensors
    )


@transform_factory
def quantized_state(
    tx: GradientTransformation,
    kind: str = "int8",
    block_size: int = 256,
    min_size: int = 4096,
    compile: bool | None = None,
) -> GradientTransformation:
    """Keep the moments of an element-wise transform as low-bit codes with blockwise scales.

    Args:
        tx: an element-wise transform with a fused ``step`` (Adam, AdamW, Lion, SGD with
            momentum, RMSprop, ... : every element's update reads only that element).
        kind: ``"int8"`` (an 8-bit minifloat: 3 fraction bits, 4 or 5 exponent bits),
            ``"int4"`` (dynamic exponent map, packed two per byte) or ``"fp8"``
            (``float8_e4m3fn``); second moments never round a non-zero value to zero.
        block_size: elements per scale, over the whole flattened parameter; a power of two.
        min_size: params with fewer elements (the whole parameter's count) keep fp32 state.
        compile: run the blockwise codec through ``torch.compile`` (same bits, several times
            faster, a few seconds of compilation on the first step); None: for groups of at
            least 1M quantised elements where inductor can build kernels. With Adam or AdamW
            on fp32 CPU params, None also runs the one-pass C++ step (same bits; built on
            first use, about 30 s, with the ``[cpu-kernels]`` extra's ninja); False runs torch
            ops only.

    Returns:
        A transform whose state is ``(inner state, Quantized_<key>(...), ...)``; in
        ``fo.Optimizer.state_dict()`` each quantised param has ``<key>_codes`` (``uint8``,
        1-D: the codes of the blocks the param touches, code zero in padding; 4-bit: two per
        byte, the even element in the low nibble) and ``<key>_scales`` (fp32, one per block:
        the block's largest magnitude) instead of torch's ``<key>``.

    Raises:
        ValueError: an unknown ``kind``, a ``block_size`` that is not a power of two, a
            transform without a fused step or whose moments do not start at zero; at
            ``init``, a non-floating-point param.
    """
    check_lowbit_args(kind, block_size, min_size)
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"tx must be a GradientTransformation, got {type(tx).__name__}")
    if tx.step is None:
        raise ValueError(
            "quantized_state needs a transform with a fused step (every element-wise alias, "
            "e.g. fo.adamw, has one)"
        )
    _check_zero_start(tx, torch.float32)
    spec = _Spec(tx, kind, block_size, min_size, compile)

    def init(params: PyTree) -> OptState:
        return _init(spec, params)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        return pure_update(spec, updates, state, params, inplace=inplace)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        return quantized_step(spec, params, grads, state)

    return GradientTransformation(init, update, step)
