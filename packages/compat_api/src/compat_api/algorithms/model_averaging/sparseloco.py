"""SparseLoCo: DiLoCo whose pseudo-gradient is sent as top-k positions plus low-bit codes.

SparseLoCo (Sarfi et al. 2025, https://arxiv.org/abs/2508.15706) keeps DiLoCo's inner loop and
replaces the dense all-reduce of the pseudo-gradient by a sparse, quantised exchange with error
feedback (:class:`~dist_runtime.sparse_codec.TopKCodec`): each rank sends, per chunk, the
``density`` fraction of its error-feedback accumulator with the largest magnitudes as int16
positions and ``bits``-bit codes; every rank decodes every payload and averages them in rank
order, so the synced copies stay bitwise identical. The accumulator, decayed by
``feedback_decay`` at each sync, plays the part of the outer momentum in the paper, whose outer
step is plain SGD (the default here).
"""

from __future__ import annotations

from typing import Any

import functional_optim as fo
from compat_api.algorithms.model_averaging.diloco import DiLoCoAverager
from dist_runtime.sparse_codec import TopKCodec, check_sparse_args

__all__ = ["SparseLoCoAverager"]


class SparseLoCoAverager(DiLoCoAverager):
    """:class:`DiLoCoAverager` with SparseLoCo's top-k, low-bit, error-feedback exchange.

    Bytes: per sync each rank hands ``2 + bits / 8`` bytes per sent value plus 8 per chunk to
    one all-gather (counted in ``bytes_communicated``, as the dense and int8 exchanges are).

    Args:
        outer: the outer optimizer (default ``fo.sgd(lr=1.0)``: the error feedback carries the
            momentum).
        period: inner steps between two syncs (DiLoCo's ``H``).
        density: fraction of each chunk sent, in ``(0, 1]`` (the paper: 1-3%).
        bits: bits per sent value: 2, 4 or 8.
        chunk: values per top-k chunk (at most 32768).
        feedback_decay: the accumulator is ``decay * e + (s - x)`` before each send, in
            ``[0, 1]``.
        **kwargs: further :class:`DiLoCoAverager` arguments (``params``, ``fragments``,
            ``overlap``, ``warmup_steps``, ``process_group``, ...), not ``compression``.

    Raises:
        ValueError: for a ``density`` outside ``(0, 1]``, ``bits`` not in ``{2, 4, 8}``, a
            ``chunk`` outside ``[1, 32768]``, a ``feedback_decay`` outside ``[0, 1]`` or a
            ``compression`` argument (checked before anything is built), and the
            :class:`DiLoCoAverager` errors.
    """

    def __init__(
        self,
        outer: fo.GradientTransformation | None = None,
        *,
        period: int,
        density: float = 0.02,
        bits: int = 2,
        chunk: int = 4096,
        feedback_decay: float = 0.95,
        **kwargs: Any,
    ) -> None:
        check_sparse_args(density, bits, chunk, feedback_decay)
        if "compression" in kwargs:
            raise ValueError(
                "SparseLoCoAverager sends top-k codes; it takes no ``compression`` (use "
                "DiLoCoAverager for bf16 / int8)."
            )
        codec = TopKCodec(density, bits, chunk, feedback_decay)
        super().__init__(outer if outer is not None else fo.sgd(lr=1.0), period=period, **kwargs)
        self._reducer.codec = codec  # every send goes through the all-gather of the codec
        self.compression = codec.name  # saved in state_dict and checked on load
        self.density, self.bits, self.chunk = codec.density, bits, chunk
        self.feedback_decay = codec.feedback_decay
