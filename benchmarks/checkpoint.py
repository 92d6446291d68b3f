"""Benchmark: optimizer checkpoint, consolidate + save on rank 0 vs sharded parallel save.

Two gloo ranks, Adam state of a model of many mid-sized layers after one step:

- torch: ``ZeroRedundancyOptimizer.consolidate_state_dict(0)`` then ``torch.save`` on rank 0;
- flat, streamed: our streaming consolidation (values received straight into the result on the
  CPU) then ``torch.save``;
- sharded: :func:`dist_runtime.sharded_checkpoint.save_optimizer_shards`, every rank writing its
  own shard with torch.distributed.checkpoint, then the atomic ``LATEST`` switch.

Reported: wall time (slowest rank) and peak extra resident memory on rank 0 during the
operation (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS``
before; first run in a fresh pair of processes per method), time the median over repetitions.

Usage: ``python benchmarks/checkpoint.py [--quick]``; ``main(argv) -> str`` returns the markdown.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

# benchmarks/ is on sys.path when run as a script or by run_all.py.
from _harness import WORLD_SIZE, benchmark_parser, emit, spawn, table


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def _measure(fn: Callable[[], object]) -> tuple[float, float]:
    """``(seconds, peak extra bytes)`` of ``fn`` in this process."""
    import torch.distributed as dist

    dist.barrier()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass
    before = _status("VmRSS:")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds, float(_status("VmHWM:") - before)


def _model(numel: int, layers: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.randn(numel // layers, generator=gen, requires_grad=True) for _ in range(layers)
    ]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return params


def _bench(rank: int, method: str, numel: int, layers: int, reps: int, root: str) -> list[float]:
    """``[median seconds, peak extra bytes of the first (cold) run]`` of one method."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    from dist_runtime.flat_shards import FlatShards
    from dist_runtime.sharded_checkpoint import save_optimizer_shards
    from dist_runtime.streaming_consolidation import consolidate_piece_states

    params = _model(numel, layers)
    fn: Callable[[], object]
    if method == "torch":
        zero = TorchZeRO(params, torch.optim.Adam, lr=1e-3)
        zero.step()

        def fn() -> None:
            zero.consolidate_state_dict(0)
            if rank == 0:
                torch.save(zero.state_dict(), os.path.join(root, "torch.pt"))

    else:
        shards = FlatShards(params)
        opt = torch.optim.Adam(shards.local_param_groups([{"params": params}]), lr=1e-3)
        shards.attach_local_grads()
        opt.step()
        if method == "sharded":

            def fn() -> None:
                save_optimizer_shards(
                    os.path.join(root, "sharded"),
                    opt,
                    shards.piece_info,
                    params,
                    [{"params": params}],
                )

        else:

            def fn() -> None:
                state = consolidate_piece_states(opt, shards.piece_info, to=0)
                if rank == 0:
                    torch.save({"state": state}, os.path.join(root, "streamed.pt"))

    # Memory from the first run: the allocator keeps freed pages, so later runs look free.
    runs = [_measure(fn) for _ in range(reps)]
    return [statistics.median(r[0] for r in runs), runs[0][1]]


METHODS = {
    "sharded": "sharded save (flat, DCP, every rank writes its shard)",
    "streamed": "flat: streaming consolidate + torch.save on rank 0",
    "torch": "torch: consolidate_state_dict + torch.save on rank 0",
}


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown table."""
    args = benchmark_parser(__doc__).parse_args(argv)
    numel, layers, reps = (4 << 20, 16, 2) if args.quick else (32 << 20, 64, 5)
    root = tempfile.mkdtemp(prefix="ckpt-bench-")
    results: dict[str, list[list[float]]] = {}
    try:
        for method in METHODS:
            results[method] = spawn(
                _bench, method, numel, layers, reps, root, timeout_s=120 if args.quick else 600
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    torch_s = max(r[0] for r in results["torch"])
    lines = [
        f"### Adam checkpoint of {numel / 1e6:.1f}M params ({layers} layers), {WORLD_SIZE} gloo "
        f"ranks, median of {reps}",
        "",
    ]
    rows = []
    for method, label in METHODS.items():
        seconds = max(r[0] for r in results[method])
        peak = results[method][0][1] / 1e6
        rows.append([label, f"{seconds:.3f}", f"{seconds / torch_s:.2f}", f"{peak:.1f}"])
    headers = ("method", "time s (slowest rank)", "vs torch", "peak extra MB on rank 0")
    return emit(lines + table(headers, rows, "lrrr"))


if __name__ == "__main__":
    main()
