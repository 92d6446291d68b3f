"""The table of algorithms, one entry per torch.optim algorithm: where a new one is listed.

Each :class:`Algorithm` names the torch class it mirrors and every layer that implements it:
the kernel and its argument order, the state transform and its state type (with torch's
per-param state keys), the alias (hand-written, or generated from its declared hyperparameters,
:class:`Hyperparam`, and a ``chain`` builder) and, when its update is TorchScript-able, the
``FunctionalX`` class. From :data:`ALGORITHMS`:

* every alias's fused ``step`` runs the declared kernel arguments
  (:mod:`functional_optim._aliases._kernel_step`; a hand-written alias's builder returns
  ``ENTRY.fused(chain, ...)``, its entry declared beside it);
* ``functional_optim._torch_state`` takes torch's state names (``state_names``);
* ``compat_api.utils.functional_optim_map`` maps ``torch.optim.<torch_name>`` to ``functional``
  (``on_algorithm_registered``);
* the parity tests (tests/functional_optim/_alias_registry.py) run every entry against torch
  and draw every hyperparameter of ``alias`` with Hypothesis.

Adding an algorithm: write the kernel (``kernels/x.py``) and, if none fits, the transform
(``_transforms``); write one entry beside its alias (``_aliases/<family>.py``) and list it in
:data:`BUILTIN_ALGORITHMS`; then
import its parts in the package ``__init__`` (and the kernel in ``kernels/__init__``, the
``FunctionalX`` class in ``functional/__init__``): the exports are static, and
tests/functional_optim/test_registry.py fails for a part that is not exported.
``register_algorithm`` adds one at run time (:mod:`functional_optim._registration`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

from functional_optim._algorithm import Algorithm, Hyperparam
from functional_optim._aliases.adafactor import ADAFACTOR
from functional_optim._aliases.adam import ADAM, ADAMW
from functional_optim._aliases.adam_variants import NADAM, RADAM
from functional_optim._aliases.adaptive import ADADELTA, ADAGRAD, ADAMAX
from functional_optim._aliases.asgd import ASGD
from functional_optim._aliases.lbfgs import LBFGS
from functional_optim._aliases.muon import MUON
from functional_optim._aliases.rms import RMSPROP, RPROP
from functional_optim._aliases.sgd import SGD
from functional_optim._aliases.sparse_adam import SPARSE_ADAM

__all__ = [
    "ALGORITHMS",
    "BUILTIN_ALGORITHMS",
    "BY_NAME",
    "TORCH_STATE_NAMES",
    "Algorithm",
    "AlgorithmTable",
    "Hyperparam",
    "add",
    "by_torch_name",
    "merged_state_names",
    "remove",
    "torch_state_names",
]


#: The algorithms the package ships; torch's eight first, in the order of torch's
#: ``functional_optim_map``.
BUILTIN_ALGORITHMS: tuple[Algorithm, ...] = (
    ADAGRAD,
    ADAM,
    ADAMW,
    SGD,
    ADADELTA,
    RMSPROP,
    RPROP,
    ADAMAX,
    NADAM,
    RADAM,
    ASGD,
    ADAFACTOR,
    MUON,
    SPARSE_ADAM,
    LBFGS,
)


class AlgorithmTable(Sequence[Algorithm]):
    """The registered algorithms in order: the built-in ones, then those added at run time.

    A read-only, live view: there is one table for the whole run, so ``fo.ALGORITHMS`` is bound
    once (statically, in the package ``__init__``) and still lists an algorithm added later by
    ``register_algorithm``. Only :func:`add` and :func:`remove` change it. Take ``tuple(table)``
    for a snapshot.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: Iterable[Algorithm]) -> None:
        self._entries: list[Algorithm] = list(entries)

    @overload
    def __getitem__(self, index: int) -> Algorithm: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Algorithm, ...]: ...

    def __getitem__(self, index: int | slice) -> Algorithm | tuple[Algorithm, ...]:
        if isinstance(index, slice):
            return tuple(self._entries[index])
        return self._entries[index]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Algorithm]:
        return iter(tuple(self._entries))

    def __repr__(self) -> str:
        return f"AlgorithmTable({[a.name for a in self._entries]})"


#: Every registered algorithm (:data:`BUILTIN_ALGORITHMS`, then the run-time ones).
ALGORITHMS: AlgorithmTable = AlgorithmTable(BUILTIN_ALGORITHMS)

#: The entries by alias name.
BY_NAME: dict[str, Algorithm] = {a.name: a for a in ALGORITHMS}


def by_torch_name(torch_name: str) -> Algorithm:
    """Return the entry for ``torch.optim.<torch_name>``.

    Raises:
        KeyError: if no entry mirrors that class.
    """
    for algorithm in ALGORITHMS:
        if algorithm.torch_name == torch_name:
            return algorithm
    raise KeyError(f"no functional_optim algorithm mirrors torch.optim.{torch_name}")


def merged_state_names(algorithms: Iterable[Algorithm]) -> dict[type, dict[str, str]]:
    """State type -> (field -> torch's per-param state key), merged over ``algorithms``.

    Raises:
        ValueError: if two entries give one state type different names.
    """
    merged: dict[type, dict[str, str]] = {}
    for algorithm in algorithms:
        for state_type, names in algorithm.state_names.items():
            known = merged.setdefault(state_type, dict(names))
            if known != dict(names):
                raise ValueError(
                    f"{algorithm.name}: torch state names of {state_type.__name__} conflict "
                    f"with another entry ({names} vs {known})"
                )
    return merged


def torch_state_names() -> dict[type, dict[str, str]]:
    """:func:`merged_state_names` over every registered entry."""
    return merged_state_names(ALGORITHMS)


#: The merged state names of the registered entries, kept current by :func:`add` and
#: :func:`remove`; ``_torch_state`` reads it.
TORCH_STATE_NAMES: dict[type, dict[str, str]] = torch_state_names()


def _refresh_state_names() -> None:
    TORCH_STATE_NAMES.clear()
    TORCH_STATE_NAMES.update(torch_state_names())


def add(algorithm: Algorithm) -> None:
    """Append ``algorithm`` to every table built from the registry (no checks: see
    ``_registration.register_algorithm``, which checks first)."""
    ALGORITHMS._entries.append(algorithm)
    BY_NAME[algorithm.name] = algorithm
    _refresh_state_names()


def remove(algorithm: Algorithm) -> None:
    """Undo :func:`add`."""
    ALGORITHMS._entries.remove(algorithm)
    BY_NAME.pop(algorithm.name, None)
    _refresh_state_names()
