"""Drop-in for ``torch.distributed.algorithms.model_averaging.utils``.

Same results as torch (bitwise), faster: the flat buffer is kept between calls (see
:mod:`dist_runtime.averaging`). As in torch, averaged parameters end up as views of one flat
buffer, and ranks outside ``process_group`` return without doing anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed import ProcessGroup

from dist_runtime.averaging import average_parameters as _average_flat
from dist_runtime.averaging import params_to_average

__all__ = [
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "get_params_to_average",
]


def average_parameters(
    params: Iterator[torch.nn.Parameter] | Iterable[torch.Tensor],
    process_group: ProcessGroup | None,
) -> None:
    """Average all the given parameters in place over ``process_group``.

    Args:
        params: the parameters (every rank passes the same shapes and dtypes, in the same order).
        process_group: the group; None for the default group.

    Raises:
        ValueError: if ``params`` is empty (same type and leading words as torch's error).
    """
    _average_flat(params, process_group)


def get_params_to_average(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
) -> list[torch.Tensor]:
    """Return the parameters to average: those that have a gradient.

    Args:
        params: the parameters of a model or the parameter groups of an optimizer.

    Returns:
        The parameters whose ``.grad`` is not None, in order.

    Raises:
        NotImplementedError: for an entry that is neither a ``Parameter`` nor a dict.
    """
    return params_to_average(params)


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, torch.nn.Parameter]],
    process_group: ProcessGroup | None,
) -> None:
    """Average the parameters of a model or the parameter groups of an optimizer.

    Args:
        params: the parameters of a model or the parameter groups of an optimizer.
        process_group: the group; None for the default group.
    """
    average_parameters(get_params_to_average(params), process_group)
