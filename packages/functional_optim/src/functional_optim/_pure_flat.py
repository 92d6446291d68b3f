"""``pure_step``'s Adam over flat buffers it recycles: by copying, or one out-of-place kernel.

The buffers, their layout and their reuse are :mod:`functional_optim._flat_buffers`'s.

Two ways to compute (:data:`MODES`):

* ``"fused"`` (``pure_step``'s default): each chunk of about ``chunk_bytes`` is copied from the
  old generation into the new one (one slice copy per buffer) and torch's fused kernel runs in
  place on it while it is in cache: ``tx.step``'s kernel, bitwise. On CPU that kernel is
  compute-bound, so the copies still add their cost: about 2x torch's in-place step.
* ``"compiled"`` (``pure_step(tx, compiled=True)``): the gradients are gathered into a private
  flat buffer (the chain's components before Adam run there, in place), then one kernel
  compiled by ``torch.compile`` reads the old params and moments and writes the new ones in
  the same pass, the first moment over the gathered gradients (their lines are in cache; a
  fresh output must first be read in). Its op order is not torch's: within an ulp or two of
  ``tx.step`` (tests/functional_optim/test_pure_flat.py). It needs float32/float64 params and
  one step count for all leaves; other calls take the ``"fused"`` way.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._counts import incremented, uniform_count
from functional_optim._flat_buffers import Generation, Layout, Pool, eligible, groups_key
from functional_optim._lists import LeafView, with_active_leaves
from functional_optim.kernels._dispatch import resolve_impl
from functional_optim.kernels.adam import adam_impl

__all__ = ["MAX_LAYOUTS", "MODES", "FlatAdam", "adam_out", "amsgrad_out"]

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


#: How a :class:`FlatAdam` computes: ``"fused"`` copies the old buffers into the new ones
#: and runs torch's kernel in place on them (bitwise ``tx.step``); ``"compiled"`` runs the
#: out-of-place kernel compiled; ``"python"`` runs it eagerly (tests).
MODES = ("fused", "compiled", "python")

#: Layouts a step keeps (one per set of leaves with a gradient); only the one in use keeps
#: spare buffers, so memory stays that of one layout when the set changes from step to step.
MAX_LAYOUTS = 4


class FlatAdam:
    """The state behind one ``pure_step``: its layouts, buffers and lock.

    Args:
        mode: one of :data:`MODES`.
        chunk_bytes: with ``"fused"``, about how many bytes of each buffer are copied before
            the kernel runs on them (so that it finds them in cache).
    """

    def __init__(self, mode: str = "fused", chunk_bytes: int = 1 << 20) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self._pools: dict[Any, Pool] = {}
        self._lock = threading.Lock()

    def _pool_for(
        self,
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        groups: Sequence[tuple[list[int], float]],
        kinds: int,
        gather: bool,
    ) -> Pool | None:
        """The pool for this call's layout (a new one when none fits); None when ``gather``
        (the gradients are to be copied into flat buffers) and they do not match the params."""
        # inference tensors cannot be written outside inference mode: a pool per mode
        key = (len(params), kinds, groups_key(groups), torch.is_inference_mode_enabled())
        pool = self._pools.get(key)
        if pool is None or not pool.layout.fits(params, grads, not gather):
            if not eligible(params, grads, gather):
                return None
            pool = Pool(Layout(params, groups), kinds)
            self._pools.pop(key, None)
            if len(self._pools) >= MAX_LAYOUTS:
                del self._pools[next(iter(self._pools))]
            self._pools[key] = pool
        for other in self._pools.values():
            if other is not pool:
                other.release()
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
        fused_only: bool = False,
    ) -> tuple[list[Tensor], Any] | None:
        """New active params and ``ScaleByAdamState``, or None (nothing done) when the
        gradients would have to be copied into flat buffers and do not match the params.

        The out-of-place kernel runs when the mode asks for it, the params are float32 or
        float64 and every step counter holds the same value; otherwise the ``"fused"`` way.

        Args:
            view: the leaf view (``view.params`` are the active params).
            grads: the gradients at the active positions (not written to).
            head: runs the chain's components before Adam on the private copy of ``grads``,
                in place, and returns the updates to use; None when there are none.
            hyper: ``scale_by_adam``'s hyperparameters.
            state: the old ``ScaleByAdamState`` (not written to).
            lr: the learning rate of this step.
            groups: ``(active positions, weight decay)`` per decay group.
            fused_only: take the ``"fused"`` way whatever the mode.
        """
        params = view.params
        counts = view.gather(state.count)
        amsgrad = bool(hyper["amsgrad"])
        kinds = _PLAIN_KINDS + int(amsgrad)
        out_of_place = self.mode != "fused" and not fused_only
        with self._lock:
            pool = self._pool_for(params, grads, groups, kinds, out_of_place or head is not None)
            if pool is None:
                return None
            count = uniform_count(counts) if out_of_place and pool.layout.floats else None
            out_of_place = count is not None
            updates = grads
            if out_of_place or head is not None:
                updates = _gathered_updates(pool, grads, head)
            moments = [view.gather(state.mu), view.gather(state.nu)]
            if amsgrad:
                moments.append(view.gather(state.nu_max))
            new_counts = incremented(counts)
            sources = [params, *moments]
            if count is not None:
                compiled = self.mode == "compiled"
                del updates  # the kernel reads the flat gradients, and writes over them
                target = _out_of_place(pool, sources, hyper, lr, count + 1, compiled)
                outputs = [pool.layout.views(kind) for kind in target]
            else:
                outputs = _copy_then_fused(
                    pool, sources, updates, new_counts, hyper, lr, self.chunk_bytes
                )
                del updates
        new_params, new_mu, new_nu, *rest = outputs
        new_state = state._replace(
            count=with_active_leaves(view, state.count, new_counts),
            mu=with_active_leaves(view, state.mu, new_mu),
            nu=with_active_leaves(view, state.nu, new_nu),
            nu_max=with_active_leaves(view, state.nu_max, rest[0]) if amsgrad else state.nu_max,
        )
        return new_params, new_state


def _gathered_updates(pool: Pool, grads: list[Tensor], head: HeadFn | None) -> list[Tensor]:
    """The gradients copied into the pool's private flat buffers, the chain's head run over
    them in place. Returns their views (the updates Adam takes) when a head ran; else ``[]``
    (the out-of-place kernel reads the flat buffers themselves)."""
    flat_grads = pool.gradient_buffers()
    pool.layout.gather(grads, flat_grads)
    if head is None:
        return []
    own = pool.layout.views(flat_grads)
    updates = head(list(own))
    moved = [j for j, (u, g) in enumerate(zip(updates, own, strict=True)) if u is not g]
    if moved:
        torch._foreach_copy_([own[j] for j in moved], [updates[j] for j in moved])
    return own


def _out_of_place(
    pool: Pool, sources: list[list[Tensor]], hyper: Any, lr: float, t: float, compiled: bool
) -> Generation:
    """The compiled (or Python) kernel from the sources' generation into a free one."""
    layout = pool.layout
    flat_grads = pool.reclaim_gradients()
    source = pool.find(sources)
    if source is None:
        source = pool.acquire()
        for leaves, kind in zip(sources, source, strict=True):
            layout.gather(leaves, kind)
    target = pool.acquire(avoid=source)
    amsgrad = len(sources) > _PLAIN_KINDS
    kernel = _kernel(amsgrad, compiled)
    b1, b2, eps = float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])
    step_size = lr / (1 - b1**t)
    bc2_sqrt = math.sqrt(1 - b2**t)
    for b, bucket in enumerate(layout.buckets):
        decay = 1 - lr * bucket.weight_decay
        scalars = torch.tensor(
            [step_size, 1 - b1, b2, bc2_sqrt, eps, decay, 1 - b2],
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
    return target


def _copy_then_fused(
    pool: Pool,
    sources: list[list[Tensor]],
    updates: list[Tensor],
    counts: list[Tensor],
    hyper: Any,
    lr: float,
    chunk_bytes: int,
) -> list[list[Tensor]]:
    """The old buffers copied into a free generation, a chunk at a time, and torch's kernel
    run in place on each chunk while it is in cache: ``tx.step``'s kernel and numbers.
    Returns the generation's leaf views, one list per kind (the step's outputs).

    ``counts`` are the incremented counters (torch's fused kernel reads them as they are; the
    other paths increment clones of the old ones)."""
    layout = pool.layout
    source = pool.find(sources)
    target = pool.acquire(avoid=source)
    if source is None:
        for leaves, kind in zip(sources, target, strict=True):
            layout.gather(leaves, kind)
    views = [layout.views(kind) for kind in target]
    amsgrad = len(sources) > _PLAIN_KINDS
    b1, b2, eps = float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])
    impl = resolve_impl("auto", views[0], True)
    # Everything is sliced and listed first, so that the copies and kernels then run back to
    # back: OpenMP's workers may fall asleep in a Python gap between two parallel ops.
    work = []
    for b, positions, start, stop in layout.chunks(chunk_bytes):
        copies = (
            []
            if source is None
            else [(new[b][start:stop], old[b][start:stop]) for old, new in zip(source, target)]
        )
        p, m, v, *rest = [[kind[j] for j in positions] for kind in views]
        v_max = rest[0] if amsgrad else []
        g = [updates[j] for j in positions]
        c = (
            [counts[j] for j in positions]
            if impl == "fused"
            else [counts[j] - 1 for j in positions]
        )
        work.append((copies, p, g, m, v, v_max, c, layout.buckets[b].weight_decay))
    for copies, p, g, m, v, v_max, c, wd in work:
        for new_slice, old_slice in copies:
            new_slice.copy_(old_slice)
        if impl == "fused":  # counts already incremented: call torch's kernel directly
            fused = torch._fused_adamw_ if wd != 0.0 else torch._fused_adam_
            fused(p, g, m, v, v_max, c, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                  amsgrad=amsgrad, maximize=False)  # fmt: skip
        else:  # the kernel increments its counts (copies of the old values)
            adam_impl(p, g, m, v, v_max, c, amsgrad, b1, b2, lr, wd, eps, False, wd != 0.0, impl)
    return views
