"""``pure_step(tx, compiled=True)``: Adam as one out-of-place kernel over recycled flat buffers.

The eager pure step copies the params and moments, then runs torch's fused kernel in place on
the copies. On CPU that kernel is compute-bound, so the copies add their full cost on top of
it: about 2.2x torch's in-place step. This path instead runs one kernel, compiled by
``torch.compile``, that reads the old params and moments and writes the new ones in the same
pass, so a pure step costs about what torch's in-place step does.

* **Layout.** The active leaves of one (device, dtype, weight decay) *bucket* lie end to end in
  one flat buffer per kind (params, ``mu``, ``nu``, and ``nu_max`` with AMSGrad), grouped by
  shape: one ``unbind`` makes the views of all the leaves of a shape, and one ``stack`` per
  shape gathers the gradients into a private flat buffer the kernel reads. A *generation* is
  one set of those buffers; the leaves the step returns are views into one.
* **Recycling.** Fresh CPU memory costs a page fault per page on every step (the allocator
  gives large blocks back to the OS), more than the step itself. So the step keeps the
  generations it made and writes into one only when no tensor outside the step refers to its
  storage any more (torch's storage use count): when the caller has dropped every leaf of it,
  and every view of those. In ``params, state = step(params, grads, state)`` two generations
  alternate. A step never writes into memory the caller can still see.
* **Inputs.** When the params and moments passed in are the leaves of a kept generation, the
  kernel reads that generation's buffers directly; otherwise (the first step, or state built
  elsewhere) they are first gathered into a free generation.

Numbers: the same formula as torch's fused Adam/AdamW, in a different op order (the compiled
kernel rounds ``lerp`` and the decay its own way): within a few float32 ulps of ``tx.step``,
the tolerance tested in tests/functional_optim/test_pure_flat.py, not bitwise.

The path takes Adam-tailed chains (see :mod:`functional_optim._pure_step`) over float32 and
float64 params whose gradients match them in shape, dtype and device, and whose step counters
all hold the same value. Any other call runs the eager pure step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._counts import incremented, uniform_count
from functional_optim._lists import LeafView, with_active_leaves

__all__ = ["MAX_GENERATIONS", "FlatAdam", "adam_out", "amsgrad_out"]

#: Generations a step keeps for reuse: two alternate in a loop, a third covers a caller that
#: holds one older state (or the gathered copy of state built elsewhere).
MAX_GENERATIONS = 3

#: Kinds of flat buffer per generation: params, mu, nu (and nu_max with AMSGrad).
_PLAIN_KINDS = 3

Kernel = Callable[..., None]
HeadFn = Callable[[list[Tensor]], list[Tensor]]


def adam_out(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, p_out: Tensor, v_out: Tensor, scalars: Tensor
) -> None:
    """One Adam(W) step from ``p, m, v``: new params into ``p_out``, the new first moment over
    ``g`` (the step's private copy of the gradients), the new second moment into ``v_out``.

    Writing over ``g`` saves a write stream: its lines are in cache already, where a fresh
    output must first be read in.

    Args:
        p, g, m, v: params, gradients, first and second moments (1-D, one dtype).
        p_out, v_out: where the new params and second moment go (not aliasing the inputs).
        scalars: ``[lr / (1 - b1**t), 1 - b1, b2, sqrt(1 - b2**t), eps, 1 - lr * wd,
            1 - b2]``, computed in float64 (``1 - b2`` in float32 would lose 4 digits).
    """
    new_m = m + scalars[1] * (g - m)
    new_v = v * scalars[2] + scalars[6] * g * g
    denom = new_v.sqrt() / scalars[3] + scalars[4]
    p_out.copy_(p * scalars[5] - scalars[0] * new_m / denom)
    g.copy_(new_m)
    v_out.copy_(new_v)


def amsgrad_out(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    v_max: Tensor,
    p_out: Tensor,
    v_out: Tensor,
    v_max_out: Tensor,
    scalars: Tensor,
) -> None:
    """:func:`adam_out` with AMSGrad: the denominator uses the running max of ``v``."""
    new_m = m + scalars[1] * (g - m)
    new_v = v * scalars[2] + scalars[6] * g * g
    new_max = torch.maximum(v_max, new_v)
    denom = new_max.sqrt() / scalars[3] + scalars[4]
    p_out.copy_(p * scalars[5] - scalars[0] * new_m / denom)
    g.copy_(new_m)
    v_out.copy_(new_v)
    v_max_out.copy_(new_max)


_EAGER: dict[bool, Kernel] = {False: adam_out, True: amsgrad_out}
_COMPILED: dict[bool, Kernel] = {}
_COMPILE_LOCK = threading.Lock()


def _kernel(amsgrad: bool, compiled: bool) -> Kernel:
    """The kernel, compiled once per process (dynamic sizes: one graph per dtype and device)."""
    if not compiled:
        return _EAGER[amsgrad]
    with _COMPILE_LOCK:
        fn = _COMPILED.get(amsgrad)
        if fn is None:
            fn = torch.compile(_EAGER[amsgrad], dynamic=True, fullgraph=True)
            _COMPILED[amsgrad] = fn
    return fn


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


class _Layout:
    """Where each active leaf lives in the flat buffers (see the module docstring)."""

    def __init__(self, params: Sequence[Tensor], groups: Sequence[tuple[list[int], float]]) -> None:
        self.shapes = [p.shape for p in params]
        self.dtypes = [p.dtype for p in params]
        self.devices = [p.device for p in params]
        self.groups = _groups_key(groups)
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
                size = torch.empty((), dtype=dtype).element_size()
                for shape, where in by_shape.items():
                    stop = start + len(where) * shape.numel()
                    runs.append(_Run(shape, where, start, stop))
                    for k, j in enumerate(where):
                        self.bucket_of[j] = len(buckets)
                        self.byte_offset[j] = (start + k * shape.numel()) * size
                    start = stop
                buckets.append(_Bucket(device, dtype, wd, runs, max(start, 2)))
        self.buckets = buckets

    def fits(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> bool:
        """Whether ``params`` and ``grads`` have this layout's shapes, dtypes and devices (and
        the gradients are dense)."""
        if len(params) != len(self.shapes):
            return False
        for p, g, shape, dtype, device in zip(
            params, grads, self.shapes, self.dtypes, self.devices, strict=True
        ):
            if (
                p.shape != shape
                or g.shape != shape
                or p.dtype != dtype
                or g.dtype != dtype
                or p.device != device
                or g.device != device
                or g.layout != torch.strided
            ):
                return False
        return True

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
                leaf.data_ptr() != bases[b] + offset
                or leaf.shape != shape
                or leaf.dtype != dtype
                or not leaf.is_contiguous()
            ):
                return False
        return True


Generation = list[list[Tensor]]  # kind -> bucket -> flat buffer


class _Pool:
    """The generations of one layout, and the private flat gradients."""

    def __init__(self, layout: _Layout, kinds: int) -> None:
        self.layout = layout
        self.kinds = kinds
        self.generations: list[Generation] = []
        self.grads = layout.new_flats()

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

    def source(self, leaves: Sequence[Sequence[Tensor]]) -> Generation:
        """The generation whose views ``leaves`` (one list per kind) are; else a free one
        they are gathered into."""
        for gen in self.generations:
            if all(self.layout.holds(ls, kind) for ls, kind in zip(leaves, gen, strict=True)):
                return gen
        gen = self.acquire()
        for ls, kind in zip(leaves, gen, strict=True):
            self.layout.gather(ls, kind)
        return gen

    def gradient_buffers(self) -> list[Tensor]:
        """The private flat gradients, replaced first if anything kept a view of them (a
        transform's state, say), so that gathering never writes into a live tensor."""
        if not all(_unshared(flat) for flat in self.grads):
            self.grads = self.layout.new_flats()
        return self.grads

    def reclaim_gradients(self) -> list[Tensor]:
        """The gradient buffers once more, copied first if a transform kept a view of them in
        its new state: the kernel writes the first moment over them."""
        if not all(_unshared(flat) for flat in self.grads):
            self.grads = [flat.clone() for flat in self.grads]
        return self.grads

    def rotate(self, gen: Generation) -> None:
        """``gen`` takes the gradient buffers (the kernel wrote its first moment there) and
        its old first-moment buffers, free like the rest of it, become the gradient ones."""
        gen[1], self.grads = self.grads, gen[1]


class FlatAdam:
    """The state behind one ``pure_step(tx, compiled=True)``: its layout, buffers and lock.

    Args:
        compiled: run the kernel through ``torch.compile`` (False: the same Python kernel in
            eager mode, slower; the tests use it to check the layout and recycling quickly).
    """

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled
        self._pool: _Pool | None = None
        self._lock = threading.Lock()

    def _pool_for(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        groups: Sequence[tuple[list[int], float]],
        kinds: int,
    ) -> _Pool | None:
        """The pool for this call's layout (a new one when it changed); None when the call
        does not fit this path."""
        pool = self._pool
        if (
            pool is not None
            and pool.kinds == kinds
            and pool.layout.groups == _groups_key(groups)
            and pool.layout.fits(params, grads)
        ):
            return pool
        if not _eligible(params, grads):
            return None
        pool = _Pool(_Layout(params, groups), kinds)
        self._pool = pool
        return pool

    def step(
        self,
        view: LeafView,
        grads: list[Tensor],
        head: HeadFn | None,
        hyper: Any,
        state: Any,
        lr: float,
        groups: list[tuple[list[int], float]],
    ) -> tuple[list[Tensor], Any] | None:
        """New active params and ``ScaleByAdamState``; None (nothing done) when the call does
        not fit this path.

        Args:
            view: the leaf view (``view.params`` are the active params).
            grads: the gradients at the active positions (not written to).
            head: runs the chain's components before Adam on the private copy of ``grads``,
                in place, and returns the updates to use; None when there are none.
            hyper: ``scale_by_adam``'s hyperparameters.
            state: the old ``ScaleByAdamState`` (not written to).
            lr: the learning rate of this step.
            groups: ``(active positions, weight decay)`` per decay group.
        """
        params = view.params
        counts = view.gather(state.count)
        amsgrad = bool(hyper["amsgrad"])
        kinds = _PLAIN_KINDS + int(amsgrad)
        with self._lock:
            pool = self._pool_for(params, grads, groups, kinds)
            count = None if pool is None else uniform_count(counts)
            if pool is None or count is None:
                return None
            layout = pool.layout
            flat_grads = pool.gradient_buffers()
            layout.gather(grads, flat_grads)
            if head is not None:
                own = layout.views(flat_grads)
                updates = head(list(own))
                moved = [j for j, (u, g) in enumerate(zip(updates, own, strict=True)) if u is not g]
                if moved:
                    torch._foreach_copy_([own[j] for j in moved], [updates[j] for j in moved])
                del updates, own
                flat_grads = pool.reclaim_gradients()
            moments = [view.gather(state.mu), view.gather(state.nu)]
            if amsgrad:
                moments.append(view.gather(state.nu_max))
            source = pool.source([params, *moments])
            target = pool.acquire(avoid=source)
            kernel = _kernel(amsgrad, self.compiled)
            b1, b2, eps = float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])
            t = count + 1
            step_size = lr / (1 - b1**t)
            bc2_sqrt = math.sqrt(1 - b2**t)
            for b, bucket in enumerate(layout.buckets):
                scalars = torch.tensor(
                    [step_size, 1 - b1, b2, bc2_sqrt, eps, 1 - lr * bucket.weight_decay, 1 - b2],
                    dtype=bucket.dtype,
                    device=bucket.device,
                )
                kernel(
                    source[0][b],
                    flat_grads[b],
                    *(kind[b] for kind in source[1:]),
                    target[0][b],
                    *(kind[b] for kind in target[2:]),
                    scalars,
                )
            pool.rotate(target)
            outputs = [layout.views(kind) for kind in target]
        new_params, new_mu, new_nu, *rest = outputs
        new_state = state._replace(
            count=with_active_leaves(view, state.count, incremented(counts)),
            mu=with_active_leaves(view, state.mu, new_mu),
            nu=with_active_leaves(view, state.nu, new_nu),
            nu_max=with_active_leaves(view, state.nu_max, rest[0]) if amsgrad else state.nu_max,
        )
        return new_params, new_state


_FLOATS = (torch.float32, torch.float64)


def _eligible(params: Sequence[Tensor], grads: Sequence[Tensor]) -> bool:
    """Whether every param is float32/float64 and its gradient a dense tensor of the same
    shape, dtype and device (and there is at least one)."""
    for p, g in zip(params, grads, strict=True):
        if (
            p.dtype not in _FLOATS
            or g.dtype != p.dtype
            or g.shape != p.shape
            or g.device != p.device
            or g.layout != torch.strided
        ):
            return False
    return bool(params)


def _groups_key(groups: Sequence[tuple[list[int], float]]) -> tuple[Any, ...]:
    return tuple((tuple(positions), wd) for positions, wd in groups)
