"""Pure planning of DiLoCo-style outer synchronisation: argument checks, fragments, schedule.

Streaming DiLoCo (https://arxiv.org/abs/2501.18512) splits the model into ``P`` fragments of
consecutive parameters and syncs each at its own offset within the period, so that at most one
fragment is on the wire at a time and every parameter is sent exactly once per period. Nothing
here talks to torch.distributed: sizes and steps in, indices out.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

__all__ = [
    "COMPRESSIONS",
    "check_outer_args",
    "check_fragment_count",
    "due_fragments",
    "fragment_offsets",
    "plan_fragments",
]

#: Accepted values of ``compression`` (None sends the pseudo-gradient in the parameters' dtype).
COMPRESSIONS = (None, "bf16", "int8", "int4")


def check_outer_args(
    period: int,
    warmup_steps: int,
    fragments: int,
    compression: str | None,
    overlap: bool,
    overlap_delay: int,
    overlap_alpha: float,
) -> None:
    """Validate an outer-synchronisation configuration before anything is built.

    Args:
        period: inner steps between two syncs of the same parameter.
        warmup_steps: steps before the first sync.
        fragments: number of fragments synced on staggered schedules.
        compression: None, ``"bf16"``, ``"int8"`` or ``"int4"``.
        overlap: whether fragments are applied ``overlap_delay`` steps after they are sent
            (``overlap_delay`` and ``overlap_alpha`` are checked only then).
        overlap_delay: inner steps between sending a fragment and applying its outer step.
        overlap_alpha: weight of the local parameters when the outer result is blended in.

    Raises:
        ValueError: naming the bad argument and the accepted range.
    """
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"Arg ``period`` must be a positive integer, got {period!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"Arg ``warmup_steps`` must be a non-negative integer, got {warmup_steps!r}."
        )
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"Arg ``fragments`` must be a positive integer, got {fragments!r}.")
    if compression not in COMPRESSIONS:
        raise ValueError(
            f"Unknown ``compression`` {compression!r}: use None (the parameters' dtype), "
            "'bf16', 'int8' or 'int4' (blockwise scales with error feedback)."
        )
    if not overlap:
        return
    if isinstance(overlap_delay, bool) or not isinstance(overlap_delay, int):
        raise ValueError(f"Arg ``overlap_delay`` must be an integer, got {overlap_delay!r}.")
    if overlap_delay < 1:
        raise ValueError(
            f"Arg ``overlap_delay`` must be at least 1 with ``overlap=True``, got "
            f"{overlap_delay}: 0 applies the outer step at once (``overlap=False``)."
        )
    if overlap_delay >= period:
        raise ValueError(
            f"Arg ``overlap_delay`` must be below ``period`` ({period}), got {overlap_delay}: "
            "a fragment's outer step must land before the fragment is sent again."
        )
    if not 0.0 <= overlap_alpha <= 1.0:
        raise ValueError(f"Arg ``overlap_alpha`` must be in [0, 1], got {overlap_alpha!r}.")


def check_fragment_count(fragments: int, n_params: int) -> None:
    """Check that every fragment can get at least one parameter.

    Raises:
        ValueError: if there are more fragments than parameters.
    """
    if fragments > n_params:
        raise ValueError(
            f"Arg ``fragments`` ({fragments}) exceeds the number of parameters to average "
            f"({n_params}): every fragment needs at least one parameter. Use at most "
            f"{n_params} fragments."
        )


def plan_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Split parameters into ``fragments`` runs of consecutive indices of about equal numel.

    Cuts fall where the running total is closest to ``k * total / fragments``, keeping at least
    one parameter per fragment (model order is kept, as the paper splits by layers).

    Args:
        sizes: numel of every parameter, in order.
        fragments: number of fragments (at most ``len(sizes)``).

    Returns:
        The parameter indices of each fragment; together they are ``range(len(sizes))``.

    Raises:
        ValueError: if ``fragments`` is below 1 or above ``len(sizes)``.
    """
    if fragments < 1:
        raise ValueError(f"Arg ``fragments`` must be a positive integer, got {fragments!r}.")
    check_fragment_count(fragments, len(sizes))
    n = len(sizes)
    prefix = [0, *itertools.accumulate(sizes)]
    total = prefix[-1]
    bounds = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        cut = bisect.bisect_left(prefix, target)
        if cut > 0 and target - prefix[cut - 1] <= prefix[min(cut, n)] - target:
            cut -= 1
        cut = max(bounds[-1] + 1, min(cut, n - (fragments - k)))
        bounds.append(cut)
    bounds.append(n)
    return [list(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """The step (mod ``period``) at which each fragment is sent, spread evenly over the period.

    Fragment ``i`` is sent at ``(i + 1) * period // fragments`` modulo ``period``: the last one at
    multiples of the period, so that one fragment gives plain DiLoCo's schedule.

    Args:
        period: inner steps between two syncs of the same fragment.
        fragments: number of fragments.

    Returns:
        One offset in ``[0, period)`` per fragment.
    """
    return [((i + 1) * period // fragments) % period for i in range(fragments)]


def due_fragments(since: int, period: int, offsets: Sequence[int]) -> list[int]:
    """The fragments sent at ``since`` steps after the first sync (which syncs everything).

    Args:
        since: steps since the warm-up ended (the first sync is at 0).
        period: the period.
        offsets: :func:`fragment_offsets`' result.

    Returns:
        Indices of the fragments due; empty at ``since <= 0``.
    """
    if since <= 0:
        return []
    phase = since % period
    return [i for i, offset in enumerate(offsets) if offset == phase]
