"""Drop-in for ``torch.distributed.optim.utils``: the torch.optim -> functional optimizer map.

``functional_optim_map`` maps every ``torch.optim`` class that has a TorchScript functional
counterpart in :mod:`functional_optim` (its algorithm registry, ``functional_optim.ALGORITHMS``,
followed as algorithms are registered) to that class: torch's eight and the ones torch lacks.
:class:`~compat_api.optimizer.DistributedOptimizer` looks the user's optimizer class up here to
run it scripted on every worker, and ZeRO's ``overlap_with_ddp`` builds its functional optimizer
through :func:`as_functional_optim`.

Custom optimizers join with :func:`register_functional_optim` (see ``examples/qhm_optimizer.py``).
"""

from __future__ import annotations

from typing import Any

from torch import optim

import functional_optim

__all__ = ["as_functional_optim", "functional_optim_map", "register_functional_optim"]

#: ``torch.optim`` class (or any user key) -> TorchScript functional optimizer class.
functional_optim_map: dict[Any, type] = {}


def _follow_registry(algorithm: functional_optim.Algorithm, added: bool) -> None:
    """Keep :data:`functional_optim_map` in step with ``functional_optim``'s registry."""
    key = getattr(optim, algorithm.torch_name, None)
    if key is None or algorithm.functional is None:
        return
    if added:
        functional_optim_map.setdefault(key, algorithm.functional)
    elif functional_optim_map.get(key) is algorithm.functional:
        del functional_optim_map[key]


functional_optim.on_algorithm_registered(_follow_registry)


def register_functional_optim(key: Any, optim: type) -> None:
    """Add a functional optimizer to :data:`functional_optim_map` under ``key``.

    An existing entry is kept (as in torch). The key need not be a ``torch.optim.Optimizer``
    subclass, but :class:`~compat_api.optimizer.DistributedOptimizer` only finds entries keyed by
    the optimizer class it is given.

    Args:
        key: the lookup key, usually the user's ``torch.optim.Optimizer`` subclass.
        optim: a TorchScript-compatible functional optimizer class: constructed as
            ``optim(params, *args, **kwargs)``, with ``step(gradients: List[Optional[Tensor]])``.

    Example::

        >>> # xdoctest: +SKIP("illustration")
        >>> from compat_api.utils import register_functional_optim
        >>> register_functional_optim(QHM, FunctionalQHM)
    """
    if key not in functional_optim_map:
        functional_optim_map[key] = optim


def as_functional_optim(optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    """Build the functional counterpart of ``optim_cls`` with an empty parameter list.

    Args:
        optim_cls: a key of :data:`functional_optim_map`.
        args: positional hyperparameters for the functional constructor (after ``params``).
        kwargs: keyword hyperparameters.

    Returns:
        The functional optimizer, built with ``_allow_empty_param_list=True``.

    Raises:
        ValueError: if ``optim_cls`` has no functional counterpart.
    """
    try:
        functional_cls = functional_optim_map[optim_cls]
    except KeyError as e:
        raise ValueError(f"Optimizer {optim_cls} does not have a functional counterpart!") from e
    return _create_functional_optim(functional_cls, *args, **kwargs)


def _create_functional_optim(functional_optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    return functional_optim_cls([], *args, **kwargs, _allow_empty_param_list=True)
