"""How a ``GradientTransformation`` is pickled: by the factory call that built it.

A transform is a tuple of closures, which ``pickle`` cannot store. Every public factory is
decorated with :func:`transform_factory`, which records ``(factory, args, kwargs)`` for the
transform it returns (weakly); pickling the transform stores
that call and unpickling makes it again. The key is the transform's ``update`` function, a
closure made by each factory call (``init`` is not: stateless transforms share one). The
outermost recorded call wins, so an alias is
stored as the alias call, not as the chain inside it. ``copy.deepcopy`` shares the transform
(transforms are immutable; their state is separate).
"""

from __future__ import annotations

import functools
import pickle
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["recipe_of", "record", "remake", "transform_factory"]

F = TypeVar("F", bound=Callable[..., Any])

Recipe = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]

#: a transform's ``update`` -> its ``init`` and the call that made the transform
_RECIPES: weakref.WeakKeyDictionary[Callable[..., Any], tuple[Callable[..., Any], Recipe]] = (
    weakref.WeakKeyDictionary()
)


def record(tx: Any, factory: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> None:
    """Remember that ``factory(*args, **kwargs)`` made ``tx`` (not while torch.compile traces:
    a transform built there is not one a user pickles)."""
    if torch.compiler.is_compiling():
        return
    _RECIPES[tx.update] = (tx.init, (factory, tuple(args), dict(kwargs)))


def recipe_of(tx: Any) -> Recipe:
    """The call that made ``tx``.

    Raises:
        pickle.PicklingError: ``tx`` was not made by a recorded factory.
    """
    found = _RECIPES.get(tx.update)
    if found is None or found[0] is not tx.init:
        raise pickle.PicklingError(
            "cannot pickle this GradientTransformation: it was not made by a functional_optim "
            "factory; decorate your factory with functional_optim.transform_factory so that "
            "it can be made again from its arguments"
        )
    return found[1]


def remake(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call ``factory`` (the unpickling side of :func:`recipe_of`)."""
    return factory(*args, **kwargs)


def transform_factory(factory: F) -> F:
    """Decorate a function returning a ``GradientTransformation`` so that what it returns can
    be pickled (it is stored as this call and made again when loaded).

    The function must be importable by its module and qualified name (defined at module
    level), and its arguments picklable.

    Args:
        factory: the function.

    Returns:
        The recording function (same name, signature and docstring).
    """

    @functools.wraps(factory)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        tx = factory(*args, **kwargs)
        record(tx, recorded, args, kwargs)
        return tx

    return recorded  # type: ignore[return-value]
