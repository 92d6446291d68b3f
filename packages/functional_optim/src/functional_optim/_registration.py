"""Adding and removing algorithms at run time (:func:`register_algorithm`).

The package's exports are static: ``functional_optim/__init__.py`` imports every part of every
built-in entry (``_registry.BUILTIN_ALGORITHMS``), so type checkers and IDEs see them, and no
function writes into a module's namespace. An algorithm registered at run time (a plugin, a
test) joins the registry tables (``fo.ALGORITHMS``, torch's state names, the fused steps) and
the listeners (``compat_api``'s ``functional_optim_map``) hear of it; its alias, transform,
state type and ``FunctionalX`` class are then reachable as ``fo.<name>`` through ONE explicit
dynamic path: the package's module ``__getattr__``, which asks :func:`runtime_export`. They are
not added to ``fo.__all__`` (the static surface) nor to ``fo.kernels`` / ``fo.functional``: the
entry itself (``fo.ALGORITHMS``) holds its kernel and ``FunctionalX`` class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from functional_optim import _registry
from functional_optim._algorithm import Algorithm

__all__ = [
    "on_algorithm_registered",
    "register_algorithm",
    "runtime_export",
    "runtime_export_names",
    "unregister_algorithm",
]

#: ``listener(algorithm, added)``: called when an algorithm is registered or unregistered.
Listener = Callable[[Algorithm, bool], None]
_LISTENERS: list[Listener] = []
#: The algorithms added by :func:`register_algorithm`, by name.
_ADDED: dict[str, Algorithm] = {}
#: ``fo.<name>`` -> object for the parts of the algorithms added at run time (names the
#: package binds statically to the same object are left out).
_EXPORTS: dict[str, object] = {}


def _parts(algorithm: Algorithm) -> dict[str, object]:
    """The parts an entry exports from the package, by name."""
    parts = (algorithm.alias, algorithm.transform, algorithm.state_type, algorithm.functional)
    return {part.__name__: part for part in parts if part is not None}


def _new_exports(algorithm: Algorithm) -> dict[str, object]:
    """The run-time exports ``algorithm`` adds.

    Raises:
        ValueError: if one of its names is bound to another object, statically or by another
            run-time algorithm.
    """
    static = vars(importlib.import_module("functional_optim"))
    new: dict[str, object] = {}
    for name, obj in _parts(algorithm).items():
        known = static.get(name, _EXPORTS.get(name, obj))
        if known is not obj:
            raise ValueError(f"{algorithm.name}: functional_optim.{name} is already taken")
        if name not in static:
            new[name] = obj
    return new


def runtime_export(name: str) -> object:
    """The part of a run-time algorithm exported as ``fo.<name>`` (the package's
    ``__getattr__``).

    Raises:
        AttributeError: if no algorithm registered at run time exports ``name``.
    """
    try:
        return _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'functional_optim' has no attribute {name!r}") from None


def runtime_export_names() -> list[str]:
    """The names :func:`runtime_export` answers, sorted (the package's ``__dir__`` adds them)."""
    return sorted(_EXPORTS)


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm at run time, as if its entry were in ``BUILTIN_ALGORITHMS``.

    Its alias gets the fused ``step`` of its kernel, its state converts to and from torch's
    state dicts, it joins ``fo.ALGORITHMS``, its alias, transform, state type and
    ``FunctionalX`` class are reachable as ``fo.<name>`` (the package's ``__getattr__``; they
    stay out of ``fo.__all__``) and the listeners (``compat_api``'s ``functional_optim_map``)
    hear of it.

    Args:
        algorithm: the entry.

    Returns:
        ``algorithm``.

    Raises:
        ValueError: if its name or torch name is taken, its torch state names conflict with
            another entry's, its kernel arguments do not match its kernel, or a name it would
            export is taken; nothing is changed then.
    """
    if algorithm.name in _registry.BY_NAME or any(
        a.torch_name == algorithm.torch_name for a in _registry.ALGORITHMS
    ):
        raise ValueError(
            f"an algorithm named {algorithm.name!r} or mirroring torch.optim."
            f"{algorithm.torch_name} is already registered"
        )
    _ = algorithm.kernel_spec  # checks the kernel arguments
    _registry.merged_state_names((*_registry.ALGORITHMS, algorithm))  # checks for conflicts
    exports = _new_exports(algorithm)
    _EXPORTS.update(exports)
    _ADDED[algorithm.name] = algorithm
    _registry.add(algorithm)
    for listener in _LISTENERS:
        listener(algorithm, True)
    return algorithm


def unregister_algorithm(name: str) -> None:
    """Remove an algorithm added by :func:`register_algorithm`, its exports included.

    Raises:
        KeyError: if ``name`` was not added by :func:`register_algorithm` (the built-in
            entries stay).
    """
    if name not in _ADDED:
        raise KeyError(f"{name!r} was not added by register_algorithm")
    algorithm = _ADDED.pop(name)
    _registry.remove(algorithm)
    for export, obj in _parts(algorithm).items():
        if _EXPORTS.get(export) is obj and not _still_exported(export, obj):
            del _EXPORTS[export]
    for listener in _LISTENERS:
        listener(algorithm, False)


def _still_exported(name: str, obj: object) -> bool:
    """Whether another run-time algorithm still exports ``obj`` as ``name`` (two entries may
    share a transform)."""
    return any(_parts(a).get(name) is obj for a in _ADDED.values())


def on_algorithm_registered(listener: Listener) -> None:
    """Call ``listener(algorithm, True)`` for every algorithm now and for each one registered
    later, and ``listener(algorithm, False)`` for each one unregistered.

    Args:
        listener: the callback (``compat_api.utils`` keeps ``functional_optim_map`` with it).
    """
    _LISTENERS.append(listener)
    for algorithm in _registry.ALGORITHMS:
        listener(algorithm, True)
