"""Flat buffers that hold a step's leaves, and their reuse across steps (``pure_step``).

* **Layout.** The leaves of one (device, dtype) *bucket* lie end to end in one flat buffer per
  kind (each list a kernel writes: the params, each moment), grouped by shape: one ``unbind``
  makes the views of all the leaves of a shape. A *generation* is one set of those buffers;
  the leaves a step returns are views into one.
* **Recycling.** Fresh CPU memory costs a page fault per page on every step (the allocator
  gives large blocks back to the OS), as much as the step itself. So the step keeps the
  generations it made, with their leaf views, and writes into one only when nothing outside
  the pool refers to it any more: the caller has dropped every leaf view it was handed (their
  reference counts) and every other view of its buffers (torch's storage use count). In
  ``params, state = step(params, grads, state)`` two generations alternate, and the same leaf
  objects come back every other step. A step never writes into memory the caller can see.
* **Inputs.** When the params and moments passed in are the leaf views of a kept generation,
  the step copies from that generation's buffers in slices; otherwise leaf by leaf.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._recording import REQUIRES_GRAD

__all__ = ["MAX_GENERATIONS", "Generation", "Layout", "Pool"]

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")

#: Generations a pool keeps for reuse: two alternate in a loop, a third covers a caller that
#: holds one older state (or the gathered copy of state built elsewhere).
MAX_GENERATIONS = 3


class _Run(NamedTuple):
    """Leaves of one shape, consecutive in a bucket's flat buffer."""

    shape: torch.Size
    positions: list[int]
    start: int
    stop: int


class _Bucket(NamedTuple):
    """The leaves of one device and dtype; ``size`` is the flat buffer's length."""

    device: torch.device
    dtype: torch.dtype
    runs: list[_Run]
    size: int


class Layout:
    """Where each leaf lives in the flat buffers (see the module docstring)."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.shapes = [p.shape for p in params]
        self.dtypes = [p.dtype for p in params]
        self.devices = [p.device for p in params]
        buckets: list[_Bucket] = []
        self.bucket_of = [0] * len(params)
        self.byte_offset = [0] * len(params)
        by_kind: dict[tuple[torch.device, torch.dtype], dict[torch.Size, list[int]]] = {}
        for j, p in enumerate(params):
            by_kind.setdefault((p.device, p.dtype), {}).setdefault(p.shape, []).append(j)
        for (device, dtype), by_shape in by_kind.items():
            runs: list[_Run] = []
            start = 0
            for shape, where in by_shape.items():
                stop = start + len(where) * shape.numel()
                runs.append(_Run(shape, where, start, stop))
                for k, j in enumerate(where):
                    self.bucket_of[j] = len(buckets)
                    self.byte_offset[j] = (start + k * shape.numel()) * dtype.itemsize
                start = stop
            buckets.append(_Bucket(device, dtype, runs, start))
        self.buckets = buckets
        self._chunks: dict[int, list[tuple[int, list[int], int, int]]] = {}

    def fits(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` have this layout's shapes, dtypes and devices."""
        if len(params) != len(self.shapes):
            return False
        return (  # C loops: this runs every step, over every leaf
            list(map(_SHAPE, params)) == self.shapes
            and list(map(_DTYPE, params)) == self.dtypes
            and list(map(_DEVICE, params)) == self.devices
        )

    def gather(self, leaves: Sequence[Tensor], flats: Sequence[Tensor]) -> None:
        """Copy ``leaves`` (this layout's shapes, any strides) into one flat buffer per bucket:
        one ``stack`` per run of a shape (a ``_foreach_copy_`` of many small tensors runs on
        one thread)."""
        for bucket, flat in zip(self.buckets, flats, strict=True):
            for run in bucket.runs:
                out = flat[run.start : run.stop].view(len(run.positions), *run.shape)
                torch.stack([leaves[j] for j in run.positions], out=out)

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


#: ``sys.getrefcount`` of an object only a list refers to, as ``map`` passes it (the baseline)
_LIST_ONLY = max(map(sys.getrefcount, [object()]))


class Generation:
    """One set of flat buffers (kind -> bucket -> flat) and the leaf views of each kind that
    the pool hands out (made once: making a view costs microseconds, per leaf)."""

    __slots__ = ("flats", "views")

    def __init__(self, layout: Layout, kinds: int) -> None:
        self.flats = [layout.new_flats() for _ in range(kinds)]
        self.views = [layout.views(flats) for flats in self.flats]


class Pool:
    """The generations of one layout."""

    def __init__(self, layout: Layout, kinds: int) -> None:
        self.layout = layout
        self.kinds = kinds
        self.generations: list[Generation] = []
        # per bucket, the storage use count of a flat buffer nothing outside the pool refers
        # to: the buffer, its leaf views and the one ``untyped_storage()`` makes to ask
        self._unshared_count = [2 + sum(len(r.positions) for r in b.runs) for b in layout.buckets]

    def _free(self, gen: Generation) -> bool:
        """Whether nothing outside the pool refers to ``gen``: no leaf view is held (or was
        changed: ``requires_grad``) and no other view of its buffers is alive."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        if use_count is None:
            return False  # without torch's storage use count, nothing is reused
        for flats, views in zip(gen.flats, gen.views, strict=True):
            if max(map(sys.getrefcount, views), default=_LIST_ONLY) > _LIST_ONLY:
                return False
            if any(map(REQUIRES_GRAD, views)):
                return False
            for flat, expected in zip(flats, self._unshared_count, strict=True):
                if use_count(flat.untyped_storage()._cdata) != expected:
                    return False
        return True

    def acquire(self, avoid: Generation | None = None) -> Generation:
        """A generation nothing else refers to (kept for reuse while there is room)."""
        for gen in self.generations:
            if gen is not avoid and self._free(gen):
                return gen
        gen = Generation(self.layout, self.kinds)
        if len(self.generations) < MAX_GENERATIONS:
            self.generations.append(gen)
        return gen

    def release(self) -> None:
        """Drop the spare generations (those nothing outside the pool refers to): a step whose
        leaves with a gradient changed keeps only what it can use."""
        self.generations = [gen for gen in self.generations if not self._free(gen)]

    def find(self, leaves: Sequence[Sequence[Tensor]]) -> Generation | None:
        """The kept generation whose leaf views ``leaves`` (one list per kind) are, if any."""
        for gen in self.generations:
            if all(
                len(ls) == len(views) and all(map(operator.is_, ls, views))
                for ls, views in zip(leaves, gen.views, strict=True)
            ):
                return gen
        return None
