"""Benchmark: ``fo.Optimizer(fo.adamw)`` step on FSDP2 (DTensor) params vs torch's AdamW.

Two gloo ranks on 127.0.0.1 (spawned with a timeout). Each rank builds FSDP2 models
(``fully_shard`` on every layer, then on the root), runs one backward so every param has a
DTensor gradient, and times the optimizer step alone, median of interleaved rounds (one step
of each contender per round, rotating order), the slower rank's median reported:

- torch AdamW ``foreach=True`` on the DTensor params;
- torch AdamW ``fused=True`` on the DTensor params;
- ``fo.Optimizer(params, fo.adamw(...))`` on the DTensor params (steps the local shards);
- the floor: torch AdamW ``fused=True`` on plain tensors of the same local shapes.

Models: 50 x Linear(512, 512) (100 tensors) and 500 x Linear(64, 64) (1000 tensors).

Usage: ``python benchmarks/dtensor_step.py [--quick]``; ``main(argv) -> str`` returns the
markdown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _harness import benchmark_parser, emit, interleaved_median_ms, spawn, table

MODELS = (("50 x Linear(512, 512)", 50, 512), ("500 x Linear(64, 64)", 500, 64))
CONTENDERS = ("torch foreach (DTensor)", "torch fused (DTensor)", "fo.adamw (DTensor)", "floor")
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _fsdp_model(layers: int, width: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model(torch.randn(2, width)).square().mean().backward()
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():  # the same normal-sized values for every contender (a deep
        # stack's backward gives denormal gradients, slow on CPU)
        local = p.grad._local_tensor  # type: ignore[union-attr]
        local.copy_(torch.randn(local.shape, generator=gen) * 1e-3)
    return model


def _steps(layers: int, width: int) -> dict[str, Callable[[], Any]]:
    import functional_optim as fo

    steps: dict[str, Callable[[], Any]] = {}
    for name in CONTENDERS[:3]:
        params = list(_fsdp_model(layers, width).parameters())
        if name.startswith("fo."):
            opt: torch.optim.Optimizer = fo.Optimizer(params, fo.adamw(**HYPER))
        else:
            fused = "fused" in name
            opt = torch.optim.AdamW(params, **HYPER, foreach=not fused, fused=fused)
        steps[name] = opt.step
    local = [p._local_tensor for p in params]  # type: ignore[attr-defined]
    plain = [torch.nn.Parameter(t.detach().clone()) for t in local]
    for p, q in zip(plain, params, strict=True):
        p.grad = q.grad._local_tensor.clone()  # type: ignore[union-attr]
    steps["floor"] = torch.optim.AdamW(plain, **HYPER, fused=True).step
    return steps


def _measure(rank: int, rounds: int) -> list[dict[str, float]]:
    del rank
    torch.set_num_threads(1)
    out = []
    for _, layers, width in MODELS:
        steps = _steps(layers, width)
        out.append(interleaved_median_ms(steps, warmup=3, repeats=rounds))
    return out


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; return the markdown report."""
    parser = benchmark_parser(__doc__, "5 rounds (< 60 s)")
    args = parser.parse_args(argv)
    rounds = 5 if args.quick else 21
    per_rank = spawn(_measure, rounds, timeout_s=600.0)
    rows = []
    for m, (label, layers, _) in enumerate(MODELS):
        slowest = {name: max(rank[m][name] for rank in per_rank) for name in CONTENDERS}
        floor = slowest["floor"]
        rows.append(
            [
                label,
                2 * layers,
                *(f"{slowest[name]:.2f}" for name in CONTENDERS),
                *(f"{slowest[name] / floor:.2f}x" for name in CONTENDERS[:3]),
            ]
        )
    headers = [
        "model",
        "tensors",
        *(f"{name} ms" for name in CONTENDERS),
        *(f"{name} / floor" for name in CONTENDERS[:3]),
    ]
    return emit(
        [
            f"## AdamW step on FSDP2 params, 2 gloo ranks (median of {rounds} interleaved "
            "rounds, slower rank)",
            "",
            *table(headers, rows, "lr" + "r" * (len(headers) - 2)),
        ]
    )


if __name__ == "__main__":
    main()
