"""The mean of a flat pseudo-gradient over a process group, started now and read later.

Uncompressed, the values are divided by the group size and summed with one all-reduce (the op
order of :func:`dist_runtime.averaging.average_parameters`). Compressed (:mod:`~dist_runtime.
compression`), every rank's payload is all-gathered and each rank decodes and sums them in rank
order in float32, so every rank computes bitwise the same mean. Either way the collective is
asynchronous: :meth:`PseudoGradientReducer.start` returns a :class:`PendingMean` that the caller
waits on when it needs the result (immediately, or some inner steps later to overlap).

When the collective fails (a dead or hung peer), :meth:`PendingMean.settle` reports it and
:meth:`PendingMean.discard` puts the error feedback back as it was before the send, so that the
values can be sent again (over a re-formed group, :meth:`PseudoGradientReducer.set_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dist_runtime.collective_failure import is_collective_failure
from dist_runtime.compression import Codec, make_codec
from dist_runtime.process_group import resolve_group, wait_work

__all__ = ["PendingMean", "PseudoGradientReducer"]


class PendingMean:
    """An in-flight (or finished) mean over the group of one flat tensor.

    Args:
        work: the collective's handle (None when the value is already known).
        buffer: the all-reduced tensor, or the all-gathered payloads when ``codec`` is set.
        codec: how to decode each rank's chunk of ``buffer`` (None: ``buffer`` is the mean).
        out: float32 buffer that receives the mean when ``codec`` is set.
        scratch: float32 buffer like ``out`` for the other ranks' decoded values; until the
            mean is decoded it holds the error feedback as it was before the send.
        dtype: the dtype of the mean returned.
        residual: the error feedback the send updated (restored by :meth:`discard`).
    """

    def __init__(
        self,
        work: dist.Work | None,
        buffer: Tensor,
        codec: Codec | None = None,
        out: Tensor | None = None,
        scratch: Tensor | None = None,
        dtype: torch.dtype | None = None,
        residual: Tensor | None = None,
    ) -> None:
        self._work = work
        self._buffer = buffer
        self._codec = codec
        self._out = out
        self._scratch = scratch
        self._residual = residual
        self._dtype = dtype if dtype is not None else buffer.dtype
        self._result: Tensor | None = None if codec is not None or work is not None else buffer
        self._failed = False

    @classmethod
    def done(cls, value: Tensor) -> PendingMean:
        """A pending mean already known (e.g. restored from a checkpoint)."""
        return cls(None, value)

    def wait(self) -> Tensor:
        """Wait for the collective and return the mean (computed once, then cached).

        Raises:
            RuntimeError: if the collective fails or times out.
        """
        if self._result is not None:
            return self._result
        if self._failed:
            raise RuntimeError("the pseudo-gradient all-reduce failed earlier: discard() it")
        try:
            wait_work(self._work, None, "the pseudo-gradient all-reduce")
        except RuntimeError as exc:
            self._failed = is_collective_failure(exc)
            raise
        self._work = None
        if self._codec is None:
            self._result = self._buffer
            return self._result
        assert self._out is not None
        assert self._scratch is not None
        out, scratch = self._out, self._scratch
        world_size = self._buffer.numel() // self._codec.payload_numel(out.numel())
        chunks = self._buffer.view(world_size, -1)
        # Every rank sums the same decoded values in rank order: bitwise the same mean.
        self._codec.decode_into(chunks[0], out)
        for rank in range(1, world_size):
            self._codec.decode_into(chunks[rank], scratch)
            out.add_(scratch)
        out.div_(world_size)
        self._result = out if out.dtype == self._dtype else out.to(self._dtype)
        return self._result

    def settle(self) -> bool:
        """Wait for the collective to end either way; whether the mean is available.

        Returns:
            True when the mean was computed, False when the collective failed (a dead or hung
            peer: nothing is in flight any more, :meth:`discard` it).

        Raises:
            Exception: any error that is not a failed collective.
        """
        if self._result is not None:
            return True
        if self._failed:
            return False
        try:
            self.wait()
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            self._failed = True
            return False
        return True

    def discard(self) -> None:
        """Give up on a mean whose collective failed: restore the error feedback.

        The residual gets back the value it had before the send (the values and the residual
        can then be sent again); without compression there is nothing to restore.

        Raises:
            RuntimeError: if the collective did not fail (a computed mean, or one in flight).
        """
        if not self._failed:
            raise RuntimeError(
                "only a pseudo-gradient mean whose collective failed can be discarded "
                "(settle() it first)"
            )
        if self._residual is not None and self._scratch is not None:
            self._residual.copy_(self._scratch)  # never decoded: the pre-send residual
        self._residual = None


class _Buffers:
    """The reusable buffers of one compressed stream (one fragment)."""

    __slots__ = ("gathered", "payload", "scratch")

    def __init__(self, codec: Codec, numel: int, size: int, device: torch.device) -> None:
        n = codec.payload_numel(numel)
        self.payload = torch.empty(n, dtype=codec.payload_dtype, device=device)
        self.gathered = torch.empty(size * n, dtype=codec.payload_dtype, device=device)
        self.scratch = torch.empty(numel, dtype=torch.float32, device=device)


class PseudoGradientReducer:
    """Start group means of flat tensors, optionally compressed, counting the bytes sent.

    Args:
        process_group: the group; None for the default group.
        compression: None, ``"bf16"``, ``"int8"`` or ``"int4"``.

    Attributes:
        bytes_sent: cumulative payload bytes this rank handed to collectives.
    """

    def __init__(self, process_group: ProcessGroup | None, compression: str | None) -> None:
        self.process_group = resolve_group(process_group)
        self.codec = make_codec(compression)
        self.bytes_sent = 0
        self._buffers: dict[int, _Buffers] = {}

    def set_group(self, process_group: ProcessGroup | None) -> None:
        """Start later means over ``process_group`` (e.g. a group re-formed after a failure).

        Means already started keep their group and buffers; later ones get buffers sized for
        the new group.
        """
        self.process_group = resolve_group(process_group)
        self._buffers = {}

    def start(
        self, values: Tensor, residual: Tensor | None, key: int = 0
    ) -> tuple[PendingMean, Tensor | None]:
        """Start the mean of ``values`` over the group.

        Args:
            values: a 1-d tensor, consumed: it is divided in place and reduced (uncompressed),
                or holds ``values + residual`` and then receives the mean (compressed, float32).
            residual: the error feedback of these values (ignored without compression; None
                before the first compressed send); updated in place.
            key: which stream the values belong to: streams in flight at the same time need
                their own buffers (one per fragment).

        Returns:
            The pending mean and the residual (None without compression).
        """
        size = dist.get_world_size(self.process_group)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        if self.codec is None:
            values.div_(size)  # divide first, as the averaging runtime does
            work = dist.all_reduce(values, group=self.process_group, async_op=True)
            self.bytes_sent += values.numel() * values.element_size()
            return PendingMean(work, values), None
        numel = values.numel()
        buffers = self._buffers.get(key)
        if buffers is None or buffers.scratch.numel() != numel:
            buffers = _Buffers(self.codec, numel, size, values.device)
            self._buffers[key] = buffers
        target = values if values.dtype == torch.float32 else values.to(torch.float32)
        if residual is None:
            residual = torch.zeros_like(target)
        # The scratch buffer keeps the residual as it was until the mean is decoded: a failed
        # send is undone from it (PendingMean.discard), without a buffer of its own.
        buffers.scratch.copy_(residual)
        self.codec.feedback_into(target, residual, buffers.payload)
        try:
            work = dist.all_gather_single(
                buffers.gathered, buffers.payload, group=self.process_group, async_op=True
            )
        except BaseException:
            residual.copy_(buffers.scratch)  # nothing was sent
            raise
        self.bytes_sent += buffers.payload.numel() * buffers.payload.element_size()
        pending = PendingMean(
            work, buffers.gathered, self.codec, target, buffers.scratch, values.dtype, residual
        )
        return pending, residual
