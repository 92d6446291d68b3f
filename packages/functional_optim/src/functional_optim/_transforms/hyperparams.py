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
from functional_optim._recipes import record
from functional_optim._tree import PyTree

__all__ = [
    "InjectHyperparamsState",
    "inject_hyperparams",
    "injected_inner",
    "injected_nodes",
    "replace_injected",
]

Builder = Callable[[dict[str, Any]], tuple[GradientTransformation, "list[dict[str, Any]] | None"]]

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


def injected_nodes(state: OptState) -> list[InjectHyperparamsState]:
    """The outermost injected states of ``state`` in tree order (``[state]`` when ``state``
    is itself injected).

    Walks tuples, NamedTuples, lists and dicts; does not look inside an injected state.
    """
    out: list[InjectHyperparamsState] = []

    def walk(node: Any) -> None:
        if isinstance(node, InjectHyperparamsState):
            out.append(node)
        elif isinstance(node, (tuple, list)):
            for child in node:
                walk(child)
        elif isinstance(node, dict):
            for child in node.values():
                walk(child)

    walk(state)
    return out


def replace_injected(state: OptState, new: list[dict[str, Any]]) -> OptState:
    """``state`` with the hyperparams of its outermost injected states (in the order of
    :func:`injected_nodes`) replaced by ``new``; unchanged nodes are kept as they are."""
    values = iter(new)

    def rebuild(node: Any) -> Any:
        if isinstance(node, InjectHyperparamsState):
            hyper = next(values)
            same = hyper.keys() == node.hyperparams.keys() and all(
                node.hyperparams[k] is v for k, v in hyper.items()
            )
            return node if same else node._replace(hyperparams=dict(hyper))
        if isinstance(node, tuple):
            children = [rebuild(c) for c in node]
            if all(a is b for a, b in zip(children, node, strict=True)):
                return node
            return type(node)(*children) if hasattr(node, "_fields") else tuple(children)
        if isinstance(node, list):
            return [rebuild(c) for c in node]
        if isinstance(node, dict):
            return {k: rebuild(v) for k, v in node.items()}
        return node

    return rebuild(state)


def _forward(template: list[dict[str, Any]] | None, inner: OptState) -> OptState:
    """Give the injected states nested in ``inner`` the hyperparams that the factory put in
    the transform it just built (``template``: those of ``built.init([])``), so a changed
    outer hyperparameter reaches an alias built inside the factory (e.g.
    ``inject_hyperparams(lambda lr: chain(clip, adamw(lr=lr)))``)."""
    if not template or len(injected_nodes(inner)) != len(template):
        return inner  # none nested, or a structure that depends on the params (kept as is)
    return replace_injected(inner, template)


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
        Built = tuple[GradientTransformation, list[dict[str, Any]] | None]
        base = factory(**static, **hyper)
        # the injected transforms the factory builds inside (an alias in a chain), if any
        deep = bool(injected_nodes(base.init([])))
        cache: dict[Hashable, Built] = {}

        def built(values: dict[str, Any]) -> Built:
            """The transform at ``values`` and, when it holds injected transforms, their
            hyperparams as it built them (see :func:`_forward`)."""
            key = _cache_key(values)
            if key is not None and key in cache:
                return cache[key]
            tx = base if values is hyper else factory(**static, **values)
            nested = [dict(n.hyperparams) for n in injected_nodes(tx.init([]))] if deep else None
            if key is not None:
                cache.clear()
                cache[key] = (tx, nested)
            return tx, nested

        built(hyper)  # seeds the cache with the first build

        def init(params: PyTree) -> InjectHyperparamsState:
            return InjectHyperparamsState(dict(hyper), base.init(params))

        def update(
            updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
        ) -> tuple[PyTree, OptState]:
            tx, nested = built(state.hyperparams)
            inner = _forward(nested, state.inner_state)
            updates, inner = tx.update(updates, inner, params, inplace=inplace)
            return updates, InjectHyperparamsState(state.hyperparams, inner)

        def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
            tx, nested = built(state.hyperparams)
            assert tx.step is not None
            inner = tx.step(params, grads, _forward(nested, state.inner_state))
            return InjectHyperparamsState(state.hyperparams, inner)

        def apply(
            updates: list[Tensor], state: OptState, view: LeafView
        ) -> tuple[list[Tensor], OptState]:
            tx, nested = built(state.hyperparams)
            assert tx.lists is not None
            inner_lists = tx.lists
            inner = _forward(nested, state.inner_state)
            updates, inner = inner_lists.apply(updates, inner, view)
            return updates, InjectHyperparamsState(state.hyperparams, inner)

        _BUILDERS[init] = built
        fused: StepFn | None = step if base.step is not None else None
        lists = None
        if base.lists is not None:
            writes = base.lists.writes_updates
            lists = ListTransform("inject_hyperparams", hyper, apply, writes)
        injected = GradientTransformation(init, update, fused, lists)
        record(injected, _injected_call, (factory, tuple(sorted(static_names)), *args), given)
        return injected

    return wrapped


def _injected_call(
    factory: Callable[..., GradientTransformation],
    static_args: tuple[str, ...],
    *args: Any,
    **kwargs: Any,
) -> GradientTransformation:
    """``inject_hyperparams(factory, static_args)(*args, **kwargs)`` (how an injected
    transform is pickled)."""
    return inject_hyperparams(factory, static_args)(*args, **kwargs)


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
    found = _BUILDERS.get(tx.init)
    if found is None or not isinstance(state, InjectHyperparamsState):
        return None
    inner_tx, nested = found(state.hyperparams)
    return inner_tx, _forward(nested, state.inner_state)
