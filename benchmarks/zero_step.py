"""Benchmark: ZeroRedundancyOptimizer(Adam) step, ours (compat_api) vs torch's, same run.

Two gloo ranks on 127.0.0.1, spawned with a timeout. For each model and both bucket modes, one
torch ZeroRedundancyOptimizer and one of ours are built over identical copies of the model with
identical gradients; their steps alternate so that both see the same machine load.

- step: median wall time of ``step()`` (local Adam on the shard + parameter sync), the slower
  rank of each step counted (the ranks start each step together after a barrier);
- sync: median time of the parameter sync alone (``_sync_params()``) and the number of
  collectives it issues per step (summed over source ranks);
- state: optimizer-state bytes per rank after a step vs an unsharded Adam over all parameters.

Models: (a) 8 x Linear(1024, 1024); (b) skewed: one Linear(4096, 4096) (16.8M parameters)
plus 200 x Linear(24, 24).

Usage: ``python benchmarks/zero_step.py [--quick]``; ``main(argv) -> str`` returns the markdown.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD_SIZE = 2


# -- spawning -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=timedelta(seconds=120),
        )
        out.put((rank, "ok", fn(rank, *args)))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _spawn(fn: Callable[..., Any], *args: Any, timeout_s: float) -> list[Any]:
    """Run ``fn(rank, *args)`` on two fresh gloo ranks; results by rank; kill on timeout."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, port, fn, args, out)) for r in range(WORLD_SIZE)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(results) < WORLD_SIZE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout_s:.0f} s")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in procs) and out.empty():
                    time.sleep(1.0)
                    if out.empty():
                        raise RuntimeError("a benchmark rank died without reporting") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return [results[r] for r in range(WORLD_SIZE)]


# -- the measurement (runs on every rank) ---------------------------------------------------------


def _model(name: str, quick: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "uniform":
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    big = 4096
    return torch.nn.Sequential(
        torch.nn.Linear(big, big), *[torch.nn.Linear(24, 24) for _ in range(200)]
    )


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in optim.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def _time_models(
    rank: int, quick: bool, reps: int, model_names: list[str], bucket_modes: list[bool]
) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer as Ours

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer as Theirs

    rows: list[dict[str, Any]] = []
    for model_name in model_names:
        for bucket_view in bucket_modes:
            base = _model(model_name, quick)
            models = {"torch": base, "ours": _model(model_name, quick)}
            optims: dict[str, Any] = {}
            for side, cls in (("torch", Theirs), ("ours", Ours)):
                optims[side] = cls(
                    models[side].parameters(),
                    torch.optim.Adam,
                    parameters_as_bucket_view=bucket_view,
                    lr=1e-3,
                )
                gen = torch.Generator().manual_seed(1)
                for p in models[side].parameters():
                    p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            step_times: dict[str, list[float]] = {"torch": [], "ours": []}
            sync_times: dict[str, list[float]] = {"torch": [], "ours": []}
            for rep in range(reps + 1):
                order = ("torch", "ours") if rep % 2 == 0 else ("ours", "torch")
                for side in order:
                    for fn, bucket in (
                        (optims[side].step, step_times),
                        (optims[side]._sync_params, sync_times),
                    ):
                        dist.barrier()
                        start = time.perf_counter()
                        fn()
                        elapsed = torch.tensor([time.perf_counter() - start])
                        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                        if rep > 0:  # the first round allocates the optimizer state
                            bucket[side].append(float(elapsed))
            same = all(
                torch.equal(a, b)
                for a, b in zip(models["torch"].parameters(), models["ours"].parameters())
            )
            numel = sum(p.numel() for p in base.parameters())
            rows.append(
                {
                    "model": model_name,
                    "bucket_view": bucket_view,
                    "params": numel,
                    "tensors": len(list(base.parameters())),
                    "step": {k: statistics.median(v) for k, v in step_times.items()},
                    "sync": {k: statistics.median(v) for k, v in sync_times.items()},
                    "collectives": {
                        "torch": len(optims["torch"]._buckets[0]) * len(optims["torch"]._buckets)
                        if bucket_view
                        else len(list(base.parameters())),
                        "ours": len(optims["ours"]._buckets[0]) * len(optims["ours"]._buckets)
                        if bucket_view
                        else optims["ours"]._shard_broadcaster().num_collectives,
                    },
                    "state_bytes": {k: _state_bytes(o.optim) for k, o in optims.items()},
                    "unsharded_bytes": 2 * numel * 4 + len(list(base.parameters())) * 4,
                    "identical": same,
                }
            )
            del optims, models, base
    return rows


# -- report ---------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _table(per_rank: list[list[dict[str, Any]]]) -> str:
    lines = [
        "| model | params | bucket view | step torch (ms) | step ours (ms) | ratio vs torch "
        "| sync torch (ms) | sync ours (ms) | collectives torch / ours "
        "| state MiB/rank torch | ours | unsharded | same params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, row1 in zip(per_rank[0], per_rank[1]):
        mib = 2.0**20
        state = [
            f"{row['state_bytes']['torch'] / mib:.1f} / {row1['state_bytes']['torch'] / mib:.1f}",
            f"{row['state_bytes']['ours'] / mib:.1f} / {row1['state_bytes']['ours'] / mib:.1f}",
        ]
        lines.append(
            f"| {row['model']} ({row['tensors']} tensors) | {row['params'] / 1e6:.1f}M "
            f"| {row['bucket_view']} | {_ms(row['step']['torch'])} | {_ms(row['step']['ours'])} "
            f"| {row['step']['ours'] / row['step']['torch']:.2f} | {_ms(row['sync']['torch'])} "
            f"| {_ms(row['sync']['ours'])} "
            f"| {row['collectives']['torch']} / {row['collectives']['ours']} "
            f"| {state[0]} | {state[1]} | {row['unsharded_bytes'] / mib:.1f} "
            f"| {row['identical'] and row1['identical']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return the markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions (< 60 s)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per setting")
    parser.add_argument(
        "--models", default="uniform,skewed", help="comma-separated subset of uniform,skewed"
    )
    parser.add_argument(
        "--bucket-view", default="both", choices=["both", "on", "off"], help="bucket modes"
    )
    args = parser.parse_args(argv)
    reps = args.reps or (4 if args.quick else 20)
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.bucket_view]
    per_rank = _spawn(
        _time_models,
        args.quick,
        reps,
        args.models.split(","),
        modes,
        timeout_s=120 if args.quick else 900,
    )
    header = (
        f"### ZeroRedundancyOptimizer(Adam) step, world size {WORLD_SIZE}, gloo/CPU, "
        f"median of {reps}\n\n"
        "state columns: rank 0 / rank 1\n\n"
    )
    report = header + _table(per_rank)
    print(report)
    return report


if __name__ == "__main__":
    main()
