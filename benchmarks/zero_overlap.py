"""Benchmark: DDP + ZeRO overlapped with the backward pass vs not overlapped vs DDP + Adam (gloo).

Two gloo ranks on 127.0.0.1, spawned with a timeout. One training iteration (``zero_grad`` +
forward + backward + optimizer step) is timed for each configuration, over identical copies of
the model and identical data:

- ``DDP + torch.optim.Adam``: plain data parallelism (the torch baseline);
- ``DDP + torch ZeRO``: torch's ZeroRedundancyOptimizer(Adam), ``step()`` after backward;
- ``DDP + ZeRO``: ours, ``step()`` after backward;
- ``DDP + ZeRO overlap (step)`` / ``(interleaved)``: ours with ``overlap_with_ddp=True`` and
  :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved` (no ``step()`` call;
  torch refuses gloo for these, so there is no torch column).

Iterations of the configurations alternate so that all see the same machine load; a barrier
starts each iteration and the slower rank's time counts. Reported: the median ms per iteration
and the ratio to ``DDP + torch.optim.Adam``. Target: overlapped <= not overlapped.

Usage: ``python benchmarks/zero_overlap.py [--quick]``; ``main(argv) -> str`` returns the
markdown table.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from _harness import (
    WORLD_SIZE,
    benchmark_parser,
    emit,
    median_ms,
    slowest_rank_seconds,
    spawn,
    table,
)

WARMUP = 4  # the overlapped ZeRO needs 2 iterations before it updates anything
CONFIGS = (
    "DDP + torch.optim.Adam",
    "DDP + torch ZeRO",
    "DDP + ZeRO",
    "DDP + ZeRO overlap (step)",
    "DDP + ZeRO overlap (interleaved)",
)


# -- the measurement (runs on every rank) ---------------------------------------------------------


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _setups(width: int, depth: int, bucket_mb: float) -> list[tuple[Any, Any]]:
    """(ddp, step function or None) per configuration, in CONFIGS order."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from compat_api.algorithms.ddp_comm_hooks import ddp_zero_hook
    from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    def ddp() -> DistributedDataParallel:
        return DistributedDataParallel(_model(width, depth), bucket_cap_mb=bucket_mb)

    setups: list[tuple[Any, Any]] = []
    plain = ddp()
    setups.append((plain, torch.optim.Adam(plain.parameters(), lr=1e-3).step))
    theirs = ddp()
    setups.append((theirs, TorchZeRO(theirs.parameters(), torch.optim.Adam, lr=1e-3).step))
    ours = ddp()
    setups.append(
        (ours, ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=1e-3).step)
    )
    for hook in (ddp_zero_hook.hook_with_zero_step, ddp_zero_hook.hook_with_zero_step_interleaved):
        overlapped = ddp()
        zero = ZeroRedundancyOptimizer(
            overlapped.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
        )
        overlapped.register_comm_hook(None, hook(default_hooks.allreduce_hook, overlapped, zero))
        setups.append((overlapped, None))
    return setups


def _iteration(model: torch.nn.Module, step: Any, x: torch.Tensor) -> None:
    """One training iteration: ``zero_grad``, forward, backward, then ``step`` unless ``None``."""
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    if step is not None:
        step()


def _time_iterations(
    rank: int, width: int, depth: int, batch: int, bucket_mb: float, reps: int
) -> list[float]:
    setups = _setups(width, depth, bucket_mb)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=gen)
    times: list[list[float]] = [[] for _ in setups]
    for rep in range(WARMUP + reps):
        for i, (model, step) in enumerate(setups):
            elapsed = slowest_rank_seconds(functools.partial(_iteration, model, step, x))
            if rep >= WARMUP:
                times[i].append(elapsed)
    return [median_ms(t) for t in times]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table (also printed)."""
    args = benchmark_parser(__doc__).parse_args(argv)
    if args.quick:
        width, depth, batch, bucket_mb, reps = 256, 6, 32, 0.25, 10
    else:
        width, depth, batch, bucket_mb, reps = 1024, 8, 64, 4.0, 40
    medians = spawn(
        _time_iterations,
        width,
        depth,
        batch,
        bucket_mb,
        reps,
        timeout_s=120 if args.quick else 900,
    )[0]
    params = depth * (width * width + width)
    best_overlap = min(medians[3:])
    return emit(
        [
            f"### ZeRO overlapped with DDP (gloo, world size {WORLD_SIZE}, {depth} x "
            f"Linear({width}, {width}) = {params / 1e6:.1f}M params, batch {batch}, "
            f"bucket_cap_mb={bucket_mb}, median of {reps} iterations)",
            "",
            *table(
                ["configuration", "ms / iteration", "ratio vs DDP + torch.optim.Adam"],
                [
                    [name, f"{ms:.2f}", f"{ms / medians[0]:.2f}"]
                    for name, ms in zip(CONFIGS, medians)
                ],
                "lrr",
            ),
            "",
            f"Overlapped / not overlapped (ours): {best_overlap / medians[2]:.2f} "
            f"(step hook {medians[3] / medians[2]:.2f}, "
            f"interleaved {medians[4] / medians[2]:.2f}).",
        ]
    )


if __name__ == "__main__":
    main()
