"""Exports and run-time registration driven by the algorithm registry.

:func:`publish_all` (run by the package ``__init__``) exports every entry's alias, transform,
state type, kernel and ``FunctionalX`` class, so an entry added to
``functional_optim._registry.ALGORITHMS`` needs no edit of an ``__init__`` file.
:func:`register_algorithm` adds an entry at run time (a plugin, a test) with the same effect, and
tells the listeners (``compat_api``'s ``functional_optim_map``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType

from functional_optim import _registry, kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._kernel_step import SPECS

__all__ = [
    "on_algorithm_registered",
    "publish_all",
    "register_algorithm",
    "unregister_algorithm",
]

#: ``listener(algorithm, added)``: called when an algorithm is registered or unregistered.
Listener = Callable[[Algorithm, bool], None]
_LISTENERS: list[Listener] = []
_ADDED: set[str] = set()


def _targets(algorithm: Algorithm) -> list[tuple[ModuleType, dict[str, object]]]:
    """(module, name -> object) for every export of an entry."""
    package = sys.modules["functional_optim"]
    parts = (algorithm.alias, algorithm.transform, algorithm.state_type, algorithm.functional)
    out: list[tuple[ModuleType, dict[str, object]]] = [
        (package, {part.__name__: part for part in parts if part is not None})
    ]
    if algorithm.kernel is not None:
        out.append((kernels, {algorithm.kernel.__name__: algorithm.kernel}))
    if algorithm.functional is not None:
        functional = sys.modules["functional_optim.functional"]
        out.append((functional, {algorithm.functional.__name__: algorithm.functional}))
    return out


def _publish(algorithm: Algorithm) -> None:
    """Export an entry's parts; names already bound to the same object are left alone.

    Raises:
        ValueError: if a name is bound to another object (nothing is changed then).
    """
    targets = _targets(algorithm)
    for module, names in targets:
        for name, obj in names.items():
            known = getattr(module, name, obj)
            # a kernel's submodule shares its function's name until the function is bound
            if known is not obj and not isinstance(known, ModuleType):
                raise ValueError(f"{algorithm.name}: {module.__name__}.{name} is already taken")
    for module, names in targets:
        exported: list[str] = module.__all__
        for name, obj in names.items():
            setattr(module, name, obj)
            if name not in exported:
                exported.append(name)
        exported.sort()


def publish_all() -> None:
    """Export every registered entry's parts (idempotent)."""
    for algorithm in _registry.ALGORITHMS:
        _publish(algorithm)


def _set_algorithms(algorithms: tuple[Algorithm, ...]) -> None:
    _registry.ALGORITHMS = algorithms
    setattr(sys.modules["functional_optim"], "ALGORITHMS", algorithms)  # noqa: B010
    _registry.TORCH_STATE_NAMES.clear()
    _registry.TORCH_STATE_NAMES.update(_registry.torch_state_names())


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add an algorithm at run time, as if its entry were in ``ALGORITHMS``.

    Its alias gets the fused ``step`` of its kernel, its state converts to and from torch's
    state dicts, its parts are exported from ``functional_optim`` and the listeners
    (``compat_api``'s ``functional_optim_map``) hear of it.

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
    spec = algorithm.kernel_spec  # checks the kernel arguments
    _registry.merged_state_names((*_registry.ALGORITHMS, algorithm))  # checks for conflicts
    _publish(algorithm)
    _ADDED.add(algorithm.name)
    _registry.BY_NAME[algorithm.name] = algorithm
    if spec is not None:
        SPECS[algorithm.name] = spec
    _set_algorithms((*_registry.ALGORITHMS, algorithm))
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
    _ADDED.discard(name)
    algorithm = _registry.BY_NAME.pop(name)
    SPECS.pop(name, None)
    _set_algorithms(tuple(a for a in _registry.ALGORITHMS if a is not algorithm))
    for module, names in _targets(algorithm):
        for export in names:
            if export in module.__all__:
                module.__all__.remove(export)
                delattr(module, export)
    for listener in _LISTENERS:
        listener(algorithm, False)


def on_algorithm_registered(listener: Listener) -> None:
    """Call ``listener(algorithm, True)`` for every algorithm now and for each one registered
    later, and ``listener(algorithm, False)`` for each one unregistered.

    Args:
        listener: the callback (``compat_api.utils`` keeps ``functional_optim_map`` with it).
    """
    _LISTENERS.append(listener)
    for algorithm in _registry.ALGORITHMS:
        listener(algorithm, True)
