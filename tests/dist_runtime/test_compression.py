"""dist_runtime.compression: bf16 and blockwise int8 error bounds, error feedback, payloads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dist_runtime.compression import (
    BF16_RELATIVE_ERROR,
    INT8_BLOCK,
    Bf16Codec,
    Int4BlockwiseCodec,
    Int8BlockwiseCodec,
    dequantize_int8_blockwise,
    make_codec,
    quantize_int8_blockwise,
)

FP32_EPS = 2.0**-23


def _values(seed: int, numel: int, spread: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over several decades, as pseudo-gradients of different layers are.
    scale = torch.exp(spread * torch.randn(numel, generator=gen))
    return torch.randn(numel, generator=gen) * scale


def _block_absmax(values: torch.Tensor, block: int) -> torch.Tensor:
    n_blocks = -(-values.numel() // block)
    padded = torch.zeros(n_blocks * block)
    padded[: values.numel()] = values.abs()
    absmax = padded.view(n_blocks, block).amax(dim=1)
    return absmax.repeat_interleave(block)[: values.numel()]


@given(
    st.integers(min_value=0, max_value=2**31),
    st.integers(min_value=1, max_value=3000),
    st.sampled_from([0.0, 1.0, 4.0]),
    st.sampled_from([1, 7, 64, INT8_BLOCK]),
)
def test_int8_error_is_at_most_half_a_step_of_its_block(
    seed: int, numel: int, spread: float, block: int
) -> None:
    values = _values(seed, numel, spread)
    codes, scales = quantize_int8_blockwise(values, block)
    assert codes.dtype == torch.int8
    assert codes.numel() == scales.numel() * block == -(-numel // block) * block
    assert int(codes.abs().max()) <= 127
    decoded = dequantize_int8_blockwise(codes, scales, numel)
    absmax = _block_absmax(values, block)
    bound = absmax / 254 + 2 * FP32_EPS * absmax  # half a step, plus float32 rounding
    assert bool(((decoded - values).abs() <= bound).all())
    codec = Int8BlockwiseCodec(block)  # the sync path: the same codes, written in place
    assert torch.equal(codec.decode(codec.encode(values), numel), decoded)


def test_int8_keeps_zero_blocks_and_block_maxima_exact() -> None:
    values = torch.zeros(2 * INT8_BLOCK)
    values[INT8_BLOCK + 3] = -2.5
    values[INT8_BLOCK + 4] = 1.0
    codec = Int8BlockwiseCodec()
    decoded = codec.decode(codec.encode(values), values.numel())
    assert torch.equal(decoded[:INT8_BLOCK], torch.zeros(INT8_BLOCK))
    assert float(decoded[INT8_BLOCK + 3]) == pytest.approx(-2.5, rel=1e-6)
    assert codec.payload_bytes(values.numel()) == 2 * INT8_BLOCK + 2 * 4
    assert codec.encode(values[:5]).numel() == codec.payload_bytes(5) == 5 + 4  # no padding


@given(st.integers(min_value=0, max_value=2**31), st.integers(min_value=1, max_value=2000))
def test_bf16_relative_error_bound(seed: int, numel: int) -> None:
    values = _values(seed, numel, 4.0)
    codec = Bf16Codec()
    payload = codec.encode(values)
    assert payload.dtype == torch.bfloat16
    assert codec.payload_bytes(numel) == 2 * numel
    err = (codec.decode(payload, numel) - values).abs()
    assert bool((err <= BF16_RELATIVE_ERROR * values.abs()).all())


@pytest.mark.parametrize("compression", ["bf16", "int8", "int4"])
def test_error_feedback_keeps_the_accumulated_error_within_one_round(compression: str) -> None:
    codec = make_codec(compression)
    assert codec is not None
    rounds = [_values(seed, 1000, 2.0) * 1e-3 for seed in range(50)]
    residual = None
    sent_total = torch.zeros(1000, dtype=torch.float64)
    naive_total = torch.zeros(1000, dtype=torch.float64)
    for values in rounds:
        payload, residual = codec.encode_with_feedback(values, residual)
        sent_total += codec.decode(payload, 1000).double()
        naive_total += codec.decode(codec.encode(values), 1000).double()
    true_total = torch.stack(rounds).double().sum(dim=0)
    # Telescoping: what was sent plus what is still held back is what should have been sent.
    # (float32 rounding of ``values + residual`` each round aside).
    peak = float(torch.stack(rounds).abs().max())
    fp32_slack = 2 * len(rounds) * FP32_EPS * peak
    assert residual is not None
    torch.testing.assert_close(sent_total + residual.double(), true_total, rtol=0, atol=fp32_slack)
    with_feedback = float((sent_total - true_total).abs().max())
    without = float((naive_total - true_total).abs().max())
    last_round_bound = (
        float(rounds[-1].abs().max())
        * ({"bf16": BF16_RELATIVE_ERROR * 2, "int8": 2 / 254, "int4": 2 / 14}[compression])
    )
    assert with_feedback <= last_round_bound + fp32_slack
    assert with_feedback < without / 3  # without feedback the errors pile up


def test_unknown_compression() -> None:
    assert make_codec(None) is None
    with pytest.raises(ValueError, match="Unknown compression 'fp8'"):
        make_codec("fp8")


@given(
    st.integers(min_value=0, max_value=2**31),
    st.integers(min_value=1, max_value=700),
    st.sampled_from([2, 8, 64]),
)
def test_int4_error_is_at_most_half_a_step_of_its_block(seed: int, numel: int, block: int) -> None:
    values = _values(seed, numel, 3.0)
    codec = Int4BlockwiseCodec(block)
    payload = codec.encode(values)
    assert payload.dtype == torch.int8
    assert payload.numel() == codec.payload_bytes(numel) == -(-numel // 2) + 4 * -(-numel // block)
    decoded = codec.decode(payload, numel)
    padded = torch.nn.functional.pad(values.abs(), (0, -numel % block))
    step = padded.view(-1, block).amax(1).repeat_interleave(block)[:numel] / 7
    assert bool(((decoded - values).abs() <= step / 2 * (1 + 1e-5) + 1e-30).all())
    maxima = padded.view(-1, block).argmax(1)  # each block's largest magnitude is exact
    for b, i in enumerate(maxima.tolist()):
        if b * block + i < numel and float(values[b * block + i]) != 0.0:
            assert float(decoded[b * block + i]) == pytest.approx(
                float(values[b * block + i]), rel=1e-6
            )


def test_int4_block_must_be_even() -> None:
    with pytest.raises(ValueError, match="even"):
        Int4BlockwiseCodec(3)
