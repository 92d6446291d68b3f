"""The float64, single-process reference of DiLoCo / Streaming DiLoCo used by test_diloco.py.

Shared pieces (parameters, a deterministic local update, the configurations) live here so that
the spawned ranks and the reference use the same formulas.
"""

from __future__ import annotations

from typing import Any

import torch

import functional_optim as fo
from dist_runtime.fragment_plan import due_fragments, fragment_offsets, plan_fragments

SHAPES = [(5, 3), (3,), (4, 4), (2,), (7,), (300,)]
STEPS = 14
INNER_LR = 0.05
FP32_ULP = 2.0**-23


def init_params(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for shape in SHAPES]


def inner_step(x: torch.Tensor, rank: int, step: int) -> None:
    """A deterministic, rank-dependent local update (the same formula in float32 and float64)."""
    x.sub_(INNER_LR * torch.sin(x * (1.0 + 0.3 * rank) + 0.1 * step))


# name -> (outer factory spec, DiLoCoAverager keyword arguments)
CONFIGS: dict[str, tuple[tuple[str, float, float], dict[str, Any]]] = {
    "diloco": (("nesterov", 0.7, 0.9), {"period": 3, "warmup_steps": 2}),
    "sgd lr 1": (("sgd", 1.0, 0.0), {"period": 3, "warmup_steps": 2}),
    # A chain has no fused step: the outer step goes through update + apply_updates.
    "diloco, chained outer": (("nesterov chain", 0.7, 0.9), {"period": 3, "warmup_steps": 2}),
    "slowmo": (("heavy", 1.0, 0.5), {"period": 4, "warmup_steps": 1}),
    "streaming 3": (("nesterov", 0.7, 0.9), {"period": 6, "fragments": 3}),
    "overlap": (
        ("nesterov", 0.7, 0.9),
        {"period": 4, "fragments": 2, "overlap": True, "overlap_delay": 1},
    ),
    # ``params=`` at construction: the start copy is the synced state, no initial average.
    "diloco from start": (("nesterov", 0.7, 0.9), {"period": 3, "start": True}),
    "streaming overlap from start": (
        ("nesterov", 0.7, 0.9),
        {"period": 4, "fragments": 2, "overlap": True, "start": True},
    ),
    "overlap delay 2 alpha 0": (
        ("nesterov", 0.7, 0.9),
        {"period": 4, "fragments": 3, "overlap": True, "overlap_delay": 2, "overlap_alpha": 0.0},
    ),
}


def make_outer(spec: tuple[str, float, float]) -> fo.GradientTransformation:
    kind, lr, momentum = spec
    if kind == "sgd":
        return fo.sgd(lr=lr)
    if kind == "nesterov chain":
        return fo.chain(fo.sgd(lr=lr, momentum=momentum, nesterov=True))
    return fo.sgd(lr=lr, momentum=momentum, nesterov=kind == "nesterov")


def reference(name: str, world_size: int) -> list[list[list[torch.Tensor]]]:
    """Float64, single process: the DiLoCo / Streaming DiLoCo formula for every rank."""
    (kind, lr, momentum), kwargs = CONFIGS[name]
    period, warmup = kwargs["period"], kwargs.get("warmup_steps", 0)
    start = kwargs.get("start", False)
    n_frag = kwargs.get("fragments", 1)
    overlap = kwargs.get("overlap", False)
    delay = kwargs.get("overlap_delay", 1) if overlap else 0
    alpha = kwargs.get("overlap_alpha", 0.5) if overlap else 0.0
    init = init_params(torch.float64)
    xs = [[t.clone() for t in init] for _ in range(world_size)]
    plan = plan_fragments([t.numel() for t in init], n_frag)
    offsets = fragment_offsets(period, n_frag)
    synced: list[torch.Tensor] | None = [t.clone() for t in init] if start else None
    bufs: dict[int, torch.Tensor] = {}
    pending: dict[int, tuple[list[torch.Tensor], int]] = {}

    def apply(frag: int, deltas: list[torch.Tensor]) -> None:
        assert synced is not None
        for i, delta in zip(plan[frag], deltas, strict=True):
            update = delta
            if momentum:
                bufs[i] = delta.clone() if i not in bufs else momentum * bufs[i] + delta
                update = delta + momentum * bufs[i] if kind != "heavy" else bufs[i]
            synced[i] = synced[i] - lr * update
            for x in xs:
                x[i] = alpha * x[i] + (1 - alpha) * synced[i]

    history = []
    for step in range(STEPS):
        for rank, x in enumerate(xs):
            for t in x:
                inner_step(t, rank, step)
        since = step - warmup
        if since == 0 and not start:
            synced = [sum(x[i] for x in xs) / world_size for i in range(len(init))]
            xs = [[s.clone() for s in synced] for _ in xs]
        elif since > 0:
            assert synced is not None
            for frag, (deltas, at) in list(pending.items()):
                if at == step:
                    del pending[frag]
                    apply(frag, deltas)
            for frag in due_fragments(since, period, offsets):
                deltas = [sum(synced[i] - x[i] for x in xs) / world_size for i in plan[frag]]
                if delay == 0:
                    apply(frag, deltas)
                else:
                    pending[frag] = (deltas, step + delay)
        history.append([[t.clone() for t in x] for x in xs])
    return history
