"""Flat buffers that hold a step's leaves, and their reuse across steps (``pure_step``).

* **Layout.** The active leaves of one (device, dtype, weight decay) *bucket* lie end to end in
  one flat buffer per kind (params, ``mu``, ``nu``, and ``nu_max`` with AMSGrad), grouped by
  shape: one ``unbind`` makes the views of all the leaves of a shape, and one ``stack`` per
  shape gathers leaves into a buffer. A *generation* is one set of those buffers; the leaves a
  step returns are views into one.
* **Recycling.** Fresh CPU memory costs a page fault per page on every step (the allocator
  gives large blocks back to the OS), as much as the step itself. So the step keeps the
  generations it made and writes into one only when no tensor outside the step refers to its
  storage any more (torch's storage use count): when the caller has dropped every leaf of it,
  and every view of those. In ``params, state = step(params, grads, state)`` two generations
  alternate. A step never writes into memory the caller can still see.
* **Inputs.** When the params and moments passed in are the leaves of a kept generation, the
  step reads that generation's buffers directly; otherwise they are gathered first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["MAX_GENERATIONS", "Generation", "Layout", "Pool", "eligible", "groups_key"]

#: Generations a pool keeps for reuse: two alternate in a loop, a third covers a caller that
#: holds one older state (or the gathered copy of state built elsewhere).
MAX_GENERATIONS = 3

#: dtypes the out-of-place kernel takes (:attr:`Layout.floats`).
_FLOATS = (torch.float32, torch.float64)


def _unshared(flat: Tensor) -> bool:
    """Whether nothing but ``flat`` refers to its storage (no view of it is alive). Without
    torch's storage use count, nothing is ever reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return bool(use_count(flat.untyped_storage()._cdata) == 2)  # 2: with the one asked here


class _Run(NamedTuple):
    """Leaves of one shape, consecutive in a bucket's flat buffer."""

    shape: torch.Size
    positions: list[int]
    start: int
    stop: int


class _Bucket(NamedTuple):
    """The leaves of one device, dtype and weight decay; ``size`` is the flat buffer's length
    (at least 2, so that dynamic-shape compilation never specialises a buffer of one)."""

    device: torch.device
    dtype: torch.dtype
    weight_decay: float
    runs: list[_Run]
    size: int


class Layout:
    """Where each active leaf lives in the flat buffers (see the module docstring)."""

    def __init__(self, params: Sequence[Tensor], groups: Sequence[tuple[list[int], float]]) -> None:
        self.shapes = [p.shape for p in params]
        self.dtypes = [p.dtype for p in params]
        self.devices = [p.device for p in params]
        buckets: list[_Bucket] = []
        self.bucket_of = [0] * len(params)
        self.byte_offset = [0] * len(params)
        for positions, wd in groups:
            by_kind: dict[tuple[torch.device, torch.dtype], dict[torch.Size, list[int]]] = {}
            for j in positions:
                p = params[j]
                by_kind.setdefault((p.device, p.dtype), {}).setdefault(p.shape, []).append(j)
            for (device, dtype), by_shape in by_kind.items():
                runs: list[_Run] = []
                start = 0
                size = dtype.itemsize
                for shape, where in by_shape.items():
                    stop = start + len(where) * shape.numel()
                    runs.append(_Run(shape, where, start, stop))
                    for k, j in enumerate(where):
                        self.bucket_of[j] = len(buckets)
                        self.byte_offset[j] = (start + k * shape.numel()) * size
                    start = stop
                buckets.append(_Bucket(device, dtype, wd, runs, max(start, 2)))
        self.buckets = buckets
        #: whether the out-of-place kernel takes every bucket (float32 / float64)
        self.floats = all(b.dtype in _FLOATS for b in buckets)
        self._chunks: dict[int, list[tuple[int, list[int], int, int]]] = {}

    def fits(self, params: Sequence[Tensor], grads: Sequence[Tensor], params_only: bool) -> bool:
        """Whether ``params`` (and, unless ``params_only``, dense ``grads``) have this layout's
        shapes, dtypes and devices."""
        if len(params) != len(self.shapes):
            return False
        for p, g, shape, dtype, device in zip(
            params, grads, self.shapes, self.dtypes, self.devices, strict=True
        ):
            if p.shape != shape or p.dtype != dtype or p.device != device:
                return False
            if not params_only and (
                g.shape != shape
                or g.dtype != dtype
                or g.device != device
                or g.layout != torch.strided
            ):
                return False
        return True

    def chunks(self, chunk_bytes: int) -> list[tuple[int, list[int], int, int]]:
        """``(bucket, positions, start, stop)``: the leaves in runs of about ``chunk_bytes``
        per buffer, in flat order (a larger leaf is a chunk of its own)."""
        cached = self._chunks.get(chunk_bytes)
        if cached is not None:
            return cached
        out: list[tuple[int, list[int], int, int]] = []
        for b, bucket in enumerate(self.buckets):
            size = bucket.dtype.itemsize
            positions: list[int] = []
            start = stop = 0
            for run in bucket.runs:
                numel = run.shape.numel()
                for j in run.positions:
                    positions.append(j)
                    stop += numel
                    if (stop - start) * size >= chunk_bytes:
                        out.append((b, positions, start, stop))
                        positions, start = [], stop
            if positions:
                out.append((b, positions, start, stop))
        self._chunks[chunk_bytes] = out
        return out

    def new_flats(self) -> list[Tensor]:
        """One uninitialised flat buffer per bucket."""
        return [torch.empty(b.size, dtype=b.dtype, device=b.device) for b in self.buckets]

    def views(self, flats: Sequence[Tensor]) -> list[Tensor]:
        """The leaf views of one flat buffer per bucket, in active-leaf order."""
        out: list[Any] = [None] * len(self.shapes)
        for bucket, flat in zip(self.buckets, flats, strict=True):
            for run in bucket.runs:
                block = flat[run.start : run.stop].view(len(run.positions), *run.shape)
                for j, leaf in zip(run.positions, block.unbind(0), strict=True):
                    out[j] = leaf
        return out

    def gather(self, leaves: Sequence[Tensor], flats: Sequence[Tensor]) -> None:
        """Copy ``leaves`` (active order, this layout's shapes) into the flat buffers."""
        for bucket, flat in zip(self.buckets, flats, strict=True):
            for run in bucket.runs:
                out = flat[run.start : run.stop].view(len(run.positions), *run.shape)
                torch.stack([leaves[j] for j in run.positions], out=out)

    def holds(self, leaves: Sequence[Tensor], flats: Sequence[Tensor]) -> bool:
        """Whether each leaf is exactly the view :meth:`views` makes of ``flats``."""
        bases = [f.data_ptr() for f in flats]
        for leaf, b, offset, shape, dtype in zip(
            leaves, self.bucket_of, self.byte_offset, self.shapes, self.dtypes, strict=True
        ):
            if (
                (leaf.data_ptr() != bases[b] + offset and leaf.numel() != 0)  # empty: ptr 0
                or leaf.shape != shape
                or leaf.dtype != dtype
                or not leaf.is_contiguous()
            ):
                return False
        return True


Generation = list[list[Tensor]]  # kind -> bucket -> flat buffer


class Pool:
    """The generations of one layout, and the private flat gradients."""

    def __init__(self, layout: Layout, kinds: int) -> None:
        self.layout = layout
        self.kinds = kinds
        self.generations: list[Generation] = []
        self.grads: list[Tensor] | None = None

    def _free(self, gen: Generation) -> bool:
        return all(_unshared(flat) for kind in gen for flat in kind)

    def acquire(self, avoid: Generation | None = None) -> Generation:
        """A generation nothing else refers to (kept for reuse while there is room)."""
        for gen in self.generations:
            if gen is not avoid and self._free(gen):
                return gen
        gen = [self.layout.new_flats() for _ in range(self.kinds)]
        if len(self.generations) < MAX_GENERATIONS:
            self.generations.append(gen)
        return gen

    def find(self, leaves: Sequence[Sequence[Tensor]]) -> Generation | None:
        """The kept generation whose views ``leaves`` (one list per kind) are, if any."""
        for gen in self.generations:
            if all(self.layout.holds(ls, kind) for ls, kind in zip(leaves, gen, strict=True)):
                return gen
        return None

    def gradient_buffers(self) -> list[Tensor]:
        """The private flat gradients, replaced first if anything kept a view of them (a
        transform's state, say), so that gathering never writes into a live tensor."""
        if self.grads is None or not all(_unshared(flat) for flat in self.grads):
            self.grads = self.layout.new_flats()
        return self.grads

    def reclaim_gradients(self) -> list[Tensor]:
        """The gradient buffers once more, copied first if a transform kept a view of them in
        its new state: the kernel writes the first moment over them."""
        assert self.grads is not None, "gradient_buffers() first"
        if not all(_unshared(flat) for flat in self.grads):
            self.grads = [flat.clone() for flat in self.grads]
        return self.grads

    def rotate(self, gen: Generation) -> None:
        """``gen`` takes the gradient buffers (the kernel wrote its first moment there) and
        its old first-moment buffers, free like the rest of it, become the gradient ones."""
        assert self.grads is not None, "gradient_buffers() first"
        gen[1], self.grads = self.grads, gen[1]

    def release(self) -> None:
        """Drop the spare generations (those nobody holds a view of) and the gradient
        buffers: a step whose leaves with a gradient changed keeps only what it can use."""
        self.generations = [gen for gen in self.generations if not self._free(gen)]
        self.grads = None


def eligible(params: Sequence[Tensor], grads: Sequence[Tensor], gather: bool) -> bool:
    """Whether flat buffers can hold these: dense params and, if ``gather``, gradients of the
    same shape, dtype and device (else torch's kernel reports the mismatch)."""
    if not params:
        return False
    for p, g in zip(params, grads, strict=True):
        if p.layout != torch.strided:
            return False
        if not gather:
            continue
        if (
            g.dtype != p.dtype
            or g.shape != p.shape
            or g.device != p.device
            or g.layout != torch.strided
        ):
            return False
    return True


def groups_key(groups: Sequence[tuple[list[int], float]]) -> tuple[Any, ...]:
    """``groups`` (positions, weight decay) as a hashable key."""
    return tuple((tuple(positions), wd) for positions, wd in groups)
