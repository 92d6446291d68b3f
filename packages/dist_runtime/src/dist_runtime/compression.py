"""Low-precision encodings of a flat pseudo-gradient, with error feedback.

A codec turns a flat tensor into the payload one rank sends and turns every rank's payload back
into values:

- ``"bf16"`` rounds to bfloat16 (relative error at most ``2**-8`` per element);
- ``"int8"`` splits the tensor into blocks of :data:`INT8_BLOCK` elements and sends each as int8
  codes with one float32 scale ``absmax / 127`` (absolute error at most ``absmax(block) / 254``
  per element, plus float32 rounding);
- ``"int4"`` does the same with :data:`INT4_BLOCK`-element blocks, codes in ``[-7, 7]`` packed
  two per byte (error at most ``absmax(block) / 14``).

Error feedback keeps what the encoding lost on this rank
(``residual = value - decode(encode(value))``) and adds it to the next value sent, so the
rounding errors do not accumulate over syncs: the decoded values summed over rounds equal the
inputs summed minus the last residual.

Pure tensor maths; the collectives live in :mod:`dist_runtime.pseudo_gradient`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

__all__ = [
    "BF16_RELATIVE_ERROR",
    "INT8_BLOCK",
    "Bf16Codec",
    "Codec",
    "INT4_BLOCK",
    "Int4BlockwiseCodec",
    "Int8BlockwiseCodec",
    "dequantize_int8_blockwise",
    "make_codec",
    "quantize_int8_blockwise",
]

#: Elements per int8 block (one float32 scale each: 1.6% overhead).
INT8_BLOCK = 256
#: Elements per int4 block (one float32 scale each: 0.0625 bytes per value).
INT4_BLOCK = 64
#: Bound on ``|bf16(x) - x| / |x|`` for round-to-nearest (8 significant bits).
BF16_RELATIVE_ERROR = 2.0**-8


def quantize_int8_blockwise(values: Tensor, block: int = INT8_BLOCK) -> tuple[Tensor, Tensor]:
    """Quantize a flat tensor to int8 codes with one scale per block.

    Args:
        values: a 1-d floating tensor.
        block: elements per block.

    Returns:
        ``(codes, scales)``: int8 codes padded with zeros to whole blocks, float32 scales
        ``absmax / 127`` per block (0 for an all-zero block).
    """
    n = values.numel()
    n_blocks = -(-n // block)
    padded = torch.zeros(n_blocks * block, dtype=torch.float32, device=values.device)
    padded[:n] = values
    blocks = padded.view(n_blocks, block)
    scales = blocks.abs().amax(dim=1).div_(127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = blocks.div_(safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8_blockwise(codes: Tensor, scales: Tensor, numel: int) -> Tensor:
    """Decode :func:`quantize_int8_blockwise`'s output to float32.

    Args:
        codes: the int8 codes (whole blocks).
        scales: one float32 scale per block.
        numel: the length of the original tensor.

    Returns:
        A float32 tensor of ``numel`` elements.
    """
    blocks = codes.view(scales.numel(), -1).to(torch.float32) * scales[:, None]
    return blocks.view(-1)[:numel]


class Codec(ABC):
    """How one rank's flat pseudo-gradient is encoded for the wire and decoded on arrival.

    The ``*_into`` methods write into caller-owned buffers: on a large model a fresh tensor per
    step costs more (page faults) than the arithmetic, so the sync path reuses its buffers.
    """

    name: str

    @property
    @abstractmethod
    def payload_dtype(self) -> torch.dtype:
        """dtype of the payload tensor."""

    @abstractmethod
    def payload_numel(self, numel: int) -> int:
        """Length of the payload tensor for ``numel`` values."""

    @abstractmethod
    def encode_into(self, values: Tensor, payload: Tensor) -> None:
        """Write the payload of the float32 1-d tensor ``values`` into ``payload``."""

    @abstractmethod
    def decode_into(self, payload: Tensor, out: Tensor) -> None:
        """Write the float32 values of one rank's ``payload`` into ``out`` (1-d, float32)."""

    def payload_bytes(self, numel: int) -> int:
        """Bytes this rank sends for ``numel`` values."""
        return self.payload_numel(numel) * self.payload_dtype.itemsize

    def encode(self, values: Tensor) -> Tensor:
        """The payload this rank sends for the 1-d tensor ``values`` (a new tensor)."""
        payload = torch.empty(
            self.payload_numel(values.numel()), dtype=self.payload_dtype, device=values.device
        )
        self.encode_into(values.to(torch.float32), payload)
        return payload

    def decode(self, payload: Tensor, numel: int) -> Tensor:
        """The float32 values of one rank's ``payload`` (a new tensor)."""
        out = torch.empty(numel, dtype=torch.float32, device=payload.device)
        self.decode_into(payload, out)
        return out

    def feedback_into(self, target: Tensor, residual: Tensor, payload: Tensor) -> None:
        """Encode ``target += residual`` into ``payload``; leave what it lost in ``residual``.

        Args:
            target: the float32 values to send, overwritten with ``values + residual``.
            residual: what earlier encodings lost (zeros at first); updated in place.
            payload: where the payload goes.
        """
        target.add_(residual)
        self.encode_into(target, payload)
        self.decode_into(payload, residual)
        torch.sub(target, residual, out=residual)

    def encode_with_feedback(
        self, values: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Encode ``values + residual`` and return the payload and the new residual.

        Args:
            values: the 1-d tensor to send (not modified).
            residual: what previous encodings lost (None before the first).

        Returns:
            ``(payload, residual)``, the residual a new float32 tensor like ``values``.
        """
        target = values.to(torch.float32, copy=True)
        new_residual = torch.zeros_like(target) if residual is None else residual.clone()
        payload = torch.empty(
            self.payload_numel(values.numel()), dtype=self.payload_dtype, device=values.device
        )
        self.feedback_into(target, new_residual, payload)
        return payload, new_residual


class Bf16Codec(Codec):
    """bfloat16 rounding: half the bytes of float32, relative error at most ``2**-8``."""

    name = "bf16"

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def payload_numel(self, numel: int) -> int:
        return numel

    def encode_into(self, values: Tensor, payload: Tensor) -> None:
        payload.copy_(values)

    def decode_into(self, payload: Tensor, out: Tensor) -> None:
        out.copy_(payload[: out.numel()])


class Int8BlockwiseCodec(Codec):
    """int8 codes with a float32 scale per block, packed into one int8 payload.

    The payload is ``numel`` codes then the scales' bytes: 1 byte per value plus 4 per block.

    Args:
        block: elements per block.
    """

    name = "int8"

    def __init__(self, block: int = INT8_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"block must be positive, got {block}")
        self.block = block
        self._padded: dict[tuple[int, torch.device], Tensor] = {}

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.int8

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def payload_numel(self, numel: int) -> int:
        return numel + 4 * self._blocks(numel)

    def _workspace(self, numel: int, device: torch.device) -> Tensor:
        """A zero-padded float32 buffer of whole blocks, kept per size (its tail stays 0)."""
        key = (numel, device)
        padded = self._padded.get(key)
        if padded is None:
            padded = torch.zeros(self._blocks(numel) * self.block, device=device)
            self._padded[key] = padded
        return padded

    def encode_into(self, values: Tensor, payload: Tensor) -> None:
        n = values.numel()
        n_blocks = self._blocks(n)
        padded = self._workspace(n, values.device)
        padded[:n].copy_(values)
        blocks = padded.view(n_blocks, self.block)
        low, high = torch.aminmax(blocks, dim=1)  # |x| max without a temporary like ``values``
        scales = torch.maximum(high, low.neg_()).div_(127.0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        blocks.div_(safe[:, None]).round_().clamp_(-127, 127)
        # Codes first (the last block's padding is not sent), then the scales bit-cast to
        # bytes: one collective per sync.
        payload[:n].copy_(padded[:n])
        payload[n:].copy_(scales.view(torch.int8))

    def decode_into(self, payload: Tensor, out: Tensor) -> None:
        n = out.numel()
        n_blocks = self._blocks(n)
        # (copied first: a view as float32 needs a 4-byte-aligned start)
        scales = payload[n : n + 4 * n_blocks].clone().view(torch.float32)
        out.copy_(payload[:n])
        full = n // self.block
        if full:
            out[: full * self.block].view(full, self.block).mul_(scales[:full, None])
        if full < n_blocks:
            out[full * self.block :].mul_(scales[full])


class Int4BlockwiseCodec(Int8BlockwiseCodec):
    """4-bit codes in ``[-7, 7]`` with a float32 scale ``absmax / 7`` per block, two codes per
    byte (the even element in the low nibble, stored as ``code + 8``).

    The payload is ``ceil(numel / 2)`` bytes of codes then the scales' bytes: half a byte per
    value plus 4 per block. Error per element at most ``absmax(block) / 14``.

    Args:
        block: elements per block (even).
    """

    name = "int4"

    def __init__(self, block: int = INT4_BLOCK) -> None:
        if block < 2 or block % 2:
            raise ValueError(f"block must be a positive even number, got {block}")
        super().__init__(block)

    def _code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def payload_numel(self, numel: int) -> int:
        return self._code_bytes(numel) + 4 * self._blocks(numel)

    def encode_into(self, values: Tensor, payload: Tensor) -> None:
        n = values.numel()
        n_blocks = self._blocks(n)
        padded = self._workspace(n, values.device)
        padded[:n].copy_(values)
        padded[n:].zero_()
        blocks = padded.view(n_blocks, self.block)
        low, high = torch.aminmax(blocks, dim=1)
        scales = torch.maximum(high, low.neg_()).div_(7.0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = blocks.div(safe[:, None]).round_().clamp_(-7, 7).add_(8).to(torch.uint8)
        pairs = codes.view(-1, 2)[: self._code_bytes(n)]
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        m = self._code_bytes(n)
        payload[:m].copy_(packed.view(torch.int8))
        payload[m:].copy_(scales.view(torch.int8))

    def decode_into(self, payload: Tensor, out: Tensor) -> None:
        n = out.numel()
        m = self._code_bytes(n)
        n_blocks = self._blocks(n)
        scales = payload[m : m + 4 * n_blocks].clone().view(torch.float32)
        packed = payload[:m].view(torch.uint8)
        codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:n]
        out.copy_(codes).sub_(8)
        full = n // self.block
        if full:
            out[: full * self.block].view(full, self.block).mul_(scales[:full, None])
        if full < n_blocks:
            out[full * self.block :].mul_(scales[full])


def make_codec(compression: str | None) -> Codec | None:
    """The codec named by ``compression`` (None: send the values as they are).

    Raises:
        ValueError: for an unknown name.
    """
    if compression is None:
        return None
    if compression == "bf16":
        return Bf16Codec()
    if compression == "int8":
        return Int8BlockwiseCodec()
    if compression == "int4":
        return Int4BlockwiseCodec()
    raise ValueError(f"Unknown compression {compression!r}: use None, 'bf16', 'int8' or 'int4'.")
