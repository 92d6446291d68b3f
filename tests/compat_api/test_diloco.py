"""DiLoCo-family averagers: exactness against PeriodicModelAverager and a float64 reference,
the streaming schedule, compression bounds, bitwise resume, the two-level form, bad input."""

from __future__ import annotations

import io
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier

import functional_optim as fo
from compat_api.algorithms.model_averaging import (
    DiLoCoAverager,
    HierarchicalDiLoCoAverager,
    slowmo_averager,
)
from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer
from dist_runtime.compression import INT4_BLOCK, INT8_BLOCK
from dist_runtime.fragment_plan import due_fragments, fragment_offsets
from tests._world import World
from tests.compat_api._diloco_reference import (
    CONFIGS,
    FP32_ULP,
    SHAPES,
    STEPS,
    init_params,
    inner_step,
    make_outer,
    reference,
)

pytestmark = pytest.mark.distributed


def _make_params() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(t.clone()) for t in init_params()]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def _trajectory(
    rank: int, world_size: int, make: Callable[..., Any], steps: int = STEPS, start: bool = False
) -> list[list[torch.Tensor]]:
    params = _make_params()
    averager = make(params) if start else make()
    out = []
    for step in range(steps):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        averager.average_parameters(params)
        out.append([p.detach().clone() for p in params])
    return out


def _run_config(rank: int, world_size: int, name: str) -> list[list[torch.Tensor]]:
    spec, kwargs = CONFIGS[name]
    kwargs = dict(kwargs)
    start = kwargs.pop("start", False)

    def make(params: Any = None) -> DiLoCoAverager:
        return DiLoCoAverager(make_outer(spec), params=params, **kwargs)

    return _trajectory(rank, world_size, make, start=start)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "sgd lr 1"])
def test_matches_float64_reference(world2: World, name: str) -> None:
    ours = world2.run(_run_config, name)
    expected = reference(name, 2)
    for step in range(STEPS):
        for rank in range(2):
            for got, want in zip(ours[rank][step], expected[step][rank], strict=True):
                torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    # Not trivial: the ranks drift apart between syncs.
    equal = [torch.equal(ours[0][s][0], ours[1][s][0]) for s in range(STEPS)]
    assert not all(equal)


def _per_sync_ulps(
    rank: int,
    world_size: int,
    make_ours: Callable[[], Any],
    make_theirs: Callable[[], Any],
    outer_sync: Callable[[int], bool],
) -> list[float]:
    """Per step: max |ours - theirs| in ulps of max(|x_r| over ranks, |s|), same inputs to both.

    ``s`` is the synced copy: our output at the last step where ``outer_sync(step)``.

    Both averagers get the same local parameters at every step (ours' trajectory), so the gap is
    the rounding of one sync, not rounding carried through later inner steps.
    """
    ours, theirs = _make_params(), _make_params()
    our_avg, their_avg = make_ours(), make_theirs()
    worst = []
    synced = torch.cat([p.detach().reshape(-1) for p in ours])
    for step in range(STEPS):
        with torch.no_grad():
            for p, q in zip(ours, theirs, strict=True):
                inner_step(p, rank, step)
                q.copy_(p)
        local = torch.cat([p.detach().reshape(-1) for p in ours])
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, local)
        our_avg.average_parameters(ours)
        their_avg.average_parameters(theirs)
        a = torch.cat([p.detach().reshape(-1) for p in ours])
        b = torch.cat([p.detach().reshape(-1) for p in theirs])
        scale = torch.stack([g.abs() for g in gathered] + [synced.abs(), b.abs()])
        scale = scale.amax(dim=0).clamp_min(2.0**-126)
        ulp = torch.exp2(torch.floor(torch.log2(scale))) * FP32_ULP
        worst.append(float(((a - b).abs() / ulp).max()))
        if outer_sync(step):
            synced = a
    return worst


def _run_pair_with_periodic(rank: int, world_size: int) -> list[float]:
    spec, kwargs = CONFIGS["sgd lr 1"]
    return _per_sync_ulps(
        rank,
        world_size,
        lambda: DiLoCoAverager(make_outer(spec), **kwargs),
        lambda: torch_averagers.PeriodicModelAverager(
            period=kwargs["period"], warmup_steps=kwargs["warmup_steps"]
        ),
        lambda step: step >= 2 and (step - 2) % 3 == 0,
    )


#: Bound of one sync with outer SGD lr 1: the round trip s - (s - mean), in ulps of max(|x|, |s|).
ROUND_TRIP_ULPS = 4.0


def test_sgd_lr_one_equals_periodic_model_averager(world2: World) -> None:
    # s - (s - mean): the pseudo-gradient round trip costs a few ulp, not bitwise equality.
    for worst in world2.run(_run_pair_with_periodic):
        assert max(worst) <= ROUND_TRIP_ULPS, worst
        assert worst[:2] == [0.0, 0.0]  # warm-up: neither averages
        assert worst[2] == 0.0  # the first sync is the same plain average


def _run_hier_pair(rank: int, world_size: int, group_size: int) -> list[float]:
    return _per_sync_ulps(
        rank,
        world_size,
        lambda: HierarchicalDiLoCoAverager(
            fo.sgd(lr=1.0), period=4, intra_period=2, intra_group_size=group_size
        ),
        lambda: torch_hier.HierarchicalModelAverager(OrderedDict([(2, group_size), (4, 2)])),
        lambda step: step % 4 == 0,
    )


@pytest.mark.parametrize("group_size", [1, 2])
def test_two_level_sgd_lr_one_equals_hierarchical_averager(world2: World, group_size: int) -> None:
    for worst in world2.run(_run_hier_pair, group_size):
        assert max(worst) <= ROUND_TRIP_ULPS, worst


# -- streaming: every parameter once per period --------------------------------------------------


def _run_streaming_bytes(rank: int, world_size: int) -> dict[str, Any]:
    params = _make_params()
    averager = DiLoCoAverager(period=6, fragments=3, warmup_steps=1)
    bytes_after, same_after = [], []
    for step in range(2 + 6 * 3):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        averager.average_parameters(params)
        bytes_after.append(averager.bytes_communicated)
        gathered = [torch.cat([p.detach().reshape(-1) for p in params]) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, gathered[rank].clone())
        sizes = [p.numel() for p in params]
        pairs = zip(gathered[0].split(sizes), gathered[1].split(sizes), strict=True)
        same_after.append([bool(torch.equal(a, b)) for a, b in pairs])
    return {"bytes": bytes_after, "same": same_after, "plan": averager.fragment_plan}


def test_streaming_sends_each_parameter_once_per_period(world2: World) -> None:
    result = world2.run(_run_streaming_bytes)[0]
    sizes = [math.prod(shape) * 4 for shape in SHAPES]
    plan = result["plan"]
    assert sorted(i for frag in plan for i in frag) == list(range(len(SHAPES)))
    assert len(plan) == 3
    frag_bytes = [sum(sizes[i] for i in frag) for frag in plan]
    assert result["bytes"][1] == sum(sizes)  # the initial average
    offsets = fragment_offsets(6, 3)
    for period in range(3):
        window = range(2 + 6 * period, 2 + 6 * (period + 1))
        sent = [result["bytes"][s] - result["bytes"][s - 1] for s in window]
        assert sum(sent) == sum(sizes)  # every parameter exactly once in any period
        for s, b in zip(window, sent, strict=True):
            due = due_fragments(s - 1, 6, offsets)
            assert b == sum(frag_bytes[f] for f in due)
            # Right after its sync a fragment is identical on both ranks; the others are not.
            for f, frag in enumerate(plan):
                assert all(result["same"][s][i] for i in frag) == (f in due), (s, f)


# -- compression -----------------------------------------------------------------------------------


def _run_compressed_first_sync(
    rank: int, world_size: int, compression: str
) -> tuple[list[Any], list[Any], list[Any], int]:
    params = _make_params()
    averager = DiLoCoAverager(fo.sgd(lr=1.0), period=3, compression=compression)
    exact = DiLoCoAverager(fo.sgd(lr=1.0), period=3)
    twin = _make_params()
    deltas = []
    for step in range(4):
        with torch.no_grad():
            for p, q in zip(params, twin, strict=True):
                inner_step(p, rank, step)
                inner_step(q, rank, step)
        if step == 3:  # the first outer sync: this rank's pseudo-gradient, for the bound
            deltas = [
                (s - p.detach()).clone()
                for s, p in zip(averager._sync.fragments[0].synced_views, params, strict=True)  # type: ignore[union-attr]
            ]
        averager.average_parameters(params)
        exact.average_parameters(twin)
    bytes_sent = averager.bytes_communicated
    return (
        [p.detach().clone() for p in params],
        [p.detach().clone() for p in twin],
        deltas,
        bytes_sent,
    )


def _codec_bound(compression: str, delta: torch.Tensor) -> torch.Tensor:
    flat = delta.reshape(-1)
    if compression == "bf16":
        return flat.abs() * 2.0**-8
    block, levels = (INT8_BLOCK, 254) if compression == "int8" else (INT4_BLOCK, 14)
    n_blocks = -(-flat.numel() // block)
    padded = torch.zeros(n_blocks * block)
    padded[: flat.numel()] = flat.abs()
    absmax = padded.view(n_blocks, block).amax(dim=1)
    return absmax.repeat_interleave(block)[: flat.numel()] / levels


@pytest.mark.parametrize("compression", ["bf16", "int8", "int4"])
def test_compressed_sync_within_codec_bound(world2: World, compression: str) -> None:
    results = world2.run(_run_compressed_first_sync, compression)
    (ours0, exact0, d0, _), (ours1, _, d1, _) = results
    sizes = [math.prod(shape) for shape in SHAPES]
    # the codec's blocks run over the parameters laid end to end
    flat0, flat1 = (torch.cat([d.reshape(-1) for d in ds]) for ds in (d0, d1))
    bounds = ((_codec_bound(compression, flat0) + _codec_bound(compression, flat1)) / 2).split(
        sizes
    )
    for i in range(len(SHAPES)):
        assert torch.equal(ours0[i], ours1[i])  # every rank decodes the same mean
        bound = bounds[i]
        err = (ours0[i] - exact0[i]).reshape(-1).abs()
        assert bool((err <= bound + 8 * FP32_ULP * exact0[i].abs().reshape(-1) + 1e-12).all())
        assert float(err.max()) > 0 or sizes[i] < 3  # compression does lose something
    bytes_sent = results[0][3]
    numel = sum(sizes)
    payload = {
        "bf16": 2 * numel,
        "int8": numel + 4 * -(-numel // INT8_BLOCK),
        "int4": -(-numel // 2) + 4 * -(-numel // INT4_BLOCK),
    }[compression]
    assert bytes_sent == 4 * numel + payload  # the initial float32 average, then the payload


# -- state_dict / load_state_dict: bitwise resume --------------------------------------------------


def _run_resume(rank: int, world_size: int, kwargs: dict[str, Any]) -> tuple[Any, Any, int]:
    def make() -> Any:
        # Transforms are closures (not picklable): the outer optimizer travels as a spec.
        spec = kwargs.get("outer_spec")
        outer = None if spec is None else make_outer(spec)
        rest = {k: v for k, v in kwargs.items() if k not in ("outer_spec", "two_level")}
        cls = HierarchicalDiLoCoAverager if kwargs.get("two_level") else DiLoCoAverager
        return cls(outer, **rest)

    straight = _trajectory(rank, world_size, make)[-1]
    params = _make_params()
    averager = make()
    cut = 7
    for step in range(cut):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        averager.average_parameters(params)
    buffer = io.BytesIO()
    torch.save(averager.state_dict(), buffer)
    saved_params = [p.detach().clone() for p in params]
    bytes_at_cut = averager.bytes_communicated
    del averager
    buffer.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.bytes_communicated == bytes_at_cut
    params = _make_params()
    with torch.no_grad():
        for p, saved in zip(params, saved_params, strict=True):
            p.copy_(saved)
    for step in range(cut, STEPS):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        resumed.average_parameters(params)
    return straight, [p.detach().clone() for p in params], resumed.step


RESUME_CASES = {
    "diloco": {"period": 3, "warmup_steps": 1},
    "int8 overlap fragments": {
        "period": 4,
        "fragments": 2,
        "overlap": True,
        "compression": "int8",
    },
    "bf16 slowmo": {"outer_spec": ("heavy", 1.0, 0.5), "period": 3, "compression": "bf16"},
    "two-level": {"two_level": True, "period": 4, "intra_period": 2, "intra_group_size": 2},
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_is_bitwise(world2: World, case: str) -> None:
    for straight, resumed, step in world2.run(_run_resume, RESUME_CASES[case]):
        assert step == STEPS
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


# -- with PostLocalSGDOptimizer and the post-local SGD hook ----------------------------------------


def _run_with_post_local_sgd(rank: int, world_size: int) -> tuple[list[bool], int, int]:
    from torch.nn.parallel import DistributedDataParallel

    from compat_api.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ddp = DistributedDataParallel(model)
    state = PostLocalSGDState(
        None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False
    )
    ddp.register_comm_hook(state, post_localSGD_hook)
    averager = slowmo_averager(period=3, warmup_steps=2)
    optimizer = PostLocalSGDOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), averager)
    gen = torch.Generator().manual_seed(rank)
    synced = []
    for _ in range(9):
        optimizer.zero_grad()
        ddp(torch.randn(4, 6, generator=gen)).square().mean().backward()
        optimizer.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        other = flat.clone()
        torch.distributed.broadcast(other, src=0)
        synced.append(bool(torch.equal(flat, other)))
    return synced, averager.step, optimizer.state_dict()["step"]


def test_drives_post_local_sgd_optimizer_and_hook(world2: World) -> None:
    synced, step, saved_step = world2.run(_run_with_post_local_sgd)[1]
    assert step == saved_step == 9
    # DDP keeps ranks equal during warm-up (steps 0, 1) and the first sync (2); then local steps
    # drift apart and every third step the outer sync brings them together.
    assert synced == [True, True, True, False, False, True, False, False, True]


# -- bad input ------------------------------------------------------------------------------------

BAD_ARGS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "period 0": ({"period": 0}, ValueError, "period"),
    "negative warmup": ({"period": 2, "warmup_steps": -1}, ValueError, "warmup_steps"),
    "fragments 0": ({"period": 2, "fragments": 0}, ValueError, "fragments"),
    "unknown compression": ({"period": 2, "compression": "fp8"}, ValueError, "'fp8'"),
    "delay not below period": (
        {"period": 2, "overlap": True, "overlap_delay": 2},
        ValueError,
        "overlap_delay",
    ),
    "delay 0 with overlap": (
        {"period": 2, "overlap": True, "overlap_delay": 0},
        ValueError,
        "overlap_delay",
    ),
    "alpha above 1": (
        {"period": 2, "overlap": True, "overlap_alpha": 1.5},
        ValueError,
        "overlap_alpha",
    ),
    "outer not a transform": (
        {"outer": torch.optim.SGD, "period": 2},
        TypeError,
        "GradientTransformation",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_raise_before_building(case: str) -> None:
    # No process group here: the checks come before anything is built.
    kwargs, error, words = BAD_ARGS[case]
    with pytest.raises(error, match=words):
        DiLoCoAverager(**kwargs)


def _too_many_fragments(rank: int, world_size: int) -> tuple[str, int, bool, int]:
    params = _make_params()
    before = [p.detach().clone() for p in params]
    averager = DiLoCoAverager(period=2, fragments=len(params) + 1)
    try:
        averager.average_parameters(params)
        message = ""
    except ValueError as exc:
        message = str(exc)
    unchanged = all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    return message, averager.step, unchanged, averager.bytes_communicated


def _bad_two_level(rank: int, world_size: int) -> list[str]:
    messages = []
    for kwargs in (
        {"period": 4, "intra_period": 4, "intra_group_size": 1},
        {"period": 4, "intra_period": 0, "intra_group_size": 1},
        {"period": 4, "intra_period": 2, "intra_group_size": 3},
    ):
        try:
            HierarchicalDiLoCoAverager(**kwargs)
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_more_fragments_than_params_raises_before_anything_is_built(world2: World) -> None:
    message, step, unchanged, sent = world2.run(_too_many_fragments)[0]
    assert "``fragments`` (7) exceeds the number of parameters to average (6)" in message
    assert (step, unchanged, sent) == (0, True, 0)
    messages = world2.run(_bad_two_level)[0]
    assert "intra_period" in messages[0]
    assert "intra_period" in messages[1]
    assert "group_size" in messages[2]


# -- params= at construction: the start copy instead of an initial average -----------------------


def _run_start_copy(rank: int, world_size: int, same_start: bool) -> dict[str, Any]:
    params = _make_params()
    if not same_start:
        with torch.no_grad():
            for p in params:
                p.add_(0.25 * rank)
    averager = DiLoCoAverager(fo.sgd(lr=1.0), period=3, params=params)
    after_build = averager.bytes_communicated
    start = [p.detach().clone() for p in params]
    sent, before_sync = [], []
    for step in range(4):
        with torch.no_grad():
            for p in params:
                inner_step(p, rank, step)
        before_sync = [p.detach().clone() for p in params]
        averager.average_parameters(params)
        sent.append(averager.bytes_communicated)
    mean = [t.clone() for t in before_sync]
    for t in mean:
        torch.distributed.all_reduce(t)
        t.div_(world_size)
    return {
        "after_build": after_build,
        "start": start,
        "sent": sent,
        "final": [p.detach().clone() for p in params],
        "mean": mean,
    }


@pytest.mark.parametrize("same_start", [True, False], ids=["same start", "different starts"])
def test_start_copy_replaces_the_initial_average(world2: World, same_start: bool) -> None:
    results = world2.run(_run_start_copy, same_start)
    sizes = sum(math.prod(shape) * 4 for shape in SHAPES)
    checksums = 4 * 8 * len(SHAPES)  # two int64 checksums per tensor and their complements
    for r in results:
        # Identical replicas cost only the checksums; different ones are averaged once.
        assert r["after_build"] == checksums + (0 if same_start else sizes)
        # No sync at the first call: the first one is a period (3 calls) after the start copy.
        assert r["sent"] == [r["after_build"]] * 3 + [r["after_build"] + sizes]
        for got, want in zip(r["final"], r["mean"], strict=True):  # outer sgd lr 1: the mean
            torch.testing.assert_close(got, want, rtol=0, atol=8 * FP32_ULP * want.abs().max())
    for a, b in zip(results[0]["start"], results[1]["start"], strict=True):
        assert torch.equal(a, b)  # aligned at construction either way
    for a, b in zip(results[0]["final"], results[1]["final"], strict=True):
        assert torch.equal(a, b)


def _run_start_copy_resume(rank: int, world_size: int) -> tuple[list[Any], list[Any]]:
    def run(cut: int | None) -> list[torch.Tensor]:
        params = _make_params()
        averager = DiLoCoAverager(period=3, fragments=2, params=params)
        for step in range(STEPS):
            if step == cut:  # resume into an averager built without params
                state = averager.state_dict()
                averager = DiLoCoAverager(period=3, fragments=2)
                averager.load_state_dict(state)
            with torch.no_grad():
                for p in params:
                    inner_step(p, rank, step)
            averager.average_parameters(params)
        return [p.detach().clone() for p in params]

    return run(None), run(4)


def test_start_copy_resumes_bitwise(world2: World) -> None:
    for straight, resumed in world2.run(_run_start_copy_resume):
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


def test_start_copy_needs_no_warmup() -> None:
    params = _make_params()
    with pytest.raises(ValueError, match="warmup_steps=0"):
        DiLoCoAverager(period=3, warmup_steps=2, params=params)
