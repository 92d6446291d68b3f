"""The ``"int8"`` code map's arithmetic: an 8-bit minifloat per element, decoded and encoded
by bit operations on the fp32 pattern (no table, so it vectorises on every device).

A block's values are divided by its largest magnitude (its scale), so they lie in ``[-1, 1]``;
a code is then a float with a 3-bit fraction:

* signed (first moments): a sign bit and 7 magnitude bits ``c``: ``2**(c // 8 - 15) * (1 +
  (c % 8) / 8)`` for ``1 <= c <= 120`` (15 binades and 1.0, down to ``2**-15`` of the block's
  maximum) and exactly zero for ``c == 0``;
* non-negative (second moments): 8 bits ``c``: ``2**(c // 8 - 31) * (1 + (c % 8) / 8)`` for
  ``1 <= c <= 248`` (31 binades and 1.0) and zero only for an exact zero: a non-zero value
  never rounds to 0 (the *zero-point problem* of Li et al. 2023).

The largest code is exactly 1, so a block's largest value decodes to its scale exactly, and
decoded values encode back to the same codes and scales (codes 121-127 and 249-255 are
unused).

Rounding is to the nearest code (ties to the even fraction); a signed magnitude below half the
smallest code rounds to zero. The C++ step (:mod:`.fused_cpu`) does the same operations, so
both give the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["decode", "encode", "values"]

_SIGNED_BIAS = (127 - 15) << 3  # fp32 exponent field of 2**-15, in fraction-bit units
_UNSIGNED_BIAS = (127 - 31) << 3
_HALF_SMALLEST_SIGNED = (127 - 16) << 23  # the fp32 pattern of 2**-16


def decode(codes: Tensor, signed: bool) -> Tensor:
    """The fp32 values (in ``[-1, 1]``) of ``codes`` (``uint8``)."""
    c = codes.to(torch.int32)
    if signed:
        magnitude = c & 127
        bits = ((magnitude + _SIGNED_BIAS) << 20) | ((c >> 7) << 31)
        return torch.where(magnitude == 0, 0.0, bits.view(torch.float32))
    return torch.where(c == 0, 0.0, ((c + _UNSIGNED_BIAS) << 20).view(torch.float32))


def encode(y: Tensor, signed: bool) -> Tensor:
    """The nearest codes (``uint8``) of fp32 ``y`` in ``[-1, 1]``."""
    bits = y.view(torch.int32)
    if signed:
        magnitude = bits & 0x7FFFFFFF
        r = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - _SIGNED_BIAS
        floor = (magnitude >= _HALF_SMALLEST_SIGNED).to(torch.int32)
        r = torch.maximum(r, floor).clamp_(max=120)
        return (r | ((bits >> 24) & 128)).to(torch.uint8)
    r = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - _UNSIGNED_BIAS
    return torch.where(bits == 0, 0, r.clamp_(1, 248)).to(torch.uint8)


def values(signed: bool) -> Tensor:
    """The value of each code 0..255 (unused codes decode above 1)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return decode(codes, signed)
