"""SparseLoCoAverager: exactness against a hand-written float32 reference of SparseLoCo (top-k
per chunk, low-bit codes, decayed error feedback, outer step), byte counts, the codec's error
feedback invariant, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import functional_optim as fo
from compat_api.algorithms.model_averaging import SparseLoCoAverager
from dist_runtime.sparse_codec import TopKCodec
from tests._world import World
from tests.compat_api._diloco_reference import init_params, inner_step

STEPS = 13
# name -> (density, bits, chunk, decay, outer (kind, lr, momentum), period)
CONFIGS: dict[str, tuple[float, int, int, float, tuple[str, float, float], int]] = {
    "2 bits, sgd": (0.05, 2, 64, 0.9, ("sgd", 1.0, 0.0), 3),
    "4 bits, nesterov, no decay": (0.03, 4, 100, 1.0, ("nesterov", 0.7, 0.9), 4),
    "8 bits, one chunk": (0.02, 8, 4096, 0.95, ("sgd", 0.8, 0.0), 3),
}


def _outer(spec: tuple[str, float, float]) -> fo.GradientTransformation:
    kind, lr, momentum = spec
    return fo.sgd(lr=lr, momentum=momentum, nesterov=kind == "nesterov")


def _run(rank: int, world_size: int, name: str) -> dict[str, Any]:
    density, bits, chunk, decay, outer, period = CONFIGS[name]
    params = [torch.nn.Parameter(t.clone()) for t in init_params()]
    for p in params:
        p.grad = torch.zeros_like(p)
    averager = SparseLoCoAverager(
        _outer(outer),
        period=period,
        density=density,
        bits=bits,
        chunk=chunk,
        feedback_decay=decay,
        params=params,
    )
    start_bytes = averager.bytes_communicated
    history = []
    for step in range(STEPS):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        averager.average_parameters(params)
        history.append(torch.cat([p.detach().reshape(-1) for p in params]))
    return {"history": history, "bytes": averager.bytes_communicated - start_bytes}


def _compress(e: torch.Tensor, density: float, bits: int, chunk: int) -> torch.Tensor:
    """SparseLoCo's compression of one rank's accumulator, element by element (float32)."""
    n = e.numel()
    width = min(chunk, n)
    k = max(1, math.ceil(density * width - 1e-9))
    levels = 2 ** (bits - 1)
    out = torch.zeros(n)
    for start in range(0, n, width):
        values = e[start : start + width]
        order = sorted(range(values.numel()), key=lambda i: -abs(float(values[i])))
        chosen = order[:k]
        mags = [values[i].abs() for i in chosen]
        lo, hi = min(mags), max(mags)
        for i, mag in zip(chosen, mags, strict=True):
            span = hi - lo
            level = torch.round((mag - lo) / span * (levels - 1)) if span > 0 else mag * 0
            value = lo + level * ((hi - lo) / (levels - 1))
            out[start + i] = value if values[i] >= 0 else -value
    return out


def _reference(name: str, world_size: int) -> tuple[list[list[torch.Tensor]], int]:
    density, bits, chunk, decay, (kind, lr, momentum), period = CONFIGS[name]
    init = init_params()
    xs = [[t.clone() for t in init] for _ in range(world_size)]
    synced = torch.cat([t.reshape(-1) for t in init])
    errors = [torch.zeros_like(synced) for _ in range(world_size)]
    buf: torch.Tensor | None = None
    history = []
    syncs = 0
    for step in range(STEPS):
        for rank, x in enumerate(xs):
            for t in x:
                inner_step(t, rank, step)
        if step > 0 and step % period == 0:
            syncs += 1
            sent = []
            for rank, x in enumerate(xs):
                errors[rank] = errors[rank] * decay + (
                    synced - torch.cat([t.reshape(-1) for t in x])
                )
                sent.append(_compress(errors[rank], density, bits, chunk))
                errors[rank] = errors[rank] - sent[-1]
            mean = sent[0].clone()
            for s in sent[1:]:
                mean += s
            mean /= world_size
            update = mean
            if momentum:
                buf = mean.clone() if buf is None else momentum * buf + mean
                update = mean + momentum * buf if kind == "nesterov" else buf
            synced = synced - lr * update
            offsets = [0]
            for t in init:
                offsets.append(offsets[-1] + t.numel())
            xs = [
                [synced[a:b].view(t.shape).clone() for a, b, t in zip(offsets, offsets[1:], init)]
                for _ in xs
            ]
        history.append([torch.cat([t.reshape(-1) for t in x]) for x in xs])
    n = synced.numel()
    width = min(chunk, n)
    n_chunks = -(-n // width)
    selected = n_chunks * max(1, math.ceil(density * width - 1e-9))
    per_sync = 2 * selected + -(-selected * bits // 8) + 8 * n_chunks
    return history, syncs * per_sync


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_hand_written_reference(world2: World, name: str) -> None:
    ours = world2.run(_run, name)
    expected, expected_bytes = _reference(name, 2)
    for step in range(STEPS):
        for rank in range(2):
            torch.testing.assert_close(ours[rank]["history"][step], expected[step][rank])
    for rank in range(2):
        assert ours[rank]["bytes"] == expected_bytes
    # Not trivial: the ranks drift apart between syncs, and a sync sends a small fraction.
    assert not torch.equal(ours[0]["history"][1], ours[1]["history"][1])
    dense = sum(t.numel() for t in init_params()) * 4
    assert expected_bytes < dense * (STEPS // CONFIGS[name][5]) / 5


def test_codec_error_feedback_keeps_what_was_not_sent() -> None:
    codec = TopKCodec(0.05, bits=2, chunk=128)
    gen = torch.Generator().manual_seed(3)
    residual = torch.zeros(1000)
    sent_total, input_total = torch.zeros(1000), torch.zeros(1000)
    payload = torch.empty(codec.payload_numel(1000), dtype=torch.uint8)
    for _ in range(6):
        values = torch.randn(1000, generator=gen)
        input_total += values
        target = values.clone()
        codec.feedback_into(target, residual, payload)
        decoded = codec.decode(payload, 1000)
        sent_total += decoded
        assert int((decoded != 0).sum()) <= 8 * 7  # ceil(0.05 * 128) = 7 per chunk
    torch.testing.assert_close(sent_total + residual, input_total)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0.0}, "density"),
        ({"density": 1.5}, "density"),
        ({"density": -0.01}, "density"),
        ({"bits": 3}, "bits"),
        ({"bits": 1}, "bits"),
        ({"bits": 16}, "bits"),
        ({"chunk": 0}, "chunk"),
        ({"chunk": 2**15 + 1}, "chunk"),
        ({"feedback_decay": 1.5}, "feedback_decay"),
        ({"compression": "int8"}, "compression"),
    ],
)
def test_bad_input_raises_before_anything_is_built(kwargs: dict[str, Any], match: str) -> None:
    # No process group exists in this process: the check runs before the averager needs one.
    with pytest.raises(ValueError, match=match):
        SparseLoCoAverager(period=4, **kwargs)
    if "compression" not in kwargs:
        with pytest.raises(ValueError, match=match):
            TopKCodec(**{"density": 0.02, **kwargs})


def _run_streaming(rank: int, world_size: int) -> dict[str, Any]:
    """Two fragments, overlapped; a copy of the averager resumed from a mid-run state dict."""
    params = [torch.nn.Parameter(t.clone()) for t in init_params()]
    for p in params:
        p.grad = torch.zeros_like(p)
    kwargs: dict[str, Any] = {"period": 4, "density": 0.1, "bits": 4, "chunk": 64}
    kwargs |= {"fragments": 2, "overlap": True}
    averager = SparseLoCoAverager(params=params, **kwargs)
    resumed: dict[str, Any] = {}
    history = []
    for step in range(STEPS):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        averager.average_parameters(params)
        history.append(torch.cat([p.detach().reshape(-1) for p in params]))
        if step == 6:
            resumed["state"] = averager.state_dict()
            resumed["params"] = [p.detach().clone() for p in params]
    again = [torch.nn.Parameter(t) for t in resumed["params"]]
    for p in again:
        p.grad = torch.zeros_like(p)
    twin = SparseLoCoAverager(**kwargs)  # (``params=`` would average the drifted replicas)
    twin.load_state_dict(resumed["state"])
    replay = []
    for step in range(7, STEPS):
        with torch.no_grad():
            for p in again:
                inner_step(p, rank, step)
        twin.average_parameters(again)
        replay.append(torch.cat([p.detach().reshape(-1) for p in again]))
    synced = [f["synced"] for f in averager.state_dict()["sync"]]
    plan = averager.fragment_plan
    return {"history": history, "replay": replay, "synced": synced, "plan": plan}


@pytest.mark.distributed
def test_streaming_overlap_and_bitwise_resume(world2: World) -> None:
    ours = world2.run(_run_streaming)
    for a, b in zip(ours[0]["synced"], ours[1]["synced"], strict=True):
        assert torch.equal(a, b)  # every rank decodes the same payloads in the same order
    for rank in range(2):
        for got, want in zip(ours[rank]["replay"], ours[rank]["history"][7:], strict=True):
            assert torch.equal(got, want)
    assert len(ours[0]["plan"]) == 2
