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
WARMUP = 4  # the overlapped ZeRO needs 2 iterations before it updates anything
CONFIGS = (
    "DDP + torch.optim.Adam",
    "DDP + torch ZeRO",
    "DDP + ZeRO",
    "DDP + ZeRO overlap (step)",
    "DDP + ZeRO overlap (interleaved)",
)


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


def _time_iterations(
    rank: int, width: int, depth: int, batch: int, bucket_mb: float, reps: int
) -> list[float]:
    import torch.distributed as dist

    setups = _setups(width, depth, bucket_mb)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=gen)
    times: list[list[float]] = [[] for _ in setups]
    for rep in range(WARMUP + reps):
        for i, (model, step) in enumerate(setups):
            dist.barrier()
            start = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if step is not None:
                step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= WARMUP:
                times[i].append(float(elapsed) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table (also printed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (< 60 s)")
    args = parser.parse_args(argv)
    if args.quick:
        width, depth, batch, bucket_mb, reps = 256, 6, 32, 0.25, 10
    else:
        width, depth, batch, bucket_mb, reps = 1024, 8, 64, 4.0, 40
    medians = _spawn(
        _time_iterations,
        width,
        depth,
        batch,
        bucket_mb,
        reps,
        timeout_s=120 if args.quick else 900,
    )[0]
    params = depth * (width * width + width)
    lines = [
        f"### ZeRO overlapped with DDP (gloo, world size {WORLD_SIZE}, {depth} x "
        f"Linear({width}, {width}) = {params / 1e6:.1f}M params, batch {batch}, "
        f"bucket_cap_mb={bucket_mb}, median of {reps} iterations)",
        "",
        "| configuration | ms / iteration | ratio vs DDP + torch.optim.Adam |",
        "|---|---:|---:|",
    ]
    for name, ms in zip(CONFIGS, medians):
        lines.append(f"| {name} | {ms:.2f} | {ms / medians[0]:.2f} |")
    best_overlap = min(medians[3:])
    lines += [
        "",
        f"Overlapped / not overlapped (ours): {best_overlap / medians[2]:.2f} "
        f"(step hook {medians[3] / medians[2]:.2f}, interleaved {medians[4] / medians[2]:.2f}).",
    ]
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
