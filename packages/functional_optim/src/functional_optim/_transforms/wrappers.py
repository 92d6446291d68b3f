"""Wrappers around a whole optimizer: ``apply_if_finite``, ``MultiSteps``, ``lookahead``.

optax decides with ``lax.cond``; here the decision is a Python branch on a 0-d state tensor
(one host read per step), which gives the same numbers and keeps the in-place path from touching
the inner state when a step is rejected. ``apply_if_finite`` also works under
``torch.func.vmap`` when the finiteness differs across the batch: the pure path then selects
between the inner result and the old state with ``torch.where``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, StepFn, apply_updates
from functional_optim._fusion import view_step
from functional_optim._lists import (
    LeafView,
    ListTransform,
    _copy_state,
    by_device_dtype,
    pure_apply_all,
)
from functional_optim._recipes import record, transform_factory
from functional_optim._transforms._leaf import is_traced
from functional_optim._tree import PyTree, tree_clone, tree_flatten, tree_zeros_like

#: dtypes torch's AMP finiteness check takes.
_AMP_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = [
    "ApplyIfFiniteState",
    "LookaheadParams",
    "LookaheadState",
    "MultiSteps",
    "MultiStepsState",
    "apply_if_finite",
    "lookahead",
    "skip_not_finite",
]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`: consecutive and total non-finite steps (0-d int64),
    whether the last step was finite (0-d bool) and the inner state."""

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: OptState


def _all_finite(updates: PyTree) -> Tensor:
    checks = [torch.isfinite(u).all() for u in tree_flatten(updates)[0] if u is not None]
    if not checks:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([c.to(checks[0].device) for c in checks]).all()


def all_finite_lists(tensors: list[Tensor], consumed: bool) -> Tensor:
    """Whether every tensor is free of NaN and infinity (a 0-d bool).

    With ``consumed`` (the tensors may be written), floating tensors are checked by torch's AMP
    check (``_amp_foreach_non_finite_check_and_unscale_`` with scale 1, which leaves every
    value as it is) in one call per device and dtype; other tensors one by one.
    """
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    fast = [i for i, t in enumerate(tensors) if consumed and t.dtype in _AMP_DTYPES]
    flags: list[Tensor] = []
    for group in by_device_dtype([tensors[i] for i in fast]):
        ts = [tensors[fast[j]] for j in group]
        found = torch.zeros(1, dtype=torch.float32, device=ts[0].device)
        one = torch.ones(1, dtype=torch.float32, device=ts[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(ts, found, one)
        flags.append(found[0] == 0)
    chosen = set(fast)
    rest = [t for i, t in enumerate(tensors) if i not in chosen]
    flags.extend(torch.isfinite(t).all() for t in rest)
    device = flags[0].device
    return torch.stack([f.to(device) for f in flags]).all()


def _zeros(updates: PyTree) -> PyTree:
    return tree_zeros_like(updates)


def _where_tree(pred: Tensor, a: PyTree, b: PyTree) -> PyTree:
    """Leafwise ``where(pred, a, b)`` over two states of the same structure."""
    la, spec = tree_flatten(a)
    lb: list[Any] = spec.flatten_up_to(b)
    out = []
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            out.append(torch.where(pred, x, y))
        elif not isinstance(x, Tensor) and not isinstance(y, Tensor) and x == y:
            out.append(x)
        else:
            raise ValueError(
                "apply_if_finite under vmap needs an inner state whose leaves are all created at "
                "init (a lazily created buffer, e.g. trace's first momentum, cannot be selected)"
            )
    return spec.unflatten(out)


@transform_factory
def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    """Skip steps whose incoming updates hold a NaN or an infinity (zero updates, state kept).

    After more than ``max_consecutive_errors`` consecutive non-finite steps the update is applied
    anyway (as optax does), so a persistent problem shows up instead of silently freezing.

    Args:
        inner: the optimizer to protect.
        max_consecutive_errors: how many consecutive non-finite steps to skip.

    Returns:
        A ``GradientTransformation`` with state :class:`ApplyIfFiniteState`.

    Raises:
        ValueError: if ``max_consecutive_errors`` is negative.
    """
    if max_consecutive_errors < 0:
        raise ValueError(f"max_consecutive_errors must be >= 0, got {max_consecutive_errors}")

    def init(params: PyTree) -> ApplyIfFiniteState:
        zero = torch.zeros((), dtype=torch.int64)
        return ApplyIfFiniteState(
            zero, torch.ones((), dtype=torch.bool), zero.clone(), inner.init(params)
        )

    def decide(finite: Tensor, state: OptState) -> tuple[Tensor, Tensor, Tensor]:
        """``(notfinite_count, total_notfinite, accept)`` after a step of finiteness ``finite``."""
        count = torch.where(
            finite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1
        )
        total = torch.where(finite, state.total_notfinite, state.total_notfinite + 1)
        return count, total, torch.logical_or(finite, count > max_consecutive_errors)

    def store(state: OptState, count: Tensor, finite: Tensor, total: Tensor) -> None:
        state.notfinite_count.copy_(count)
        state.last_finite.copy_(finite)
        state.total_notfinite.copy_(total)

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        finite = _all_finite(updates).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        if is_traced(accept) and not inplace:
            new_updates, new_inner = inner.update(updates, state.inner_state, params)
            out = _where_tree(accept, new_updates, _zeros(updates))
            inner_state = _where_tree(accept, new_inner, state.inner_state)
        elif bool(accept):
            out, inner_state = inner.update(updates, state.inner_state, params, inplace=inplace)
        else:
            out, inner_state = _zeros(updates), state.inner_state
        if inplace:
            store(state, count, finite, total)
            count, finite, total = state.notfinite_count, state.last_finite, state.total_notfinite
        return out, ApplyIfFiniteState(count, finite, total, inner_state)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        """The inner ``step`` when the gradients are finite (or too many steps were skipped);
        otherwise params and inner state stay as they are."""
        assert inner.step is not None
        view = LeafView(params, grads)
        finite = all_finite_lists(view.grads, consumed=True).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        inner_state = state.inner_state
        if bool(accept):
            on_view = view_step(inner.step)
            if on_view is not None:
                inner_state = on_view(params, view, inner_state)
            else:
                inner_state = inner.step(params, grads, inner_state)
        store(state, count, finite, total)
        return state._replace(inner_state=inner_state)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        assert inner.lists is not None
        finite = all_finite_lists(updates, consumed=True).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        inner_state = state.inner_state
        if bool(accept):
            updates, inner_state = inner.lists.apply(updates, inner_state, view)
        elif updates:
            torch._foreach_zero_(updates)
        store(state, count, finite, total)
        return updates, state._replace(inner_state=inner_state)

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        finite = all_finite_lists(updates, consumed=False).to(state.notfinite_count.device)
        count, total, accept = decide(finite, state)
        if bool(accept):
            out, (inner_state,) = pure_apply_all((inner,), updates, (state.inner_state,), view)
        else:
            out = [torch.zeros_like(u) for u in updates]
            inner_state = _copy_state(state.inner_state)
        return out, ApplyIfFiniteState(count, finite, total, inner_state)

    fused: StepFn | None = step if inner.step is not None else None
    lists = None
    if inner.lists is not None:
        hyper = {"inner": inner.lists, "max_consecutive_errors": max_consecutive_errors}
        lists = ListTransform("apply_if_finite", hyper, apply, True, apply_pure)
    return GradientTransformation(init, update, fused, lists)


def skip_not_finite(
    updates: PyTree, gradient_step: Tensor, params: PyTree
) -> tuple[Tensor, dict[str, Tensor]]:
    """A ``should_skip_update_fn`` for :class:`MultiSteps`: skip updates with a NaN or infinity.

    Args:
        updates: the incoming updates.
        gradient_step: the number of inner steps taken so far (unused).
        params: the params (unused).

    Returns:
        ``(should_skip, {"should_skip": ..., "num_not_finite": ...})`` (0-d tensors).
    """
    del gradient_step, params
    counts = [(~torch.isfinite(u)).sum() for u in tree_flatten(updates)[0] if u is not None]
    num = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
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


class LookaheadParams(NamedTuple):
    """The two parameter sets of :func:`lookahead`: the fast weights (where gradients are taken)
    and the slow weights."""

    fast: PyTree
    slow: PyTree

    @classmethod
    def init_synced(cls, params: PyTree) -> LookaheadParams:
        """Fast and slow weights both equal to ``params`` (the slow ones are a copy)."""
        return cls(params, tree_clone(params))


class LookaheadState(NamedTuple):
    """State of :func:`lookahead`: the fast optimizer's state and the steps since the last sync
    (0-d int64)."""

    fast_state: OptState
    steps_since_sync: Tensor


@transform_factory
def lookahead(
    fast_optimizer: GradientTransformation,
    sync_period: int,
    slow_step_size: float | Tensor,
    reset_state: bool = False,
) -> GradientTransformation:
    """Lookahead: ``sync_period`` fast steps, then the slow weights move ``slow_step_size`` of
    the way to the fast ones and the fast weights restart from there.

    Params and updates are :class:`LookaheadParams`; the gradients passed to ``update`` are
    those of the fast weights (a tree like ``params.fast``).

    Args:
        fast_optimizer: the inner optimizer run on the fast weights.
        sync_period: fast steps between two synchronisations (>= 1).
        slow_step_size: interpolation factor of the slow weights (in [0, 1]).
        reset_state: re-initialise the fast optimizer's state at each synchronisation.

    Returns:
        A ``GradientTransformation`` with state :class:`LookaheadState`.

    Raises:
        ValueError: if ``sync_period < 1`` or ``slow_step_size`` is outside [0, 1].
    """
    if sync_period < 1:
        raise ValueError(f"sync_period must be >= 1, got {sync_period}")
    if not isinstance(slow_step_size, Tensor) and not 0.0 <= slow_step_size <= 1.0:
        raise ValueError(f"slow_step_size must be in [0, 1], got {slow_step_size}")

    def check(params: Any) -> LookaheadParams:
        if not isinstance(params, LookaheadParams):
            raise TypeError(
                "lookahead needs params as fo.LookaheadParams(fast, slow); start from "
                "fo.LookaheadParams.init_synced(params)"
            )
        return params

    def init(params: PyTree) -> LookaheadState:
        return LookaheadState(
            fast_optimizer.init(check(params).fast), torch.zeros((), dtype=torch.int64)
        )

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        lp = check(params)
        fast_updates, fast_state = fast_optimizer.update(
            updates, state.fast_state, lp.fast, inplace=inplace
        )
        leaves, spec = tree_flatten(fast_updates)
        if int(state.steps_since_sync) == sync_period - 1:
            fast: list[Any] = spec.flatten_up_to(lp.fast)
            slow: list[Any] = spec.flatten_up_to(lp.slow)
            fast_out: list[Any] = []
            slow_out: list[Any] = []
            for u, f, s in zip(leaves, fast, slow, strict=True):
                if u is None:
                    fast_out.append(None)
                    slow_out.append(None)
                    continue
                step = slow_step_size * (f + u - s)
                slow_out.append(step)
                fast_out.append(s + step - f)
            if reset_state:
                fast_state = fast_optimizer.init(lp.fast)
        else:
            fast_out = list(leaves)
            slow_out = [None if u is None else torch.zeros_like(u) for u in leaves]
        steps = (state.steps_since_sync + 1) % sync_period
        if inplace:
            steps = state.steps_since_sync.copy_(steps)
        out = LookaheadParams(spec.unflatten(fast_out), spec.unflatten(slow_out))
        return out, LookaheadState(fast_state, steps)

    return GradientTransformation(init, update)
