"""SparseLoCo's encoding of a pseudo-gradient: top-k per chunk, low-bit values, error feedback.

SparseLoCo (Sarfi et al. 2025, https://arxiv.org/abs/2508.15706) sends, per chunk of ``chunk``
consecutive values, only the ``k = ceil(density * chunk)`` of largest magnitude, as their
positions in the chunk plus a ``bits``-bit code each, and keeps everything it did not send in
an error-feedback accumulator ``e <- decay * e + delta`` (``e -= decode(encode(e))`` after
each send). The code of a selected value ``v`` is its sign and the nearest of ``2**(bits-1)``
magnitude levels spread evenly over ``[lo, hi]``, the smallest and largest selected magnitudes
of the chunk (two float32 scales per chunk). One rank's payload is one ``uint8`` tensor::

    [ int16 positions (2 K bytes) | packed codes (ceil(K bits / 8) bytes) | (lo, hi) float32 ]

with ``K = n_chunks * k``: ``2 + bits / 8`` bytes per selected value plus 8 bytes per chunk.
Pure tensor maths; :mod:`dist_runtime.pseudo_gradient` all-gathers the payloads and sums the
decoded values in rank order, as it does for the other codecs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dist_runtime.compression import Codec

__all__ = ["BITS", "MAX_CHUNK", "TopKCodec", "check_sparse_args"]

#: Accepted code widths.
BITS = (2, 4, 8)
#: Largest chunk: positions are sent as int16.
MAX_CHUNK = 2**15


def check_sparse_args(density: float, bits: int, chunk: int, feedback_decay: float) -> None:
    """Validate a SparseLoCo configuration before anything is built.

    Args:
        density: fraction of each chunk sent, in ``(0, 1]``.
        bits: bits per sent value: 2, 4 or 8.
        chunk: values per chunk, in ``[1, 32768]``.
        feedback_decay: ``decay`` of the error feedback, in ``[0, 1]``.

    Raises:
        ValueError: naming the bad argument and the accepted range.
    """
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise ValueError(f"Arg ``density`` must be a number in (0, 1], got {density!r}.")
    if not 0.0 < density <= 1.0:
        raise ValueError(
            f"Arg ``density`` must be in (0, 1] (the fraction of each chunk sent; SparseLoCo "
            f"uses 0.01-0.03), got {density!r}."
        )
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"Arg ``bits`` must be one of {BITS}, got {bits!r}.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"Arg ``chunk`` must be an integer in [1, {MAX_CHUNK}], got {chunk!r}.")
    if not 0.0 <= feedback_decay <= 1.0:
        raise ValueError(f"Arg ``feedback_decay`` must be in [0, 1], got {feedback_decay!r}.")


class TopKCodec(Codec):
    """Top-k per chunk with ``bits``-bit magnitudes and signs, error feedback with a decay.

    Args:
        density: fraction of each chunk sent (``k = ceil(density * chunk)``, at least 1).
        bits: bits per sent value (2, 4 or 8).
        chunk: values per chunk (a tensor shorter than ``chunk`` is one chunk).
        feedback_decay: the error feedback is ``decay * e + values`` before each send.

    Raises:
        ValueError: from :func:`check_sparse_args`.
    """

    def __init__(
        self, density: float, bits: int = 2, chunk: int = 4096, feedback_decay: float = 1.0
    ) -> None:
        check_sparse_args(density, bits, chunk, feedback_decay)
        self.density = float(density)
        self.bits = bits
        self.chunk = chunk
        self.feedback_decay = float(feedback_decay)
        self.name = f"topk(density={self.density:g}, bits={bits})"
        self._padded: dict[tuple[int, torch.device], Tensor] = {}

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.uint8

    def layout(self, numel: int) -> tuple[int, int, int]:
        """``(chunk, n_chunks, k)`` for a tensor of ``numel`` values."""
        width = max(1, min(self.chunk, numel))
        n_chunks = -(-numel // width)
        k = min(width, max(1, math.ceil(self.density * width - 1e-9)))
        return width, n_chunks, k

    def _sections(self, numel: int) -> tuple[int, int, int]:
        """Byte lengths of the positions, the packed codes and the scales."""
        _, n_chunks, k = self.layout(numel)
        selected = n_chunks * k
        return 2 * selected, -(-selected * self.bits // 8), 8 * n_chunks

    def payload_numel(self, numel: int) -> int:
        return sum(self._sections(numel))

    def _workspace(self, numel: int, device: torch.device) -> Tensor:
        width, n_chunks, _ = self.layout(numel)
        key = (numel, device)
        if key not in self._padded:
            self._padded[key] = torch.zeros(n_chunks * width, device=device)
        return self._padded[key]

    def encode_into(self, values: Tensor, payload: Tensor) -> None:
        n = values.numel()
        width, n_chunks, k = self.layout(n)
        padded = self._workspace(n, values.device)
        padded[:n].copy_(values)
        padded[n:].zero_()
        blocks = padded.view(n_chunks, width)
        magnitude, positions = blocks.abs().topk(k, dim=1)
        negative = blocks.gather(1, positions) < 0
        low = magnitude.amin(dim=1, keepdim=True)
        high = magnitude.amax(dim=1, keepdim=True)
        levels = 2 ** (self.bits - 1)
        span = high - low
        safe = torch.where(span > 0, span, torch.ones_like(span))
        level = ((magnitude - low) / safe * (levels - 1)).round_().clamp_(0, levels - 1)
        codes = level.to(torch.uint8) + negative.to(torch.uint8) * levels
        pos_bytes, code_bytes, _ = self._sections(n)
        payload[:pos_bytes].copy_(positions.to(torch.int16).view(-1).view(torch.uint8))
        per_byte = 8 // self.bits
        flat = torch.zeros(code_bytes * per_byte, dtype=torch.uint8, device=values.device)
        flat[: codes.numel()] = codes.view(-1)
        shifts = torch.arange(per_byte, device=values.device, dtype=torch.uint8) * self.bits
        packed = (flat.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
        payload[pos_bytes : pos_bytes + code_bytes].copy_(packed)
        scales = torch.cat([low, high], dim=1).view(-1)
        payload[pos_bytes + code_bytes :].copy_(scales.view(torch.uint8))

    def decode_into(self, payload: Tensor, out: Tensor) -> None:
        n = out.numel()
        width, n_chunks, k = self.layout(n)
        pos_bytes, code_bytes, _ = self._sections(n)
        # (copied first: views as int16 / float32 need aligned starts)
        positions = payload[:pos_bytes].clone().view(torch.int16).view(n_chunks, k).long()
        packed = payload[pos_bytes : pos_bytes + code_bytes]
        scales = payload[pos_bytes + code_bytes :].clone().view(torch.float32).view(n_chunks, 2)
        per_byte = 8 // self.bits
        shifts = torch.arange(per_byte, device=out.device, dtype=torch.uint8) * self.bits
        mask = (1 << self.bits) - 1
        codes = ((packed.view(-1, 1) >> shifts) & mask).view(-1)[: n_chunks * k].view(n_chunks, k)
        levels = 2 ** (self.bits - 1)
        negative = codes >= levels
        level = (codes - negative.to(torch.uint8) * levels).to(torch.float32)
        low, high = scales[:, :1], scales[:, 1:]
        magnitude = low + level * ((high - low) / (levels - 1))
        value = torch.where(negative, -magnitude, magnitude)
        padded = self._workspace(n, out.device)
        padded.zero_()
        padded.view(n_chunks, width).scatter_(1, positions, value)
        out.copy_(padded[:n])

    def feedback_into(self, target: Tensor, residual: Tensor, payload: Tensor) -> None:
        """Encode ``target += decay * residual``; leave what was not sent in ``residual``."""
        target.add_(residual, alpha=self.feedback_decay)
        self.encode_into(target, payload)
        self.decode_into(payload, residual)
        torch.sub(target, residual, out=residual)
