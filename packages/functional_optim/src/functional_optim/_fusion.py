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
   * ``scale_by_adam, [add_decayed_weights(wd)], scale(-lr)`` (or
     ``scale_by_learning_rate(lr)``, schedules included): ``kernels.adamw`` (``kernels.adam``
     without the decay), the fused kernel where torch has one;
   * ``scale_by_lion, [add_decayed_weights(wd)], scale(-lr)``: Lion in the ``lerp`` form
     (``m + (1 - b) * (g - m)`` for optax's ``(1 - b) * g + b * m``, one rounding apart), five
     ``_foreach`` calls;
   * ``scale_by_rms, [add_decayed_weights(wd)], scale(-lr)``: torch's foreach RMSprop
     (``p.addcdiv_(g, sqrt(v) + eps, value=-lr)``, the division and the step in one call);
   * ``scale_by_adamax, [add_decayed_weights(wd)], scale(-lr)``: torch's foreach Adamax
     (``p.addcdiv_(m, u, value=-lr / (1 - b1**t))``);
   * ``[add_decayed_weights(wd)], scale(-lr)``: ``p.mul_(1 - lr * wd)`` then
     ``p.add_(u, alpha=-lr)``, one ``_foreach`` call each;
   * in all of these, ``masked(add_decayed_weights(wd), mask)`` may stand for the decay: the
     leaves are split in two, as torch's two param groups (with and without weight decay);
   * otherwise ``p.add_(u)`` after the whole chain.

3. everything before the tail runs as each component's ``lists.apply``, in place.

Before anything runs, every step checks its inputs (:func:`check_tail`, through
:data:`functional_optim._step_checks.CHECKER`): gradients shaped like their params on
their devices (no meta tensors) and, for a tail rule with a kernel, the state lists that
kernel reads (:func:`check_tail`), with torch's errors for what it does not take (sparse
gradients, other dtypes). A tail that is an alias's own ``step`` checks its state itself;
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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim import _tail_kernels as tail_kernels
from functional_optim import kernels
from functional_optim._fn_types import OptState, StepFn
from functional_optim._kernel_runner import Role, run_kernel
from functional_optim._lists import LeafView, ListTransform
from functional_optim._step_checks import CHECKER, Buffer, GradRules
from functional_optim._tree import PyTree

__all__ = ["ADAM_SPARSE", "chain_step", "check_tail", "plan_tail", "view_step"]

Tail = Callable[[PyTree, LeafView, list[Tensor], list[Any]], None]
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
    """Component positions run as lists, then the tail rule over the rest."""

    head: list[int]
    tail: list[int]
    rule: str


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


#: The list transform whose maths a tail rule runs itself, by rule.
_KERNEL_RULES = {
    "scale_by_adam": "adam",
    "scale_by_lion": "lion",
    "scale_by_rms": "rms",
    "scale_by_adamax": "adamax",
}

#: torch.optim.Adam's message for a sparse gradient (AdamW, its subclass, shares it).
ADAM_SPARSE = "Adam does not support sparse gradients, please consider SparseAdam instead"

#: What each tail rule's kernel takes: the name in messages, no sparse gradients; the
#: ``_foreach`` RMSprop tail promotes other dtypes as torch's RMSprop does.
_TAIL_RULES = {
    "adam": GradRules("Adam", sparse_message=ADAM_SPARSE),
    "lion": GradRules("Lion"),
    "rms": GradRules("RMSprop", promotes=True),
    "adamax": GradRules("Adamax"),
}
#: Any other chain: gradients shaped like their params, on their devices; the list maths
#: take sparse gradients or other dtypes where their ``_foreach`` ops do.
_CHAIN_RULES = GradRules("chain", sparse="accept", promotes=True)


def _tail_buffers(rule: str, lists: ListTransform, state: Any, view: LeafView) -> list[Buffer]:
    """The state lists a tail rule's kernel reads, by torch's names."""
    hyper = lists.hyper
    if rule == "adam":
        buffers = [("exp_avg", state.mu), ("exp_avg_sq", state.nu)]
        if hyper["amsgrad"]:
            buffers.append(("max_exp_avg_sq", state.nu_max))
    elif rule == "lion":
        buffers = [("exp_avg", state.mu)]
    elif rule == "rms":
        buffers = [("square_avg", state.nu)]
        if hyper["centered"]:
            buffers.append(("grad_avg", state.mu))
    else:  # adamax
        buffers = [("exp_avg", state.mu), ("exp_inf", state.nu)]
    out: list[Buffer] = [(name, "param", view.gather(tree)) for name, tree in buffers]
    out.append(("step", "scalar", view.gather(state.count)))
    return out


def check_tail(
    rule: str, lists: ListTransform | None, state: Any, view: LeafView, grads: list[Tensor]
) -> None:
    """Check a step's gradients and the state its tail rule's kernel reads, before anything
    is written (see :func:`functional_optim._step_checks.check_step`).

    Args:
        rule: the plan's tail rule (``"adam"``, ...; any other: gradients only).
        lists: the tail's first list transform (the one whose state the kernel reads).
        state: that transform's state.
        view: the step's leaf view.
        grads: the gradients at the view's positions.

    Raises:
        RuntimeError: torch's errors (see :func:`functional_optim._step_checks.check_step`).
    """
    if rule in _TAIL_RULES:
        assert lists is not None
        buffers = _tail_buffers(rule, lists, state, view)
        CHECKER(_TAIL_RULES[rule], view.params, grads, buffers)
    else:
        CHECKER(_CHAIN_RULES, view.params, grads)


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
        kernel = _lists(transforms[core[-1]]).key if core else ""
        if kernel in _KERNEL_RULES:
            rule = _KERNEL_RULES[kernel]
            return _Plan(core[:-1], [*core[-1:], *before[len(core) :], live[-1]], rule)
        return _Plan(core, [*before[len(core) :], live[-1]], "lr")
    return _Plan(live, [], "add")


def _learning_rate(lists: ListTransform, state: Any) -> float:
    """The step's learning rate (``-factor``); a schedule's count is incremented in place."""
    if lists.key == "scale_by_schedule":
        factor = lists.hyper["schedule"](state.count)
        state.count.add_(1)
    else:
        factor = lists.hyper["step_size"]
    return -float(factor)


#: ``kernels.adam(w)``'s arguments: params, grads, mu, nu, nu_max, counts, then scalars.
_ADAM_ROLES: tuple[Role, ...] = ("write", "read", "write", "write", "write", "count", *[None] * 8)


def _adam_kernel(
    view: LeafView, updates: list[Tensor], hyper: Any, state: Any, lr: float, wd: float
) -> None:
    if not updates:
        return
    amsgrad = bool(hyper["amsgrad"])
    kernel = kernels.adamw if wd != 0.0 else kernels.adam
    args = [
        list(view.params),  # the runner refills its lists with new tensors
        updates,
        view.gather(state.mu),
        view.gather(state.nu),
        view.gather(state.nu_max) if amsgrad else [],
        view.gather(state.count),
        amsgrad,
        float(hyper["b1"]),
        float(hyper["b2"]),
        lr,
        wd,
        float(hyper["eps"]),
        False,
        "auto",
    ]
    run_kernel(kernel, args, _ADAM_ROLES)


def _adam_tail(
    view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    lr = _learning_rate(txs[-1], states[-1])
    wd, decayed, rest = _decay_split(txs, view)
    if decayed is None:
        _adam_kernel(view, updates, txs[0].hyper, states[0], lr, wd)
        return
    for positions, decay in ((decayed, wd), (rest, 0.0)):
        sub = view.subset(positions)
        _adam_kernel(sub, [updates[j] for j in positions], txs[0].hyper, states[0], lr, decay)


def _scalars(view: LeafView, txs: list[ListTransform], states: list[Any]) -> tuple[Any, ...]:
    """A tail's learning rate, weight decay and per-leaf decay flags."""
    lr = _learning_rate(txs[-1], states[-1])
    wd, decayed, _ = _decay_split(txs, view)
    decays = [decayed is None] * len(view.params)  # every step: no Python loop when unmasked
    for j in decayed or ():
        decays[j] = True
    return lr, wd, decays


def _lion_tail(
    view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    hyper, state = txs[0].hyper, states[0]
    lr, wd, decays = _scalars(view, txs, states)
    args = [list(view.params), updates, view.gather(state.mu), view.gather(state.count), decays]
    b1, b2 = float(hyper["b1"]), float(hyper["b2"])
    run_kernel(tail_kernels.lion, [*args, lr, wd, b1, b2], tail_kernels.LION_ROLES)


def _rms_tail(
    view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    hyper, state = txs[0].hyper, states[0]
    lr, wd, decays = _scalars(view, txs, states)
    centered = bool(hyper["centered"])
    mu = view.gather(state.mu) if centered else []
    args = [list(view.params), updates, view.gather(state.nu), mu, view.gather(state.count)]
    alpha, eps = float(hyper["alpha"]), float(hyper["eps"])
    run_kernel(
        tail_kernels.rms, [*args, decays, lr, wd, alpha, eps, centered], tail_kernels.RMS_ROLES
    )


def _adamax_tail(
    view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    hyper, state = txs[0].hyper, states[0]
    lr, wd, decays = _scalars(view, txs, states)
    args = [list(view.params), updates, view.gather(state.mu), view.gather(state.nu)]
    args += [view.gather(state.count), decays, lr, wd]
    b1, b2, eps = float(hyper["b1"]), float(hyper["b2"]), float(hyper["eps"])
    run_kernel(tail_kernels.adamax, [*args, b1, b2, eps], tail_kernels.ADAMAX_ROLES)


def _lr_tail(
    view: LeafView, updates: list[Tensor], txs: list[ListTransform], states: list[Any]
) -> None:
    lr, wd, decays = _scalars(view, txs, states)
    args = [list(view.params), updates, decays, lr, wd]
    run_kernel(tail_kernels.lr_only, args, tail_kernels.LR_ROLES)


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
        check_tail(
            plan.rule,
            None if first is None else tail_lists[0],
            None if first is None else state[first],
            view,
            updates,
        )
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
            else:
                tail_states = [new_state[i] for i in plan.tail]
                if plan.rule == "adam":
                    _adam_tail(view, updates, tail_lists, tail_states)
                elif plan.rule == "lion":
                    _lion_tail(view, updates, tail_lists, tail_states)
                elif plan.rule == "rms":
                    _rms_tail(view, updates, tail_lists, tail_states)
                elif plan.rule == "adamax":
                    _adamax_tail(view, updates, tail_lists, tail_states)
                elif plan.rule == "lr":
                    _lr_tail(view, updates, tail_lists, tail_states)
                else:
                    torch._foreach_add_(view.params, updates)
        return tuple(new_state)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        return step_on(params, LeafView(params, grads), state)

    _VIEW_STEPS[step] = step_on
    return step
