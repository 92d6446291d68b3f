"""``pure_step``: one step that returns new params and a new state, mutating nothing.

This is the function JAX users put under ``jit``: ``updates, state = tx.update(grads, state,
params)`` then ``params = apply_updates(params, updates)``, fused into one call. Eager torch has
no kernel that reads the old buffers and writes new ones in one pass, so the step copies the
buffers and runs torch's fused kernel in place on the copies, a chunk of leaves at a time
(about ``chunk_bytes`` per buffer): the kernel then finds the copies still in cache and the
step moves close to the bytes of a perfectly fused out-of-place kernel (old params and moments
read once, new ones written once) instead of a copy pass plus a full in-place pass.

Which transforms take this path (every other one, and every call that records autograd or runs
under ``torch.func``, takes ``tx.update`` + ``apply_updates``, the differentiable per-leaf path):

* a ``chain`` whose tail is Adam's (``scale_by_adam, [add_decayed_weights(wd)],
  scale(-lr) | scale_by_learning_rate(lr)``, see :mod:`functional_optim._fusion`); the
  components before the tail run as the pure list maths (``pure_apply_all``), e.g.
  ``clip_by_global_norm``;
* such a chain wrapped by ``inject_hyperparams`` (the aliases ``fo.adam``, ``fo.adamw``), or
  ending in one (``chain(clip_by_global_norm(c), fo.adamw(...))``).

Numbers: the same kernels and op order as the chain's in-place ``tx.step`` (bitwise equal to
it, and to ``torch.optim.Adam(fused=True)``); against ``tx.update`` + ``apply_updates`` they
differ by the fused kernel's roundings, the tolerance documented for the aliases' fused steps.

On CPU torch's fused kernel is compute-bound, so the copies cost their full time on top of it
(about 2.2x torch's in-place step). ``pure_step(tx, compiled=True)`` runs the same chains as
one out-of-place kernel compiled by ``torch.compile`` over recycled flat buffers instead
(:mod:`functional_optim._pure_flat`), within an ulp or two of ``tx.step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._counts import incremented
from functional_optim._fusion import _decay_split, _learning_rate, _lists, plan_tail
from functional_optim._lists import (
    LeafView,
    _copy_state,
    by_device_dtype,
    pure_apply_all,
    recording,
    with_active_leaves,
)
from functional_optim._pure_flat import FlatAdam
from functional_optim._transforms.hyperparams import InjectHyperparamsState, injected_inner
from functional_optim._tree import PyTree
from functional_optim.kernels._dispatch import resolve_impl
from functional_optim.kernels.adam import adam_impl

__all__ = ["CHUNK_BYTES", "PureStepFn", "pure_step"]

#: Default bytes per buffer in one chunk: the chunk's params, grads and moments stay in cache.
CHUNK_BYTES = 1 << 20


class PureStepFn(Protocol):
    """``step(params, grads, state) -> (new params, new state)``; no input is written to."""

    def __call__(
        self, params: PyTree, grads: PyTree, state: OptState
    ) -> tuple[PyTree, OptState]: ...


def pure_step(
    tx: GradientTransformation, *, chunk_bytes: int = CHUNK_BYTES, compiled: bool = False
) -> PureStepFn:
    """Fuse ``tx.update`` and ``apply_updates`` into one pure step (see the module docstring).

    Args:
        tx: the transform.
        chunk_bytes: about how many bytes of each buffer one chunk of leaves holds (a leaf
            larger than that is a chunk of its own).
        compiled: run Adam-tailed chains as one out-of-place kernel compiled by
            ``torch.compile`` (compiled on the first call; see
            :mod:`functional_optim._pure_flat`): about as fast as torch's in-place fused step,
            equal to ``tx.step`` to a few float32 ulps instead of bitwise. The step then keeps
            up to two spare generations of params and moments for reuse, as a caching
            allocator would; they are freed with the step function.

    Returns:
        ``step(params, grads, state) -> (new params, new state)``. Params whose gradient is
        ``None`` are returned as they are (the same tensors, as ``apply_updates`` does).

    Raises:
        TypeError: if ``tx`` is not a ``GradientTransformation``.
        ValueError: if ``chunk_bytes`` is not positive.

    Example::

        >>> step = fo.pure_step(fo.adam(lr=1e-3))
        >>> state = tx.init(params)
        >>> params, state = step(params, grads, state)   # the old params and state are intact
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(
            f"pure_step() takes a GradientTransformation (e.g. fo.adam(lr=1e-3)), got "
            f"{type(tx).__name__}"
        )
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return _make_step(tx, chunk_bytes, FlatAdam(compiled=True) if compiled else None)


def _make_step(tx: GradientTransformation, chunk_bytes: int, flat: FlatAdam | None) -> PureStepFn:
    """:func:`pure_step` with the flat Adam path given (tests pass an eager one)."""

    def step(params: PyTree, grads: PyTree, state: OptState) -> tuple[PyTree, OptState]:
        if _fusable(tx, state) and not recording(params, grads, state):
            view = LeafView(params, grads)
            with torch.no_grad():
                new_active, new_state = _fused(tx, view, view.grads, state, chunk_bytes, flat)
            leaves = list(view.all_params)
            for i, p in zip(view.idx, new_active, strict=True):
                leaves[i] = p
            return view.spec.unflatten(leaves), new_state
        updates, new_state = tx.update(grads, state, params)
        return apply_updates(params, updates), new_state

    return step


def _inner(tx: GradientTransformation, state: OptState) -> tuple[GradientTransformation, Any]:
    found = injected_inner(tx, state)
    assert found is not None
    return found


def _fusable(tx: GradientTransformation, state: OptState) -> bool:
    """Whether :func:`_fused` knows ``tx`` (read only: nothing is computed)."""
    found = injected_inner(tx, state)
    if found is not None:
        return _fusable(*found)
    lists = tx.lists
    if lists is None or lists.key != "chain" or not isinstance(state, tuple):
        return False
    components: Sequence[GradientTransformation] = lists.hyper["transforms"]
    if len(state) != len(components):
        return False  # the per-leaf path raises the chain's error
    plan = plan_tail(components)
    if plan.rule == "step":
        i = plan.tail[0]
        return _fusable(components[i], state[i])
    return plan.rule == "adam"


Prefix = Callable[[list[Tensor], bool], list[Tensor]]


def _no_prefix(updates: list[Tensor], owned: bool) -> list[Tensor]:
    return updates


def _fused(
    tx: GradientTransformation,
    view: LeafView,
    updates: list[Tensor],
    state: OptState,
    chunk: int,
    flat: FlatAdam | None,
    prefix: Prefix = _no_prefix,
) -> tuple[list[Tensor], OptState]:
    """New active params and the new state of a transform :func:`_fusable` accepted.

    ``prefix(updates, owned)`` runs the components of enclosing chains that come before
    ``tx`` (``owned``: on the step's private copy of the gradients, in place).
    """
    if injected_inner(tx, state) is not None:
        inner_tx, inner_state = _inner(tx, state)
        new_params, new_inner = _fused(inner_tx, view, updates, inner_state, chunk, flat, prefix)
        return new_params, InjectHyperparamsState(state.hyperparams, new_inner)
    assert tx.lists is not None
    components: Sequence[GradientTransformation] = tx.lists.hyper["transforms"]
    plan = plan_tail(components)
    new_state = list(state)
    head = [components[i] for i in plan.head]
    head_state = [state[i] for i in plan.head]

    def run_head(current: list[Tensor], owned: bool) -> list[Tensor]:
        current, states = pure_apply_all(head, prefix(current, owned), head_state, view, owned)
        for i, s in zip(plan.head, states, strict=True):
            new_state[i] = s
        return current

    if plan.rule == "step":
        i = plan.tail[0]
        new_params, new_state[i] = _fused(
            components[i], view, updates, state[i], chunk, flat, run_head
        )
        return new_params, tuple(new_state)
    tail = [_lists(components[i]) for i in plan.tail]
    last = plan.tail[-1]
    new_state[last] = _copy_state(state[last])  # a schedule counts this step in the copy
    lr = _learning_rate(tail[-1], new_state[last])
    wd, decayed, rest = _decay_split(tail, view)
    groups = [(list(range(len(updates))), wd)] if decayed is None else [(decayed, wd), (rest, 0.0)]
    adam = plan.tail[0]
    hyper = tail[0].hyper
    result = None
    if flat is not None:
        trivial = not head and prefix is _no_prefix
        head_fn = None if trivial else lambda owned: run_head(owned, True)
        result = flat.step(view, updates, head_fn, hyper, state[adam], lr, groups)
    if result is None:
        current = run_head(updates, False)
        result = _adam_chunks(view, current, hyper, state[adam], lr, groups, chunk)
    new_params, new_state[adam] = result
    return new_params, tuple(new_state)


def _chunks(tensors: Sequence[Tensor], positions: Sequence[int], chunk: int) -> list[list[int]]:
    """``positions`` cut in order into runs of one device and dtype, each of about ``chunk``
    bytes (of ``tensors``)."""
    out: list[list[int]] = []
    for group in by_device_dtype([tensors[j] for j in positions]):
        run: list[int] = []
        size = 0
        for k in group:
            j = positions[k]
            run.append(j)
            size += tensors[j].numel() * tensors[j].element_size()
            if size >= chunk:
                out.append(run)
                run, size = [], 0
        if run:
            out.append(run)
    return out


def _fresh(tensors: list[Tensor]) -> list[Tensor]:
    """New contiguous tensors with the values of ``tensors`` (one ``_foreach_copy_``).

    Contiguous, not ``empty_like``'s strides: the fused kernel walks params and moments in
    memory order, so a param passed transposed must not keep its strides while its moments
    keep theirs."""
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def _adam_chunks(
    view: LeafView,
    updates: list[Tensor],
    hyper: Any,
    state: Any,
    lr: float,
    groups: list[tuple[list[int], float]],
    chunk: int,
) -> tuple[list[Tensor], Any]:
    """Adam on copies of the params and moments, chunk by chunk; returns the new params and
    the new ``ScaleByAdamState``. The path (fused, foreach, single) is resolved once over all
    the params, as ``tx.step`` does."""
    amsgrad = bool(hyper["amsgrad"])
    b1, b2, eps = float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])
    params = view.params
    sources = [params, view.gather(state.mu), view.gather(state.nu)]
    if amsgrad:
        sources.append(view.gather(state.nu_max))
    old_counts = view.gather(state.count)
    counts = incremented(old_counts)
    impl = resolve_impl("auto", params, True) if params else "fused"
    new = [list(src) for src in sources]
    for positions, wd in groups:
        for run in _chunks(params, positions, chunk):
            p, m, v, *rest = [_fresh([src[j] for j in run]) for src in sources]
            v_max = rest[0] if rest else []
            g = [updates[j] for j in run]
            if impl == "fused":  # counts already incremented: call torch's kernel directly
                fused = torch._fused_adamw_ if wd != 0.0 else torch._fused_adam_
                c = [counts[j] for j in run]
                fused(p, g, m, v, v_max, c, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                      eps=eps, amsgrad=amsgrad, maximize=False)  # fmt: skip
            else:
                c = [old_counts[j].clone() for j in run]  # the kernel increments them
                adam_impl(
                    p, g, m, v, v_max, c, amsgrad, b1, b2, lr, wd, eps, False, wd != 0.0, impl
                )
            for buffer, copies in zip(new, (p, m, v, v_max), strict=False):
                for j, x in zip(run, copies, strict=True):
                    buffer[j] = x
    new_mu, new_nu = new[1], new[2]
    new_state = state._replace(
        count=with_active_leaves(view, state.count, counts),
        mu=with_active_leaves(view, state.mu, new_mu),
        nu=with_active_leaves(view, state.nu, new_nu),
        nu_max=with_active_leaves(view, state.nu_max, new[3]) if amsgrad else state.nu_max,
    )
    return new[0], new_state
