"""``inject_hyperparams``: keep a transform's hyperparameters in its state so they can change.

This is how ``functional_optim.Optimizer`` exposes ``lr`` (and the other hyperparameters) in its
``param_groups``: every alias is built through it, the optimizer copies each group's values into
the state before a step, so ``torch.optim.lr_scheduler`` schedulers drive the transform.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple

from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, StepFn
from functional_optim._lists import LeafView, ListTransform
from functional_optim._tree import PyTree

__all__ = ["InjectHyperparamsState", "inject_hyperparams", "injected_inner"]

Builder = Callable[[dict[str, Any]], GradientTransformation]

#: an injected transform's ``init`` -> its ``build(hyperparams)`` (read by :func:`injected_inner`)
_BUILDERS: weakref.WeakKeyDictionary[Callable[..., Any], Builder] = weakref.WeakKeyDictionary()


class InjectHyperparamsState(NamedTuple):
    """State of an injected transform: its current hyperparameters and the inner state."""

    hyperparams: dict[str, Any]
    inner_state: OptState


def _cache_key(hyperparams: dict[str, Any]) -> Hashable | None:
    items = tuple(sorted(hyperparams.items()))
    for _, v in items:
        if isinstance(v, Tensor) or (
            isinstance(v, tuple) and any(isinstance(x, Tensor) for x in v)
        ):
            return None
    try:
        hash(items)
    except TypeError:
        return None
    return items


def _forward(hyperparams: dict[str, Any], inner: OptState) -> OptState:
    """Pass the values down when the factory itself returns an injected transform (an alias)."""
    if not isinstance(inner, InjectHyperparamsState):
        return inner
    shared = {k: v for k, v in hyperparams.items() if k in inner.hyperparams}
    if all(inner.hyperparams[k] is v for k, v in shared.items()):
        return inner
    return inner._replace(hyperparams={**inner.hyperparams, **shared})


def _bind(
    factory: Callable[..., GradientTransformation], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """All arguments of a call by name, defaults included (a ``**kwargs`` factory: as given)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        signature = None
    variadic = signature is None or any(
        p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()
    )
    if variadic:
        if args:
            raise TypeError(
                f"inject_hyperparams({getattr(factory, '__name__', factory)}): pass the "
                "hyperparameters by keyword"
            )
        return dict(kwargs)
    assert signature is not None
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_static(factory: Callable[..., GradientTransformation], static: set[str]) -> None:
    if not static:
        return
    names = set(inspect.signature(factory).parameters)
    if not static <= names:
        raise ValueError(
            f"static_args {sorted(static - names)} are not parameters of "
            f"{getattr(factory, '__name__', factory)} (parameters: {sorted(names)})"
        )


def inject_hyperparams(
    factory: Callable[..., GradientTransformation],
    static_args: str | Iterable[str] = (),
) -> Callable[..., GradientTransformation]:
    """Wrap ``factory`` so that its non-callable arguments live in the state.

    ``inject_hyperparams(fo.adam)(lr=1e-3)`` behaves like ``fo.adam(lr=1e-3)`` but its state is
    ``InjectHyperparamsState(hyperparams={"lr": 1e-3, ...}, inner_state=...)``; replacing a value
    in ``state.hyperparams`` changes the next update. Callable arguments (schedules) and the
    ``static_args`` stay fixed. Every numeric hyperparameter can be injected: arguments may be
    passed by position, and the factory's defaults are stored too (e.g.
    ``inject_hyperparams(fo.scale_by_lion)(b1=0.5)`` also stores ``b2``). The inner transform is
    rebuilt from the hyperparameters (validated by ``factory``) when they change; tensor
    hyperparameters (e.g. a differentiable ``lr``) are used as given.

    Args:
        factory: a function returning a ``GradientTransformation``.
        static_args: names of arguments kept out of the state (e.g. a mask pytree).

    Returns:
        A function taking the same keyword arguments and returning the injected transform; it
        calls ``factory`` once right away, so bad arguments raise at construction.
    """

    static_names = {static_args} if isinstance(static_args, str) else set(static_args)
    _check_static(factory, static_names)

    def wrapped(*args: Any, **given: Any) -> GradientTransformation:
        kwargs = _bind(factory, args, given)
        hyper = {k: v for k, v in kwargs.items() if not callable(v) and k not in static_names}
        static = {k: v for k, v in kwargs.items() if callable(v) or k in static_names}
        cache: dict[Hashable, GradientTransformation] = {}

        def build(values: dict[str, Any]) -> GradientTransformation:
            key = _cache_key(values)
            if key is not None and key in cache:
                return cache[key]
            tx = factory(**static, **values)
            if key is not None:
                cache.clear()
                cache[key] = tx
            return tx

        base = build(hyper)

        def init(params: PyTree) -> InjectHyperparamsState:
            return InjectHyperparamsState(dict(hyper), base.init(params))

        def update(
            updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
        ) -> tuple[PyTree, OptState]:
            tx = build(state.hyperparams)
            inner = _forward(state.hyperparams, state.inner_state)
            updates, inner = tx.update(updates, inner, params, inplace=inplace)
            return updates, InjectHyperparamsState(state.hyperparams, inner)

        def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
            inner_step = build(state.hyperparams).step
            assert inner_step is not None
            inner = inner_step(params, grads, _forward(state.hyperparams, state.inner_state))
            return InjectHyperparamsState(state.hyperparams, inner)

        def apply(
            updates: list[Tensor], state: OptState, view: LeafView
        ) -> tuple[list[Tensor], OptState]:
            inner_lists = build(state.hyperparams).lists
            assert inner_lists is not None
            inner = _forward(state.hyperparams, state.inner_state)
            updates, inner = inner_lists.apply(updates, inner, view)
            return updates, InjectHyperparamsState(state.hyperparams, inner)

        _BUILDERS[init] = build
        fused: StepFn | None = step if base.step is not None else None
        lists = None
        if base.lists is not None:
            writes = base.lists.writes_updates
            lists = ListTransform("inject_hyperparams", hyper, apply, writes)
        return GradientTransformation(init, update, fused, lists)

    return wrapped


def injected_inner(
    tx: GradientTransformation, state: OptState
) -> tuple[GradientTransformation, OptState] | None:
    """The inner transform and inner state of an injected ``tx`` at ``state``'s hyperparameters.

    Args:
        tx: any transform.
        state: its state.

    Returns:
        ``(inner transform, inner state)``, or None when ``tx`` is not an injected transform
        (or ``state`` is not its state).
    """
    build = _BUILDERS.get(tx.init)
    if build is None or not isinstance(state, InjectHyperparamsState):
        return None
    return build(state.hyperparams), _forward(state.hyperparams, state.inner_state)
