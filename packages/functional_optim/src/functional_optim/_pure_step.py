"""``pure_step``: one step that returns new params and a new state, mutating nothing.

This is the function JAX users put under ``jit``: ``updates, state = tx.update(grads, state,
params)`` then ``params = apply_updates(params, updates)``, fused into one call. The step runs
the transform's own in-place ``tx.step``, whose kernel call goes to a runner that hands the
kernel new buffers to write (:mod:`functional_optim._pure_flat`). Where the kernel has an
out-of-place version (:mod:`functional_optim._out_of_place`: torch's fused Adam, AdamW and SGD
on fp32 CPU params) that reads the old buffers and writes the new ones in one pass; otherwise
the old values are copied in a chunk of leaves at a time and the kernel runs on each chunk
while it is in cache. One mechanism for every algorithm; nothing in it knows one.

Which transforms take this path: those whose ``step`` ends in one list kernel call,

* every alias built from a registry entry with a kernel (``fo.adam``, ``fo.adamw``,
  ``fo.sgd``, ``fo.rmsprop``, ``fo.lion``, ...), ``inject_hyperparams`` around it included;
* a ``chain`` whose in-place step ends in such a step (``chain(clip_by_global_norm(c),
  fo.adamw(...))``) or in a fused tail of :mod:`functional_optim._fusion` (Adam, Lion,
  RMSprop, Adamax, or a plain learning rate: ``chain(scale_by_adam(), add_decayed_weights(wd),
  scale_by_learning_rate(lr))``, ``chain(trace(0.9), scale(-lr))``); the components before it
  run on copies of the gradients and of their state.

Every other transform, and every call that records autograd, runs under ``torch.func`` or is
traced by ``torch.compile``, takes ``tx.update`` + ``apply_updates``: the differentiable
per-leaf path.

Numbers: ``tx.step``'s on copies, bitwise (the same kernel on the same values). The state
tensors the kernel does not write (a schedule's count, the state of the components before
it) are cloned first; the gradients too when a component before the kernel rescales them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from itertools import compress
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from functional_optim._aliases._kernel_step import written_state
from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._fusion import plan_tail
from functional_optim._kernel_runner import running_with
from functional_optim._pure_flat import FlatRunner, clone
from functional_optim._recording import leaves_recording
from functional_optim._transforms.hyperparams import injected_inner
from functional_optim._tree import PyTree, tree_flatten, tree_leaves

__all__ = ["CHUNK_BYTES", "PureStepFn", "pure_step"]

#: Default bytes of params in one chunk. Small chunks keep a chunk's copies in cache for its
#: kernel, but each chunk costs a kernel call (tens of microseconds of Python); on a CPU with a
#: large last-level cache 16 MiB chunks were the fastest (``benchmarks/pure_step_speed.py``).
CHUNK_BYTES = 1 << 24


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
        chunk_bytes: about how many bytes of params one chunk of leaves holds (a leaf larger
            than that is a chunk of its own).
        compiled: deprecated and ignored (it ran an Adam-only compiled kernel): every
            transform takes the same path.

    The new params and the state tensors the kernel writes are views into flat buffers that
    the step reuses once the caller holds no view of them: in a loop it keeps one spare set
    (two if the caller keeps an older state), as a caching allocator would. They are freed
    with the step function.

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
    if compiled:
        warnings.warn(
            "pure_step(compiled=True) is deprecated and ignored: every transform takes the "
            "same path (its own kernel on copies)",
            DeprecationWarning,
            stacklevel=2,
        )
    runner = FlatRunner(chunk_bytes)
    plans: dict[Any, _Plan | None] = {}  # state structure -> what the kernel writes in it

    def plan(leaves: list[Any], spec: Any, state: OptState) -> _Plan | None:
        # a buffer the kernel makes on its first step is a None leaf until then
        key = (spec, tuple(i for i, x in enumerate(leaves) if x is None))
        if key in plans:
            return plans[key]
        found = kernel_writes(tx, state)
        made = None
        if found is not None:
            written = {id(x) for x in found.state if isinstance(x, Tensor)}
            keep = [id(x) in written for x in leaves]
            copies = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and not keep[i]]
            made = _Plan(keep, copies, found.writes_grads)
        if len(plans) >= 8:
            plans.clear()
        plans[key] = made
        return made

    def step(params: PyTree, grads: PyTree, state: OptState) -> tuple[PyTree, OptState]:
        leaves, spec = tree_flatten(state)
        param_leaves, param_spec = tree_flatten(params)
        grad_leaves, grad_spec = tree_flatten(grads)
        traced = torch.compiler.is_compiling() or leaves_recording(
            param_leaves, grad_leaves, leaves
        )
        found = None if traced else plan(leaves, spec, state)
        if found is None:
            updates, new_state = tx.update(grads, state, params)
            return apply_updates(params, updates), new_state
        assert tx.step is not None
        shadow = state
        if found.copies:  # the state the kernel does not write: a schedule's count, ...
            shadow_leaves = list(leaves)
            for i in found.copies:
                shadow_leaves[i] = clone(leaves[i])
            shadow = spec.unflatten(shadow_leaves)
        with runner.lock, running_with(runner), torch.no_grad():
            runner.begin()
            try:
                if found.writes_grads:  # the components before the kernel rescale them
                    present = [g for g in grad_leaves if g is not None]
                    copies = iter(runner.copies(present))
                    grads = grad_spec.unflatten(
                        [None if g is None else next(copies) for g in grad_leaves]
                    )
                new_state = tx.step(params, grads, shadow)
                get = runner.replaced.get
                new_active = map(get, map(id, param_leaves), param_leaves)
                new_params = param_spec.unflatten(list(new_active))
                new_leaves, new_spec = tree_flatten(new_state)
                mapped = list(map(get, map(id, new_leaves), new_leaves))
                # an old tensor no kernel wrote (a leaf without a gradient) is copied, so that
                # the new state shares nothing with the old
                stale = set(map(id, compress(leaves, found.kernel_writes)))
                stale.intersection_update(map(id, mapped))
                if stale:
                    mapped = [_copy(x) if id(x) in stale else x for x in mapped]
                new_state = new_spec.unflatten(mapped)
            finally:
                runner.begin()  # hold no tensor of this call
        return new_params, new_state

    return step


class KernelWrites(NamedTuple):
    """What a step's kernel writes beyond the params: ``state`` leaves (``None`` for a buffer
    it makes), and the gradients (``writes_grads``) when components before it rescale them."""

    state: Sequence[Any]
    writes_grads: bool


def kernel_writes(tx: GradientTransformation, state: OptState) -> KernelWrites | None:
    """What ``tx.step`` writes through one list kernel, or None when its step is not one
    (see the module docstring; read only: nothing is computed)."""
    found = injected_inner(tx, state)
    if found is not None:
        return kernel_writes(*found)
    own = written_state(tx.step, state)
    if own is not None:
        return KernelWrites(own, False)
    lists = tx.lists
    if tx.step is None or lists is None or lists.key != "chain" or not isinstance(state, tuple):
        return None
    components: Sequence[GradientTransformation] = lists.hyper["transforms"]
    if len(state) != len(components):
        return None  # the per-leaf path raises the chain's error
    plan = plan_tail(components)
    if plan.rule == "step":
        last = plan.tail[0]
        inner = kernel_writes(components[last], state[last])
        if inner is None:
            return None
        return KernelWrites(inner.state, inner.writes_grads or bool(plan.head))
    if plan.fused is not None:
        own_state = state[plan.tail[0]]
        leaves = tree_leaves([getattr(own_state, name) for name in plan.fused.written])
        return KernelWrites(leaves, bool(plan.head))
    return None


class _Plan(NamedTuple):
    """Per flattened state leaf, whether the kernel writes it; whether grads are written."""

    kernel_writes: list[bool]
    copies: list[int]  # the positions of the other tensors
    writes_grads: bool


def _copy(x: Any) -> Any:
    return clone(x) if isinstance(x, Tensor) else x
