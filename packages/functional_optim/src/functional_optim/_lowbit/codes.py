"""Code maps of the low-bit optimizer states: sorted value tables and their fast encoders.

A moment is stored as one small integer *code* per element plus one fp32 *scale* per block:
the element's value is ``table[code] * scale``. The tables are normalised to ``[-1, 1]``
(``[0, 1]`` unsigned) and the scale of a block is the largest magnitude in it.

* ``"int8"``: an 8-bit minifloat per element (:mod:`.minifloat`): a 3-bit fraction and a 4-bit
  (signed) or 5-bit (non-negative) exponent, so values reach ``2**-15`` (``2**-31``) of the
  block maximum; decoded and encoded by bit operations on the fp32 pattern, with no table.
  (Until 2026-11-26 it was bitsandbytes' decimal dynamic exponent map, which needs a table
  lookup per element: several times slower on CPU, see ``docs/lowbit.md``.)
* ``"int4"``: a *dynamic exponent* map (Dettmers et al. 2016; bitsandbytes, torchao and Li et
  al. 2023 use variants): after the sign bit, the run of leading zero bits ``z`` gives a
  decimal exponent and the bits after the next ``1`` a linear fraction, so a code is
  ``10**-z * (0.1 + 0.9 * (f + 1) / 2**F)``, plus an exact zero. Signed 4-bit values (first
  moments) use FP4 E2M1's magnitudes instead (0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3, 1): with only
  seven magnitudes, the dynamic exponent map's coarse middle costs more than its reach to
  small values gains (least squares: +2.3% against +21% of fp32 AdamW's final loss).
* ``"fp8"``: ``float8_e4m3fn`` values divided by 448 (the largest), encoded by torch's cast.

Second moments (non-negative fields) use the unsigned map and never round a non-zero value to
zero (the *zero-point problem* of Li et al. 2023: a second moment rounded to 0 divides the
update by ``eps`` alone). Code 0 of every map decodes to exactly 0; padding holds it.

``"int4"`` encodes by exact round-to-nearest (ties to the smaller code) in a handful of
element-wise ops: the top 16 bits of an element's fp32 pattern index a 65536-entry table giving the
nearest code at the low end of that bit cell and the one midpoint inside it, if any (every
cell of these maps holds at most one: checked when a map is built).
"""

from __future__ import annotations

import functools
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from functional_optim._lowbit import minifloat

__all__ = ["KINDS", "CodeMap", "Kind", "code_map", "decode_codes", "encode_normalised"]

Kind = Literal["int8", "int4", "fp8"]
KINDS: tuple[str, ...] = ("int8", "int4", "fp8")

_FP8_MAX = 448.0


class CodeMap(NamedTuple):
    """One map: its sorted values and the 16-bit-cell encoder tables.

    Attributes:
        kind: ``"int8"``, ``"int4"`` or ``"fp8"``.
        signed: whether negative values are coded.
        bits: bits per code (4 codes are packed two to a byte).
        table: the value of each code (int4: ascending from zero, then the negative values,
            then zero again; int8 and fp8: by bit pattern), on CPU in fp32.
        zero: the code of exact zero (0 in every map).
        base: ``int32[65536]``: the code of a cell's low end (int4; empty otherwise).
        split: ``float32[65536]``: the midpoint inside a cell, ``inf`` when none (int4).
    """

    kind: str
    signed: bool
    bits: int
    table: Tensor
    zero: int
    base: Tensor
    split: Tensor

    def encode(self, x: Tensor) -> Tensor:
        """Codes (``uint8``, one per element, unpacked) of ``x`` normalised to ``[-1, 1]``."""
        if self.kind == "int8":
            return minifloat.encode(x, self.signed)
        return encode_normalised(
            x, _on(self.base, x.device), _on(self.split, x.device), self.kind == "fp8"
        )

    def decode(self, codes: Tensor) -> Tensor:
        """The normalised fp32 values of ``codes`` (``uint8``, unpacked)."""
        if self.kind == "int8":
            return minifloat.decode(codes, self.signed)
        return decode_codes(codes, _on(self.table, codes.device), self.kind == "fp8")


def encode_normalised(x: Tensor, base: Tensor, split: Tensor, fp8: bool) -> Tensor:
    """The nearest codes (``uint8``) of ``x`` in ``[-1, 1]``, from a map's cell tables (see
    the module docstring; fp8: torch's round-to-nearest-even cast)."""
    if fp8:
        return (x * _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    cell = [((x.view(torch.int32) >> 16) + 32768).to(torch.int64)]
    low: Tensor = torch.ops.aten._unsafe_index(base, cell)  # cells are in range by construction
    above: Tensor = x > torch.ops.aten._unsafe_index(split, cell)
    return (low + above.to(torch.int32)).to(torch.uint8)


def decode_codes(codes: Tensor, table: Tensor, fp8: bool = False) -> Tensor:
    """The normalised fp32 values of ``codes`` (``uint8``, unpacked): ``table[codes]``; fp8
    by torch's conversion (the same values as its table, without a gather)."""
    if fp8:
        return codes.view(torch.float8_e4m3fn).to(torch.float32) / _FP8_MAX
    values: Tensor = torch.ops.aten._unsafe_index(table, [codes.to(torch.int64)])
    return values


_DEVICE_COPIES: dict[tuple[int, torch.device], Tensor] = {}


def _on(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``, copied once per device."""
    if t.device == device:
        return t
    key = (id(t), device)
    copy = _DEVICE_COPIES.get(key)
    if copy is None:
        copy = _DEVICE_COPIES[key] = t.to(device)
    return copy


#: FP4 E2M1's magnitudes (the OCP microscaling format), normalised to 1
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _dynamic_values(bits: int, signed: bool) -> list[float]:
    """The map's values (with 0), ascending: dynamic exponent, or E2M1 for signed 4-bit."""
    magnitude_bits = bits - int(signed)
    values = [0.0]
    if bits == 4 and signed:
        values = [v / 6.0 for v in _E2M1]
    else:
        for z in range(magnitude_bits):
            steps = 2 ** (magnitude_bits - 1 - z)
            values += [10.0**-z * (0.1 + 0.9 * (f + 1) / steps) for f in range(steps)]
    values = sorted(values)
    if signed:
        values = [-v for v in reversed(values[1:])] + values
    return values


def _cell_tables(table: Tensor, zero: int, avoid_zero: bool) -> tuple[Tensor, Tensor]:
    """The encoder's ``base`` / ``split`` tables for the ascending ``table``."""
    keys = torch.arange(65536, dtype=torch.int64) - 32768
    lo_bits = (keys << 16).to(torch.int32)
    ends = torch.stack([lo_bits.view(torch.float32), (lo_bits | 0xFFFF).view(torch.float32)])
    sign = torch.where(keys < 0, -1.0, 1.0)  # inf / nan cells: the extreme code of the sign
    ends = torch.where(ends.isfinite(), ends, sign).clamp(-1.0, 1.0)
    low, high = ends.min(0).values, ends.max(0).values
    ids = torch.arange(len(table))
    if avoid_zero:  # non-zero values never round to zero
        ids = ids[ids != zero]
    values = table[ids]

    def nearest(x: Tensor) -> Tensor:  # ties go to the smaller code
        right = torch.searchsorted(values, x).clamp(1, len(values) - 1)
        left = right - 1
        go_right = (x - values[right]).abs() < (x - values[left]).abs()
        return ids[torch.where(go_right, right, left)]

    c_low, c_high = nearest(low), nearest(high)
    if avoid_zero:  # the cells of +-0 (and denormals) keep exact zero
        c_low[keys == 0] = c_high[keys == 0] = zero
        c_low[keys == -32768] = c_high[keys == -32768] = zero
    if bool((c_high - c_low > 1).any()):
        raise AssertionError("a 16-bit cell holds two midpoints of this code map")
    split = torch.full((65536,), float("inf"))
    two = c_high > c_low
    split[two] = (table[c_low[two]] + table[c_high[two]]) / 2
    return c_low.to(torch.int32), split


@functools.cache
def code_map(kind: str, signed: bool) -> CodeMap:
    """The (cached) code map of ``kind`` for signed or non-negative values.

    Args:
        kind: ``"int8"``, ``"int4"`` or ``"fp8"``.
        signed: code negative values (first moments) or not (second moments: then a non-zero
            value never rounds to zero).
    """
    empty = torch.empty(0)
    if kind == "int8":
        table = minifloat.values(signed)
        return CodeMap(kind, signed, 8, table, 0, empty.to(torch.int32), empty)
    if kind == "fp8":
        table = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        table = table.view(torch.float8_e4m3fn).to(torch.float32) / _FP8_MAX
        table = torch.nan_to_num(table, nan=0.0)
        return CodeMap(kind, True, 8, table, 0, empty.to(torch.int32), empty)
    ascending = torch.tensor(_dynamic_values(4, signed), dtype=torch.float32)
    zero = int((ascending == 0).nonzero()[0])
    base, split = _cell_tables(ascending, zero, avoid_zero=not signed)
    # Rotate so that code 0 is exact zero (padding is all-zero bytes, and pieces of one
    # parameter join by OR); the step from the largest negative value up to zero lands on
    # code n, a second zero appended to the table.
    table = ascending
    if zero:
        table = torch.cat([ascending.roll(-zero), ascending.new_zeros(1)])
        base = (base - zero) % len(ascending)
    return CodeMap(kind, signed, 4, table, 0, base.to(torch.int32), split)
