"""``pure_step``'s kernel runner: any step's kernel, run on copies in recycled flat buffers.

A :class:`FlatRunner` is installed (:func:`functional_optim._kernel_runner.running_with`) while
``pure_step`` runs the transform's own in-place ``step``; the step's kernel call
(:func:`functional_optim._kernel_runner.run_kernel`) comes here with the role of each argument.
Nothing in it knows an algorithm: it only reads the roles.

* The lists the kernel writes (params and moments, role ``"write"``) get new tensors that are
  views into a flat buffer per list (:mod:`functional_optim._flat_buffers`, which recycles them
  across steps). A kernel with an out-of-place version
  (:func:`functional_optim._out_of_place.for_kernel`) that accepts the call reads the old lists
  and writes the new ones in one pass. Otherwise the kernel runs a chunk of leaves at a time,
  about ``chunk_bytes`` of params each: the chunk's old values are copied into the new buffers,
  then the kernel runs on them while they are still in cache. In a loop the old values are
  views of the step's own last buffers, so each copy is one slice copy per buffer.
* Step counters (``"count"``) get copies (one op when they are one block's views,
  :mod:`functional_optim._counts`).
* Anything flat buffers cannot hold (a list with a buffer not yet made, non-strided tensors,
  tensor subclasses such as DTensor, leaves whose dtype differs between lists, lists of other
  shapes: role ``"other"``) gets clones, and the kernel runs once on the whole call.

The kernel is the one ``tx.step`` runs, on the same values, so the result equals ``tx.step`` on
copies bitwise (element-wise kernels do not depend on how the leaves are chunked; an
out-of-place version is used only where it gives the kernel's bits).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._counts import copied_counts
from functional_optim._flat_buffers import Generation, Layout, Pool
from functional_optim._kernel_runner import Role
from functional_optim._out_of_place import OutOfPlace, for_kernel

__all__ = ["MAX_LAYOUTS", "FlatRunner", "clone"]

#: A chunk size no buffer reaches: one chunk per flat buffer.
_WHOLE = 1 << 62

#: Layouts a runner keeps per kernel call of a step (one per set of leaves with a gradient).
MAX_LAYOUTS = 4


#: The tensor types flat buffers stand in for (their views are plain tensors).
_PLAIN = (Tensor, torch.nn.Parameter)


def clone(t: Tensor) -> Tensor:
    """A copy of ``t`` with its strides (a new tensor nothing else refers to)."""
    if t.layout != torch.strided:
        return t.clone()
    return t.clone(memory_format=torch.preserve_format)


def _poolable(lists: Sequence[list[Any]]) -> bool:
    """Whether flat buffers can hold these lists: dense tensors, one shape, dtype and device
    per leaf across the lists (a non-contiguous leaf is copied by value)."""
    first = lists[0]
    for leaves in lists:
        for t, p in zip(leaves, first, strict=True):
            if (
                type(t) not in _PLAIN  # a subclass (DTensor) keeps its type: cloned
                or t.layout != torch.strided
                or t.shape != p.shape
                or t.dtype != p.dtype
                or t.device != p.device
            ):
                return False
    return True


def _taker(positions: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    """``lambda leaves: [leaves[j] for j in positions]``, in C where it can."""
    if len(positions) == 1:
        j = positions[0]
        return lambda leaves: [leaves[j]]
    getter = operator.itemgetter(*positions)
    return lambda leaves: list(getter(leaves))


class FlatRunner:
    """Runs a step's kernel calls on new tensors (see the module docstring).

    Args:
        chunk_bytes: about how many bytes of params one chunk of leaves holds (a larger leaf
            is a chunk of its own).

    Attributes:
        replaced: after a step, ``id(old tensor) -> new tensor`` for every tensor a kernel
            call got a new version of (``kept`` holds the old ones alive until
            :meth:`begin`).
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.lock = threading.Lock()
        self.replaced: dict[int, Tensor] = {}
        self.kept: list[list[Any]] = []
        self._pools: dict[Any, list[Pool]] = {}
        self._calls = 0

    def begin(self) -> None:
        """Start a step: forget the last step's replacements."""
        self.replaced = {}
        self.kept = []
        self._calls = 0

    def _record(self, old: list[Any], new: list[Any]) -> None:
        if any(a is None for a in old):  # a buffer the kernel makes: nothing to replace
            self.replaced.update((id(a), b) for a, b in zip(old, new, strict=True) if a is not None)
        else:
            self.replaced.update(zip(map(id, old), new))
        self.kept.append(old)  # the ids stay those of live tensors until the step ends

    def _pool(self, lists: Sequence[list[Tensor]]) -> tuple[Pool, Generation | None] | None:
        """The pool of this call's layout and the kept generation ``lists`` are the leaf views
        of; None when flat buffers cannot hold them. The n-th kernel call of a step has its own
        pools, one per set of leaves with a gradient (at most :data:`MAX_LAYOUTS`); only the
        one in use keeps spare generations."""
        key = (self._calls, len(lists), torch.is_inference_mode_enabled())
        self._calls += 1
        pools = self._pools.setdefault(key, [])
        pool = next((p for p in pools if p.layout.fits(lists[0])), None)
        source = None if pool is None else pool.find(lists)
        if source is None and not _poolable(lists):
            return None
        if pool is None:
            pool = Pool(Layout(lists[0]), len(lists))
            if len(pools) >= MAX_LAYOUTS:
                pools.pop()
        pools[:] = [pool, *(p for p in pools if p is not pool)]
        for other in pools[1:]:
            other.release()
        return pool, source

    def copies(self, tensors: list[Tensor]) -> list[Tensor]:
        """Copies of ``tensors`` (the gradients a chain's first components rescale in place),
        in a recycled flat buffer when one can hold them."""
        if not tensors or not _poolable([tensors]):
            return [clone(t) for t in tensors]
        pools = self._pools.setdefault(("copies", torch.is_inference_mode_enabled()), [])
        pool = next((p for p in pools if p.layout.fits(tensors)), None)
        if pool is None:
            pool = Pool(Layout(tensors), 1)
            pools[:] = [pool, *pools][:MAX_LAYOUTS]
        gen = pool.acquire()
        pool.layout.gather(tensors, gen.flats[0])
        return list(gen.views[0])

    def __call__(self, kernel: Callable[..., None], args: list[Any], roles: Sequence[Role]) -> None:
        """Run ``kernel(*args)`` with new tensors in the lists it writes; ``args``' lists are
        refilled with them (a step that stores its lists back finds the new ones)."""
        written = [i for i, r in enumerate(roles) if r in ("write", "count", "other") and args[i]]
        for i in written:
            if roles[i] == "count" and all(isinstance(c, Tensor) for c in args[i]):
                new = copied_counts(args[i])
                self._record(args[i], new)
                args[i][:] = new
        flat = [i for i in written if roles[i] == "write"]
        found = None
        if flat and all(roles[i] != "other" for i in written):
            found = self._pool([args[i] for i in flat])
        if found is not None:
            fast = for_kernel(kernel)
            if fast is None or not self._out_of_place(fast, args, flat, *found):
                self._chunked(kernel, args, roles, flat, *found)
            return
        for i in written:
            if roles[i] != "count" or not all(isinstance(c, Tensor) for c in args[i]):
                copies: list[Tensor | None] = [c if c is None else clone(c) for c in args[i]]
                self._record(args[i], copies)
                args[i][:] = copies
        kernel(*args)

    def _out_of_place(
        self,
        fast: OutOfPlace,
        args: list[Any],
        flat: list[int],
        pool: Pool,
        source: Generation | None,
    ) -> bool:
        """Run the kernel's out-of-place version into a new generation, in one pass (no
        copies); False, with nothing written, where it declines."""
        views = pool.acquire(avoid=source).views
        new = list(args)
        old: list[list[Any] | None] = [None] * len(args)
        for i, kind in zip(flat, views, strict=True):
            new[i], old[i] = kind, args[i]
        if not fast(new, old):
            return False
        for i, kind in zip(flat, views, strict=True):
            self._record(args[i], kind)
            args[i][:] = kind
        return True

    def _chunked(
        self,
        kernel: Callable[..., None],
        args: list[Any],
        roles: Sequence[Role],
        flat: list[int],
        pool: Pool,
        source: Generation | None,
    ) -> None:
        sources = [args[i] for i in flat]
        layout = pool.layout
        target = pool.acquire(avoid=source)
        views = target.views
        lists = [i for i, r in enumerate(roles) if r is not None and args[i] and i not in flat]
        # Everything is sliced first, so that the copies and kernels run back to back (OpenMP's
        # workers may fall asleep in a Python gap between two parallel ops).
        work = []
        on_cpu = all(bucket.device.type == "cpu" for bucket in layout.buckets)
        # chunks keep copies in a CPU's cache; on a GPU each chunk is only another launch
        for b, positions, start, stop in layout.chunks(self.chunk_bytes if on_cpu else _WHOLE):
            take = _taker(positions)
            if source is None:  # leaf by leaf, by value (any strides)
                pairs = [(take(new), take(old)) for old, new in zip(sources, views, strict=True)]
            else:  # the step's own last outputs: one slice of each flat buffer
                flats = zip(source.flats, target.flats, strict=True)
                pairs = [([new[b][start:stop]], [old[b][start:stop]]) for old, new in flats]
            chunk = list(args)
            for i, kind in zip(flat, views, strict=True):
                chunk[i] = take(kind)
            for i in lists:
                chunk[i] = take(args[i])
            work.append((pairs, chunk))
        for pairs, chunk in work:
            for new_leaves, old_leaves in pairs:
                torch._foreach_copy_(new_leaves, old_leaves)
            kernel(*chunk)
        for i, new in zip(flat, views, strict=True):
            self._record(args[i], new)
            args[i][:] = new
