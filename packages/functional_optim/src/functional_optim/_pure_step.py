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

The copies go into flat buffers the step keeps and reuses (fresh CPU memory costs a page
fault per page), and in a loop they are single slice copies of the step's own last outputs;
see :mod:`functional_optim._pure_flat`. ``pure_step(tx, compiled=True)`` runs the same chains
as one out-of-place kernel compiled by ``torch.compile`` instead, within an ulp or two of
``tx.step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._fusion import _decay_split, _learning_rate, _lists, check_tail, plan_tail
from functional_optim._lists import (
    LeafView,
    _copy_state,
    pure_apply_all,
    recording,
)
from functional_optim._pure_flat import FlatAdam
from functional_optim._transforms.hyperparams import InjectHyperparamsState, injected_inner
from functional_optim._tree import PyTree

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
            ``torch.compile`` (compiled on the first call), within an ulp or two of
            ``tx.step`` instead of bitwise; see :mod:`functional_optim._pure_flat`.

    The new params and moments of Adam-tailed chains are views into flat buffers that the
    step reuses once the caller holds no view of them: in a loop it keeps one spare set of
    params and moments (two if the caller keeps an older state), as a caching allocator would.
    They are freed with the step function.

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
    return _make_step(tx, FlatAdam("compiled" if compiled else "fused", chunk_bytes))


def _make_step(tx: GradientTransformation, flat: FlatAdam) -> PureStepFn:
    """:func:`pure_step` with its flat buffers' owner given (tests pick its mode)."""

    def step(params: PyTree, grads: PyTree, state: OptState) -> tuple[PyTree, OptState]:
        if _fusable(tx, state) and not recording(params, grads, state):
            view = LeafView(params, grads)
            with torch.no_grad():
                new_active, new_state = _fused(tx, view, view.grads, state, flat)
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
    flat: FlatAdam,
    prefix: Prefix = _no_prefix,
) -> tuple[list[Tensor], OptState]:
    """New active params and the new state of a transform :func:`_fusable` accepted.

    ``prefix(updates, owned)`` runs the components of enclosing chains that come before
    ``tx`` (``owned``: on the step's private copy of the gradients, in place).
    """
    if injected_inner(tx, state) is not None:
        inner_tx, inner_state = _inner(tx, state)
        new_params, new_inner = _fused(inner_tx, view, updates, inner_state, flat, prefix)
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
        new_params, new_state[i] = _fused(components[i], view, updates, state[i], flat, run_head)
        return new_params, tuple(new_state)
    tail = [_lists(components[i]) for i in plan.tail]
    adam = plan.tail[0]
    check_tail(plan.rule, tail[0], state[adam], view, updates)  # before the head runs
    last = plan.tail[-1]
    new_state[last] = _copy_state(state[last])  # a schedule counts this step in the copy
    lr = _learning_rate(tail[-1], new_state[last])
    wd, decayed, rest = _decay_split(tail, view)
    groups = [(list(range(len(updates))), wd)] if decayed is None else [(decayed, wd), (rest, 0.0)]
    hyper = tail[0].hyper
    trivial = not head and prefix is _no_prefix
    head_fn = None if trivial else lambda owned: run_head(owned, True)
    result = flat.step(view, updates, head_fn, hyper, state[adam], lr, groups)
    if result is None:  # gradients unlike their params: the head on copies, the kernel objects
        current = run_head(updates, False)
        result = flat.step(view, current, None, hyper, state[adam], lr, groups, fused_only=True)
        assert result is not None
    new_params, new_state[adam] = result
    return new_params, tuple(new_state)
