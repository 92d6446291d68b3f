"""Blockwise quantisation of runs of a flat region buffer (see :mod:`.layout`).

A state field of a group is two flat buffers: ``codes`` (``uint8``; 4-bit codes packed two to
a byte, the even element in the low nibble) and ``scales`` (fp32, one per block). These
functions read or write the run ``[start, stop)`` of whole blocks; the fp32 values of a run
exist only while its batch is stepped.

The maths of a run (:func:`decode_run`, :func:`encode_run`) is plain element-wise torch ops;
:class:`RunCodec` runs it eagerly or, for groups with many full batches, compiled with
``torch.compile`` (inductor fuses each into one or two loops). Every op is exact (gathers,
compares, shifts, max, one multiply and one divide), so both give the same bits. The
``"int8"`` runs scale as the C++ step does (:mod:`.fused_cpu`): ``decode * scale`` and
``encode(value * (1 / absmax))``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._lowbit import minifloat
from functional_optim._lowbit.codes import CodeMap, _on, decode_codes, encode_normalised

__all__ = ["RunCodec", "block_absmax", "code_bytes", "dequantize", "quantize"]


def code_bytes(elements: int, cmap: CodeMap) -> int:
    """Bytes of codes for ``elements`` elements."""
    return elements // 2 if cmap.bits == 4 else elements


class RunFormat(NamedTuple):
    """What a run's codes are: block size, 4-bit packing, map kind and sign."""

    block_size: int
    packed: bool
    kind: str
    signed: bool


def decode_run(run: Tensor, scales: Tensor, table: Tensor, fmt: RunFormat) -> Tensor:
    """The fp32 values of a run of codes (whole blocks) and its blocks' scales."""
    block_size, packed, kind, signed = fmt
    if kind == "int8":
        values = minifloat.decode(run.view(-1, block_size), signed)
        return (values * scales[:, None]).view(-1)
    if packed:
        run = torch.stack([run & 15, run >> 4], dim=1).view(-1)
    values = decode_codes(run, table, kind == "fp8")
    return (values.view(-1, block_size) * scales[:, None]).view(-1)


def encode_run(
    values: Tensor, absmax: Tensor, base: Tensor, split: Tensor, fmt: RunFormat
) -> Tensor:
    """The codes of ``values`` (whole blocks) given each block's largest magnitude."""
    block_size, packed, kind, signed = fmt
    if kind == "int8":
        scale = torch.where(absmax > 0, torch.ones_like(absmax) / absmax, 0.0)
        return minifloat.encode((values.view(-1, block_size) * scale[:, None]).view(-1), signed)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normalised = (values.view(-1, block_size) / divisor[:, None]).view(-1)
    codes = encode_normalised(normalised, base, split, kind == "fp8")
    if packed:
        pairs = codes.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return codes


def block_absmax(values: Tensor, block_size: int) -> Tensor:
    """The largest magnitude of each block of ``values`` (1-D, whole blocks)."""
    return values.view(-1, block_size).abs().amax(1)


def _quantize_run(
    values: Tensor, base: Tensor, split: Tensor, fmt: RunFormat
) -> tuple[Tensor, Tensor]:
    absmax = block_absmax(values, fmt.block_size)
    return encode_run(values, absmax, base, split, fmt), absmax


class RunCodec:
    """Decode and encode runs of one code map and block size, eagerly or compiled.

    Args:
        cmap: the code map.
        block_size: elements per block.
        compiled_run: runs of exactly this many elements go through ``torch.compile``
            (inductor, one graph); others, and every run when 0, run eagerly (the same bits).
    """

    def __init__(self, cmap: CodeMap, block_size: int, compiled_run: int) -> None:
        self.cmap, self.bs, self.compiled_run = cmap, block_size, compiled_run
        self.packed = cmap.bits == 4
        self.fmt = RunFormat(block_size, self.packed, cmap.kind, cmap.signed)
        self.per_byte = 2 if self.packed else 1
        self._decode: Any = decode_run
        self._quantize: Any = _quantize_run
        if compiled_run:
            self._decode = torch.compile(decode_run, dynamic=False, fullgraph=True)
            self._quantize = torch.compile(_quantize_run, dynamic=False, fullgraph=True)

    def dequantize(self, codes: Tensor, scales: Tensor, start: int, stop: int) -> Tensor:
        """The fp32 values of elements ``[start, stop)`` (whole blocks), a new tensor."""
        run = codes[start // self.per_byte : stop // self.per_byte]
        blocks = scales[start // self.bs : stop // self.bs]
        table = _on(self.cmap.table, codes.device)
        decode = self._decode if stop - start == self.compiled_run else decode_run
        return decode(run, blocks, table, self.fmt)

    def quantize(self, values: Tensor, codes: Tensor, scales: Tensor, start: int) -> Tensor:
        """Write the codes and scales of ``values`` (whole blocks from ``start``); returns
        each block's largest magnitude."""
        base, split = self._tables(values.device)
        fn = self._quantize if values.numel() == self.compiled_run else _quantize_run
        new, absmax = fn(values, base, split, self.fmt)
        first = start // self.bs
        scales[first : first + absmax.numel()] = absmax
        at = start // self.per_byte
        codes[at : at + new.numel()] = new
        return absmax

    def _tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if self.cmap.kind != "int4":
            return self.cmap.base, self.cmap.split
        return _on(self.cmap.base, device), _on(self.cmap.split, device)


def dequantize(
    codes: Tensor, scales: Tensor, cmap: CodeMap, block_size: int, start: int, stop: int
) -> Tensor:
    """The fp32 values of elements ``[start, stop)`` (whole blocks), as a new 1-D tensor."""
    return RunCodec(cmap, block_size, 0).dequantize(codes, scales, start, stop)


def quantize(
    values: Tensor,
    absmax: Tensor,
    cmap: CodeMap,
    codes: Tensor,
    scales: Tensor,
    block_size: int,
    start: int,
) -> None:
    """Write the codes and scales of ``values`` (whole blocks from element ``start``), given
    each block's largest magnitude ``absmax`` (already reduced over the ranks for shared
    blocks)."""
    first = start // block_size
    scales[first : first + absmax.numel()] = absmax
    base = _on(cmap.base, values.device) if cmap.kind == "int4" else cmap.base
    split = _on(cmap.split, values.device) if cmap.kind == "int4" else cmap.split
    fmt = RunFormat(block_size, cmap.bits == 4, cmap.kind, cmap.signed)
    new = encode_run(values, absmax, base, split, fmt)
    at = start // 2 if cmap.bits == 4 else start
    codes[at : at + new.numel()] = new
