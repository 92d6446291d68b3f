"""Hierarchical model averaging: validate a period -> group-size hierarchy, build its subgroups.

Planning (:func:`check_hierarchy`, :func:`select_period`) is pure; :func:`build_period_groups`
is the only function that talks to torch.distributed (``new_subgroups`` is a collective every
rank of the default group must enter).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "MAX_PERIOD_ONE_WARNING",
    "PERIOD_ONE_WARNING",
    "build_period_groups",
    "check_hierarchy",
    "select_period",
]

logger = logging.getLogger(__name__)

_NO_GAIN = (
    "no need to use model averaging because the communication cost "
    "of all-reducing parameters will be no less than the cost of all-reducing gradients "
    "by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case."
)
# torch's warnings, word for word, so that users' warning filters keep working.
PERIOD_ONE_WARNING = "When period is 1, " + _NO_GAIN
MAX_PERIOD_ONE_WARNING = (
    "When the maximum period in arg ``period_group_size_dict`` is 1, " + _NO_GAIN
)


def check_hierarchy(
    period_group_size_dict: Mapping[int, int] | None,
    overall_group_size: int,
    stacklevel: int = 2,
) -> list[tuple[int, int]]:
    """Validate a hierarchy the way torch does, plus the checks ``new_subgroups`` would make late.

    Warns (in torch's order, between the checks) when the largest period is 1.

    Args:
        period_group_size_dict: averaging period -> group size, lowest level first; the last
            group size must be the size of the whole group.
        overall_group_size: the size of the process group at the top of the hierarchy.
        stacklevel: ``warnings.warn`` stacklevel of the caller to blame, seen from here.

    Returns:
        The ``(period, group_size)`` levels in dict order.

    Raises:
        ValueError: for an empty dict, a non-positive first period, a last group size other than
            ``overall_group_size``, or a group size that does not divide it.
    """
    if not period_group_size_dict:
        raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
    levels = list(period_group_size_dict.items())
    if levels[0][0] <= 0:
        raise ValueError(
            "The minimum period in arg ``period_group_size_dict`` must be a positive value."
        )
    if levels[-1][0] == 1:
        warnings.warn(MAX_PERIOD_ONE_WARNING, UserWarning, stacklevel=stacklevel + 1)
    last_size = levels[-1][1]
    if last_size != overall_group_size:
        raise ValueError(
            f"The last value in arg ``period_group_size_dict`` {last_size} "
            f"must be equal to the size of arg ``process_group`` {overall_group_size}."
        )
    # new_subgroups raises these only once earlier levels' groups exist; check all levels first.
    for _, size in levels:
        if size <= 0:
            raise ValueError(f"The arg 'group_size' ({size}) must be positive")
        if size > overall_group_size:
            raise ValueError(
                f"The arg 'group_size' ({size}) must not exceed the world size "
                f"({overall_group_size})"
            )
        if overall_group_size % size != 0:
            raise ValueError(
                f"The world size ({overall_group_size}) must be divisible by 'group_size={size}'"
            )
    return levels


def build_period_groups(
    levels: Sequence[tuple[int, int]], process_group: ProcessGroup
) -> OrderedDict[int, ProcessGroup]:
    """Create the subgroup of every level (collective over the default group).

    A level whose size is the whole group uses ``process_group`` itself; any other level gets
    the subgroup of consecutive ranks (``torch.distributed.new_subgroups``) holding this rank.

    Args:
        levels: ``(period, group_size)`` pairs from :func:`check_hierarchy`.
        process_group: the group at the top of the hierarchy.

    Returns:
        period -> process group, in level order.
    """
    overall = dist.get_world_size(process_group)
    groups: OrderedDict[int, ProcessGroup] = OrderedDict()
    logger.info("Hierarchical model averaging levels:")
    for period, size in levels:
        logger.info(
            "\tgroups of %s processes average every %s steps (unless a level above does)",
            size,
            period,
        )
        if size == overall:
            groups[period] = process_group
        else:
            subgroup, _ = dist.new_subgroups(group_size=size, group=process_group)  # type: ignore[no-untyped-call]
            groups[period] = subgroup
    return groups


def select_period(step: int, periods: Sequence[int]) -> int | None:
    """The period that averages at ``step``: the last one in ``periods`` dividing ``step``.

    With periods in increasing order (the documented use) this is the largest dividing period;
    smaller levels are subsets of it, so averaging them too would be redundant.

    Args:
        step: the averager's step counter.
        periods: the hierarchy's periods, lowest level first.

    Returns:
        The period, or None when no level averages at this step.
    """
    for period in reversed(periods):
        if step % period == 0:
            return period
    return None
