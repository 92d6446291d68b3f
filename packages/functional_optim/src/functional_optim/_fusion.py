"""The in-place ``step`` of a chain: flatten once, run lists, hand the tail to a fused kernel.

``chain`` calls :func:`chain_step` when every component has ``lists`` (see
:mod:`functional_optim._lists`). The step plans its work once, when the chain is built:

1. no-op components (``identity``, ``add_decayed_weights(0)``) are dropped;
2. the tail of the chain, which ends by writing the params, is matched against these rules,
   first match wins:

   * the last component has a fused ``step`` of its own (an alias such as ``fo.adamw``):
     the earlier components run over the lists, then that ``step`` gets their output as its
     gradients, so ``chain(clip_by_global_norm(c), adamw(...))`` is torch's
     ``clip_grad_norm_`` followed by ``AdamW(fused=True)``, bitwise;
   * ``<scaling>, [add_decayed_weights(wd)], scale(-lr)`` (or ``scale_by_learning_rate(lr)``,
     schedules included), where the scaling transform declares a fused tail
     (``ListTransform.tail``, :mod:`functional_optim._tail_kernels`): that tail's kernel.
     ``scale_by_adam`` declares ``kernels.adamw`` (``kernels.adam`` without the decay, torch's
     fused kernel where it has one), ``scale_by_lion`` Lion in the ``lerp`` form,
     ``scale_by_rms`` torch's foreach RMSprop and ``scale_by_adamax`` torch's foreach Adamax;
     this module reads nothing else of them;
   * ``[add_decayed_weights(wd)], scale(-lr)``: ``p.mul_(1 - lr * wd)`` then
     ``p.add_(u, alpha=-lr)``, one ``_foreach`` call each;
   * in all of these, ``masked(add_decayed_weights(wd), mask)`` may stand for the decay: the
     leaves are split in two, as torch's two param groups (with and without weight decay);
   * otherwise ``p.add_(u)`` after the whole chain.

3. everything before the tail runs as each component's ``lists.apply``, in place.

Before anything runs, every step checks its inputs (:func:`check_tail`, through
:data:`functional_optim._step_checks.CHECKER`): gradients shaped like their params on
their devices (no meta tensors) and, for a declared tail, the state lists its kernel reads,
with torch's errors for what it does not take (sparse gradients, other dtypes; both from the
declaration). A tail that is an alias's own ``step`` checks its state itself;
the head's list maths are ``torch._foreach_*`` ops, which raise on a size mismatch.

Numbers: the list maths equal ``update(inplace=True)`` bitwise; a fused tail computes the same
formula in torch's fused order (the ``p * (1 - lr * wd)`` of AdamW for the decoupled decay), so
it matches the pure path to the tolerance documented for the aliases' fused steps
(tests/functional_optim/test_aliases.py) and torch's fused kernels bitwise.

The step consumes ``grads``: a component that rescales them (``clip_by_global_norm``,
``scale``) writes into them, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim import _tail_kernels as tail_kernels
from functional_optim._fn_types import OptState, StepFn
from functional_optim._kernel_runner import run_kernel
from functional_optim._lists import FusedTail, LeafView, ListTransform, TailCall
from functional_optim._step_checks import CHECKER, Buffer, GradRules
from functional_optim._tree import PyTree

__all__ = ["chain_step", "check_tail", "plan_tail", "view_step"]

ViewStep = Callable[[PyTree, LeafView, Any], Any]

#: chain step -> the same step on a view built by the caller (no second flatten of the trees)
_VIEW_STEPS: weakref.WeakKeyDictionary[Callable[..., Any], ViewStep] = weakref.WeakKeyDictionary()


def view_step(step: Callable[..., Any] | None) -> ViewStep | None:
    """The ``(params, view, state)`` form of a chain's ``step``, or None for any other step.

    A wrapper that has flattened the params already (``multi_transform``) passes each inner
    chain a :meth:`LeafView.subset` instead of a tree with ``None`` at the other leaves.
    """
    return None if step is None else _VIEW_STEPS.get(step)


class _Plan(NamedTuple):
    """Component positions run as lists, then the tail rule over the rest (``fused``: the
    tail's kernel, for the rules that run one)."""

    head: list[int]
    tail: list[int]
    rule: str
    fused: FusedTail | None = None


def _lists(tx: Any) -> ListTransform:
    lists: ListTransform = tx.lists
    return lists


def _is_lr(lists: ListTransform) -> bool:
    """A descent learning rate: ``scale`` by a non-positive constant, or a schedule."""
    if lists.key == "scale_by_schedule":
        return True
    if lists.key != "scale":
        return False
    factor = lists.hyper["step_size"]
    if isinstance(factor, Tensor):
        if torch._C._functorch.is_functorch_wrapped_tensor(factor) or factor.requires_grad:
            return False  # a traced or differentiable rate: no fused kernel takes it
        return factor.numel() == 1 and float(factor) <= 0
    return float(factor) <= 0


def _decay(lists: ListTransform) -> ListTransform | None:
    """The ``add_decayed_weights`` (float decay) that ``lists`` is, or masks; else None."""
    if lists.key == "masked":
        lists = lists.hyper["inner"]
    if lists.key == "add_decayed_weights" and not isinstance(lists.hyper["weight_decay"], Tensor):
        return lists
    return None


def _decay_split(
    txs: list[ListTransform], view: LeafView
) -> tuple[float, list[int] | None, list[int]]:
    """``(weight_decay, decayed positions, the other positions)`` of a tail; ``None`` for
    "every position" (an unmasked decay, or none: weight decay 0)."""
    if len(txs) < 2 or _decay(txs[-2]) is None:
        return 0.0, None, []
    wd_lists = txs[-2]
    decay = _decay(wd_lists)
    assert decay is not None
    wd = float(decay.hyper["weight_decay"])
    if wd_lists.key != "masked":
        return wd, None, []
    decayed = wd_lists.hyper["positions"](view)
    chosen = set(decayed)
    return wd, decayed, [j for j in range(len(view.idx)) if j not in chosen]


#: Any other chain: gradients shaped like their params, on their devices; the list maths
#: take sparse gradients or other dtypes where their ``_foreach`` ops do.
_CHAIN_RULES = GradRules("chain", sparse="accept", promotes=True)


def _run_lr(call: TailCall) -> None:
    args = [list(call.view.params), call.updates, call.decays(), call.lr, call.weight_decay]
    run_kernel(tail_kernels.lr_only, args, tail_kernels.LR_ROLES)


#: ``[add_decayed_weights(wd)], <learning rate>`` after any head: the chain's own tail.
_LR_TAIL = FusedTail("lr", _CHAIN_RULES, lambda hyper: [], (), _run_lr)


def check_tail(
    fused: FusedTail | None,
    hyper: Mapping[str, Any],
    state: Any,
    view: LeafView,
    grads: list[Tensor],
) -> None:
    """Check a step's gradients and the state its tail's kernel reads, before anything is
    written (see :func:`functional_optim._step_checks.check_step`).

    Args:
        fused: the plan's tail kernel (None: the gradients only, with the chain's rules).
        hyper: the hyperparameters of the tail's first component (whose state it reads).
        state: that component's state.
        view: the step's leaf view.
        grads: the gradients at the view's positions.

    Raises:
        RuntimeError: torch's errors (see :func:`functional_optim._step_checks.check_step`).
    """
    if fused is None:
        CHECKER(_CHAIN_RULES, view.params, grads)
        return
    names = fused.buffers(hyper)
    buffers: list[Buffer] = [(n, "param", view.gather(getattr(state, f))) for n, f in names]
    if "count" in fused.written:
        buffers.append(("step", "scalar", view.gather(state.count)))
    CHECKER(fused.rules, view.params, grads, buffers)


def plan_tail(transforms: Sequence[Any]) -> _Plan:
    """Split the (non-no-op) components into a list-run head and a fused tail (see above)."""
    live = [i for i, tx in enumerate(transforms) if _lists(tx).key != "identity"]
    if live and transforms[live[-1]].step is not None:
        return _Plan(live[:-1], live[-1:], "step")
    keys = [_lists(transforms[i]) for i in live]
    if len(live) >= 2 and _is_lr(keys[-1]):
        before = live[:-1]
        wd = bool(before) and _decay(_lists(transforms[before[-1]])) is not None
        core = before[:-1] if wd else before
        fused = _lists(transforms[core[-1]]).tail if core else None
        if fused is not None:
            tail = [*core[-1:], *before[len(core) :], live[-1]]
            return _Plan(core[:-1], tail, fused.name, fused)
        return _Plan(core, [*before[len(core) :], live[-1]], "lr", _LR_TAIL)
    return _Plan(live, [], "add")


def _learning_rate(lists: ListTransform, state: Any) -> float:
    """The step's learning rate (``-factor``); a schedule's count is incremented in place."""
    if lists.key == "scale_by_schedule":
        factor = lists.hyper["schedule"](state.count)
        state.count.add_(1)
    else:
        factor = lists.hyper["step_size"]
    return -float(factor)


def _run_tail(
    plan: _Plan, view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    """The tail's kernel: the learning rate and the decay read here, the rest by the tail."""
    assert plan.fused is not None
    lr = _learning_rate(txs[-1], states[-1])
    wd, decayed, _ = _decay_split(txs, view)
    plan.fused.run(TailCall(view, updates, txs[0].hyper, states[0], lr, wd, decayed))


def chain_step(transforms: Sequence[Any]) -> StepFn:
    """Build the in-place ``step(params, grads, state)`` of ``chain(*transforms)``.

    Args:
        transforms: the chain's components, every one with ``lists``.

    Returns:
        The step; it updates params and state buffers in place and returns the state.
    """
    planned: list[_Plan] = []  # planned at the first step, so building a chain reads nothing

    def step_on(params: PyTree, view: LeafView, state: OptState) -> OptState:
        if not planned:
            planned.append(plan_tail(transforms))
        plan = planned[0]
        head = [(i, _lists(transforms[i]).apply) for i in plan.head]
        tail_lists = [_lists(transforms[i]) for i in plan.tail]
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of length {len(state)}; "
                "pass the state returned by this chain's init/update"
            )
        new_state = list(state)
        updates = view.grads
        first = plan.tail[0] if plan.tail else None
        hyper = {} if first is None else tail_lists[0].hyper
        check_tail(plan.fused, hyper, None if first is None else state[first], view, updates)
        with torch.no_grad():
            for i, apply in head:
                updates, new_state[i] = apply(updates, new_state[i], view)
            if plan.rule == "step":
                i = plan.tail[0]
                full = view.spec.unflatten(view.full(updates))
                new_state[i] = transforms[i].step(params, full, new_state[i])
            elif not updates:
                for i in plan.tail:  # a schedule counts steps, as update() does
                    if _lists(transforms[i]).key == "scale_by_schedule":
                        new_state[i].count.add_(1)
            elif plan.fused is not None:
                tail_states = [new_state[i] for i in plan.tail]
                _run_tail(plan, view, updates, tail_lists, tail_states)
            else:
                torch._foreach_add_(view.params, updates)
        return tuple(new_state)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        return step_on(params, LeafView(params, grads), state)

    _VIEW_STEPS[step] = step_on
    return step
