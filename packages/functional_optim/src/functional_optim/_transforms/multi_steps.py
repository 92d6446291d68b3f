"""``MultiSteps``: gradient accumulation around a whole optimizer, and ``skip_not_finite``.

optax decides with ``lax.cond``; here the decision is a Python branch on a 0-d state tensor
(one host read per step), which gives the same numbers and keeps the in-place path from touching
the inner state between two inner steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._lists import LeafView
from functional_optim._recipes import record
from functional_optim._sharded_flags import summed_over_shards_of
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = ["MultiSteps", "MultiStepsState", "skip_not_finite"]


def _zeros(updates: PyTree) -> PyTree:
    return tree_zeros_like(updates)


def skip_not_finite(
    updates: PyTree, gradient_step: Tensor, params: PyTree
) -> tuple[Tensor, dict[str, Tensor]]:
    """A ``should_skip_update_fn`` for :class:`MultiSteps`: skip updates with a NaN or infinity.

    Args:
        updates: the incoming updates.
        gradient_step: the number of inner steps taken so far (unused).
        params: the params (on DTensor shards stepped by ``fo.Optimizer``, the local params:
            the counts are then those of the whole tensors, the same on every rank).

    Returns:
        ``(should_skip, {"should_skip": ..., "num_not_finite": ...})`` (0-d tensors).
    """
    del gradient_step
    leaves, spec = tree_flatten(updates)
    owners: list[Any] = [] if params is None else spec.flatten_up_to(params)
    counts = [(~torch.isfinite(u)).sum() for u in leaves if u is not None]
    num = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
    if owners and counts:  # on DTensor shards: the counts of the whole tensors (one all-reduce)
        mine = [p for u, p in zip(leaves, owners, strict=True) if u is not None]
        whole = summed_over_shards_of(torch.stack(counts), mine)
        num = num if whole is None else whole.sum()
    skip = num > 0
    return skip, {"should_skip": skip, "num_not_finite": num}


class MultiStepsState(NamedTuple):
    """State of :class:`MultiSteps`: the micro-step within the current accumulation, the number
    of inner steps taken, the inner state, the accumulated gradients and the skip function's
    state."""

    mini_step: Tensor
    gradient_step: Tensor
    inner_opt_state: OptState
    acc_grads: PyTree
    skip_state: Any = ()


class MultiSteps:
    """Gradient accumulation: apply ``opt`` once every ``k`` calls, on the mean (or sum) of the
    ``k`` gradients; in between, the updates are zeros and the inner state does not change. A
    ``None`` gradient leaves its accumulator as it is for that call (what the other calls
    accumulated is still applied).

    Args:
        opt: the inner optimizer.
        every_k_schedule: ``k``, or a function of the inner step count returning it.
        use_grad_mean: average the gradients (else sum them).
        should_skip_update_fn: ``fn(updates, gradient_step, params) -> (skip, skip_state)``;
            a skipped call leaves the accumulation untouched (e.g. :func:`skip_not_finite`).
            On DTensor params ``fo.Optimizer`` passes it the local shards: the decision must
            be the same on every rank (:func:`skip_not_finite` makes it so).
        accumulator_dtype: dtype of the accumulated gradients (``acc_grads``), e.g.
            ``torch.float64`` to accumulate ``float32`` or ``bfloat16`` gradients without
            their rounding; the inner optimizer gets them back in the updates' dtype (in the
            params' for :meth:`step`), as optax casts them. None (the default) keeps each
            param's dtype (complex params get the complex dtype of a real
            ``accumulator_dtype``'s precision). optax's own default is ``float32``; None here
            keeps float64 gradients in float64.

    Raises:
        TypeError: if ``opt`` is not a ``GradientTransformation`` or ``accumulator_dtype`` is
            not a floating or complex ``torch.dtype``.
        ValueError: if an integer ``every_k_schedule`` is below 1.

    Example::

        >>> tx = fo.MultiSteps(fo.adam(lr=1e-3), every_k_schedule=4).gradient_transformation()
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int | Callable[[Tensor], int | Tensor],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., tuple[Tensor, Any]] | None = None,
        accumulator_dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(opt, GradientTransformation):
            raise TypeError(f"MultiSteps needs a GradientTransformation, got {type(opt).__name__}")
        if accumulator_dtype is not None and not (
            isinstance(accumulator_dtype, torch.dtype)
            and (accumulator_dtype.is_floating_point or accumulator_dtype.is_complex)
        ):
            raise TypeError(
                "accumulator_dtype must be None or a floating or complex torch.dtype, got "
                f"{accumulator_dtype!r}"
            )
        if not callable(every_k_schedule) and int(every_k_schedule) < 1:
            raise ValueError(f"every_k_schedule must be >= 1, got {every_k_schedule}")
        self._opt = opt
        self._every_k = every_k_schedule
        self._use_grad_mean = use_grad_mean
        self._should_skip = should_skip_update_fn
        self._acc_dtype = accumulator_dtype

    @property
    def inner_opt(self) -> GradientTransformation:
        """The wrapped optimizer."""
        return self._opt

    def _k(self, gradient_step: Tensor) -> int:
        if callable(self._every_k):
            return int(self._every_k(gradient_step))
        return int(self._every_k)

    def init(self, params: PyTree) -> MultiStepsState:
        """Initial state: no micro-step yet, zero accumulators, the inner optimizer's state."""
        zero = torch.zeros((), dtype=torch.int64)
        skip_state: Any = ()
        if self._should_skip is not None:
            _, skip_state = self._should_skip(tree_zeros_like(params), zero, params)
        return MultiStepsState(
            zero, zero.clone(), self._opt.init(params), self._zero_accumulators(params), skip_state
        )

    def _zero_accumulators(self, params: PyTree) -> PyTree:
        """Zeros like ``params``, of ``accumulator_dtype`` when one was given."""
        if self._acc_dtype is None:
            return tree_zeros_like(params)
        leaves, spec = tree_flatten(params)
        return spec.unflatten(
            [None if p is None else torch.zeros_like(p, dtype=self._dtype_for(p)) for p in leaves]
        )

    def _dtype_for(self, param: Tensor) -> torch.dtype:
        """The accumulator dtype of ``param``'s gradients."""
        dtype = self._acc_dtype
        assert dtype is not None
        if param.is_complex() and not dtype.is_complex:
            return torch.promote_types(dtype, torch.complex64)
        return dtype

    def _for_inner(self, acc: PyTree, like: PyTree, fallback: PyTree = None) -> PyTree:
        """The accumulated gradients as the inner optimizer takes them: each cast to the dtype
        of its leaf in ``like`` (or, where that is None, in ``fallback``), as optax's
        ``cast_like``. Without ``accumulator_dtype``, ``acc`` itself."""
        if self._acc_dtype is None:
            return acc
        leaves, spec = tree_flatten(acc)
        refs: list[Any] = spec.flatten_up_to(like)
        backs: list[Any] = (
            [None] * len(leaves) if fallback is None else spec.flatten_up_to(fallback)
        )
        out: list[Any] = []
        for a, ref, back in zip(leaves, refs, backs, strict=True):
            ref = back if ref is None else ref
            if a is None or ref is None or a.dtype == ref.dtype:
                out.append(a)
            else:
                out.append(a.to(ref.dtype))
        return spec.unflatten(out)

    def update(
        self, updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        """Accumulate ``updates``; every ``k``-th call, step the inner optimizer.

        Returns:
            ``(updates, state)``: zeros between inner steps, the inner updates on the ``k``-th.
        """
        skip_state = state.skip_state
        if self._should_skip is not None:
            skip, skip_state = self._should_skip(updates, state.gradient_step, params)
            if bool(skip):
                return _zeros(updates), state._replace(skip_state=skip_state)
        mini = int(state.mini_step)
        leaves, spec = tree_flatten(updates)
        accs: list[Any] = spec.flatten_up_to(state.acc_grads)
        new_accs: list[Any] = []
        for g, acc in zip(leaves, accs, strict=True):
            if g is None:
                new_accs.append(acc)
                continue
            if self._use_grad_mean:
                delta = (g - acc) / (mini + 1)
                new = acc.add_(delta) if inplace else acc + delta
            else:
                new = acc.add_(g) if inplace else acc + g
            if self._acc_dtype is not None and new.dtype != acc.dtype:
                new = new.to(acc.dtype)  # the accumulator keeps its dtype
            new_accs.append(new)
        acc_tree = spec.unflatten(new_accs)
        if mini < self._k(state.gradient_step) - 1:
            mini_step = state.mini_step.add_(1) if inplace else state.mini_step + 1
            new_state = MultiStepsState(
                mini_step, state.gradient_step, state.inner_opt_state, acc_tree, skip_state
            )
            return _zeros(updates), new_state
        out, inner_state = self._opt.update(
            self._for_inner(acc_tree, updates, params),
            state.inner_opt_state,
            params,
            inplace=inplace,
        )
        step = state.gradient_step.add_(1) if inplace else state.gradient_step + 1
        mini_step = state.mini_step.zero_() if inplace else torch.zeros_like(state.mini_step)
        return out, MultiStepsState(mini_step, step, inner_state, _zeros(acc_tree), skip_state)

    def step(self, params: PyTree, grads: PyTree, state: MultiStepsState) -> MultiStepsState:
        """In place: accumulate ``grads`` over flat lists, one ``_foreach`` op per call;
        every ``k``-th call, run the inner optimizer's own ``step`` on the accumulated
        gradients (or its ``update`` in place then ``apply_updates``), then zero them.

        The numbers of ``update(inplace=True)`` + ``apply_updates`` to rounding: the running
        mean is one ``lerp`` by ``1 / (n + 1)`` where ``update`` divides ``g - acc`` by
        ``n + 1`` (optax's form; 2.5x the passes), and a fused inner step rounds as its
        kernel does. The calls in between leave the params alone instead of adding zeros.

        Args:
            params: the params (updated in place on the ``k``-th call).
            grads: the gradients (``None`` leaves allowed; not written to).
            state: the state (its buffers updated in place).

        Returns:
            The new state (holding the same buffers).
        """
        skip_state = state.skip_state
        if self._should_skip is not None:
            skip, skip_state = self._should_skip(grads, state.gradient_step, params)
            if bool(skip):
                return state._replace(skip_state=skip_state)
        view = LeafView(params, grads)
        accs = view.gather(state.acc_grads)
        mini = int(state.mini_step)
        if view.grads:
            if self._use_grad_mean:  # update's acc + (g - acc) / (mini + 1), as one lerp
                torch._foreach_lerp_(accs, _like(view.grads, accs), 1.0 / (mini + 1))
            else:
                torch._foreach_add_(accs, _like(view.grads, accs))
        if mini < self._k(state.gradient_step) - 1:
            state.mini_step.add_(1)
            return state._replace(skip_state=skip_state)
        inner = self._opt
        acc_grads = self._for_inner(state.acc_grads, params)
        if inner.step is not None:
            inner_state = inner.step(params, acc_grads, state.inner_opt_state)
        else:
            updates, inner_state = inner.update(
                acc_grads, state.inner_opt_state, params, inplace=True
            )
            apply_updates(params, updates, inplace=True)
        everything = [a for a in view.spec_leaves(state.acc_grads) if a is not None]
        if everything:
            torch._foreach_zero_(everything)
        state.gradient_step.add_(1)
        state.mini_step.zero_()
        return MultiStepsState(
            state.mini_step, state.gradient_step, inner_state, state.acc_grads, skip_state
        )

    def has_updated(self, state: MultiStepsState) -> bool:
        """Whether the last ``update`` stepped the inner optimizer."""
        return int(state.mini_step) == 0 and int(state.gradient_step) > 0

    def gradient_transformation(self) -> GradientTransformation:
        """This wrapper as a ``GradientTransformation`` (to chain it or give it to fo.Optimizer),
        with :meth:`step` as its in-place step."""
        tx = GradientTransformation(self.init, self.update, self.step)
        record(tx, MultiSteps.gradient_transformation, (self,), {})  # pickled with this wrapper
        return tx


def _like(grads: list[Tensor], accs: list[Tensor]) -> list[Tensor]:
    """``grads`` cast to their accumulators' dtypes where those differ."""
    return [g if g.dtype == a.dtype else g.to(a.dtype) for g, a in zip(grads, accs, strict=True)]
