"""Per-leaf step counters that a list step increments in one op.

Transforms with a step count keep one 0-d counter per param leaf, as torch.optim keeps a
``state["step"]`` per param. Incrementing 1000 of them with ``torch._foreach_add_`` costs about
2 ms on CPU (one dispatch per tensor), about 5% of a 10M-param Lion step.
:func:`zero_counts` therefore makes the counters of one device 0-d views into one 1-D buffer
(a *block*), and :func:`increment_counts` adds 1 to the buffer in one op when the counters it
is given are exactly the views of one block, in order. Anything else (a subset of the leaves,
counters built by hand, copied, or mixed with another block) gets the ``_foreach_add_`` it
always got: the values are the same either way. ``from_torch_state`` (hence
``Optimizer.load_state_dict``) packs loaded counters into a new block (:func:`repacked_like`).

Each counter is still its own 0-d tensor (same dtype, device and values as before): per-leaf
maths reads and writes it like any other tensor, and a pure update (``count + 1``) returns new
tensors, so nothing leaks across leaves or into the caller's state. ``copy.deepcopy`` keeps the
views sharing one (copied) buffer, ``torch.save`` stores the buffer once; plain ``pickle``
stores the whole buffer with each view, so the compat edge (:func:`detached_count`) hands out
standalone copies.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._tree import PyTree, tree_flatten

__all__ = [
    "copied_counts",
    "detached_count",
    "increment_counts",
    "repacked_like",
    "scalar_dtype",
    "zero_counts",
]


class _Block:
    """The buffer behind one set of counters and weak references to its views, in order."""

    __slots__ = ("base", "views")

    def __init__(self, base: Tensor, views: tuple[weakref.ref[Tensor], ...]) -> None:
        self.base = base
        self.views = views

    def holds_exactly(self, counts: Sequence[Tensor]) -> bool:
        """Whether ``counts`` are this block's views, each once, in creation order."""
        if len(counts) != len(self.views):
            return False
        return all(ref() is count for ref, count in zip(self.views, counts, strict=True))


#: ``id(first view)`` -> its block; the entry goes when that view is garbage collected.
_BLOCKS: dict[int, _Block] = {}


def scalar_dtype() -> torch.dtype:
    """dtype of torch's ``state['step']``: float64 under a float64 default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _packed(base: Tensor) -> list[Tensor]:
    """The views of a 1-D ``base``, registered as a block."""
    views = list(base.unbind(0))
    if not views:
        return views
    key = id(views[0])

    def forget(_: object) -> None:
        if _BLOCKS.get(key) is block:
            del _BLOCKS[key]

    refs = (weakref.ref(views[0], forget), *(weakref.ref(v) for v in views[1:]))
    block = _Block(base, refs)
    _BLOCKS[key] = block
    return views


def zero_counts(params: PyTree) -> PyTree:
    """One 0-d step counter per param (``None`` for a ``None`` param), on the param's device.

    The fused kernels need the counter on the param's device (on CPU this is where torch keeps
    it too). The counters of one device are views into one buffer (see the module docstring).

    Args:
        params: the params pytree.

    Returns:
        A pytree of the params' structure holding zero float counters.
    """
    leaves, spec = tree_flatten(params)
    dtype = scalar_dtype()
    positions: dict[torch.device, list[int]] = {}
    for i, p in enumerate(leaves):
        if p is not None:
            positions.setdefault(p.device, []).append(i)
    counts: list[Any] = [None] * len(leaves)
    for device, where in positions.items():
        views = _packed(torch.zeros(len(where), dtype=dtype, device=device))
        for i, view in zip(where, views, strict=True):
            counts[i] = view
    return spec.unflatten(counts)


def increment_counts(counts: list[Tensor]) -> None:
    """``c.add_(1)`` for every counter: one op when they are one block's views, in order.

    Args:
        counts: 0-d counters (any tensors: other lists get one ``_foreach_add_``).
    """
    if not counts:
        return
    block = _block_of(counts)
    run = block.base if block is not None else _run_of(counts)
    if run is not None:
        run.add_(1)
    else:
        torch._foreach_add_(counts, 1)


def _run_of(counts: Sequence[Tensor]) -> Tensor | None:
    """The slice of a 1-D buffer whose consecutive elements ``counts`` are (a chunk of one
    block's views, in order), or None."""
    base = counts[0]._base
    if base is None or base.ndim != 1 or base.stride(0) != 1 or counts[0].ndim != 0:
        return None
    start = counts[0].storage_offset()
    for k, c in enumerate(counts):
        if c._base is not base or c.storage_offset() != start + k or c.ndim != 0:
            return None
    offset = start - base.storage_offset()
    return base[offset : offset + len(counts)]


def _block_of(counts: Sequence[Tensor]) -> _Block | None:
    """The block whose views ``counts`` are, exactly and in order; else None."""
    block = _BLOCKS.get(id(counts[0])) if counts else None
    return block if block is not None and block.holds_exactly(counts) else None


def copied_counts(counts: list[Tensor]) -> list[Tensor]:
    """New counters equal to ``counts`` (the inputs untouched): one new block when they are
    one block's views, in order; else one clone each.

    Args:
        counts: 0-d counters.
    """
    block = _block_of(counts) if counts else None
    if block is not None:
        return _packed(block.base.clone())
    return [c.clone() for c in counts]


def detached_count(value: Any) -> Any:
    """A 0-d view (a packed counter) as a standalone copy; anything else as is.

    Used where state leaves the library (torch-format state dicts), so that pickling one
    counter does not carry the whole buffer along.
    """
    if isinstance(value, Tensor) and value.ndim == 0 and value._base is not None:
        return value.clone()
    return value


def repacked_like(template: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """``values`` as one new block when ``template`` (with ``None`` holes) is one block.

    Loading a state keeps the counters packed: ``template`` holds the counters of a fresh
    ``init`` and ``values`` the loaded ones at the same positions.

    Args:
        template: a per-leaf list of counters (``None`` where a param is ``None``).
        values: tensors at the same positions, any dtype and device.

    Returns:
        ``values`` cast to the template's dtype and device and written into one new buffer
        whose views take their places; ``list(values)`` when ``template`` is not one block or a
        value is not a 1-element tensor.
    """
    present = [i for i, t in enumerate(template) if t is not None]
    block = _BLOCKS.get(id(template[present[0]])) if present else None
    loaded = [values[i] for i in present]
    if (
        block is None
        or not block.holds_exactly([template[i] for i in present])
        or not all(isinstance(v, Tensor) and v.numel() == 1 for v in loaded)
    ):
        return list(values)
    base = block.base
    stacked = torch.stack([v.reshape(()).to(dtype=base.dtype, device=base.device) for v in loaded])
    out = list(values)
    for i, view in zip(present, _packed(stacked), strict=True):
        out[i] = view
    return out
