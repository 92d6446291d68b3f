"""Benchmark: DistributedOptimizer.step over RPC, ours (compat_api) vs torch's, same run.

Two TensorPipe RPC ranks on 127.0.0.1, spawned with timeouts. Rank 1 owns 50 parameters of 100k
floats; rank 0 is the trainer. For SGD (momentum 0.9) and Adam, on the TorchScript path and on
the Python path (TorchScript disabled at construction, as torch decides the path there):

1. Step latency: median wall time of ``step(context_id)`` on one context whose gradients cover
   all 50 parameters; ours and torch's alternate so that both see the same machine load.
2. Concurrent throughput: 4 trainer threads on rank 0, each with its own DistributedOptimizer on
   the same 50 parameters and its own context, stepping as fast as they can: total steps/s.
   Torch's TorchScript path takes no lock here (its updates race and some are lost); ours
   serialises steps on the same parameters, so its figure is for correct updates.

Usage: ``python benchmarks/rpc_step.py [--quick]``; ``main(argv) -> str`` returns the markdown.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from _harness import WORLD_SIZE, benchmark_parser, emit, median_ms, spawn_rpc, table

NUM_PARAMS = 50
PARAM_NUMEL = 100_000
TRAINERS = 4

# -- owner side -----------------------------------------------------------------------------------

_OWNED: list[torch.Tensor] = []


def _owned_param(index: int) -> torch.Tensor:
    while len(_OWNED) <= index:
        _OWNED.append(torch.zeros(PARAM_NUMEL, requires_grad=True))
    return _OWNED[index]


def _loss(rrefs: list[Any]) -> torch.Tensor:
    return torch.stack([(rref.local_value() * 1e-3).sum() for rref in rrefs]).sum()


# -- trainer side ---------------------------------------------------------------------------------


def _make(
    impl: str, optim_cls: type, rrefs: list[Any], scripted: bool, kwargs: dict[str, Any]
) -> Any:
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

    from compat_api.optimizer import DistributedOptimizer

    cls = DistributedOptimizer if impl == "ours" else TorchDistributedOptimizer
    if scripted:
        return cls(optim_cls, rrefs, **kwargs)
    torch.jit._state.disable()
    try:
        return cls(optim_cls, rrefs, **kwargs)
    finally:
        torch.jit._state.enable()


def _backward(context_id: int, rrefs: list[Any]) -> None:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    loss = rpc.rpc_sync("worker1", _loss, args=(rrefs,))
    dist_autograd.backward(context_id, [loss])  # type: ignore[attr-defined]


def _concurrent(opts: list[Any], rrefs: list[Any], steps: int) -> float:
    """Total steps/s of one thread per optimizer, each on its own context."""
    barrier = threading.Barrier(len(opts) + 1, timeout=120)
    errors: list[BaseException] = []

    def run(opt: Any) -> None:
        import torch.distributed.autograd as dist_autograd

        try:
            with dist_autograd.context() as context_id:
                _backward(context_id, rrefs)
                barrier.wait()
                for _ in range(steps):
                    opt.step(context_id)
        except BaseException as exc:  # reported after join
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(opt,)) for opt in opts]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return len(opts) * steps / elapsed


def _latency(opts: dict[str, Any], rrefs: list[Any], reps: int) -> dict[str, float]:
    """Median step time (ms) per implementation, alternating them, after two warm-up rounds."""
    import torch.distributed.autograd as dist_autograd

    times: dict[str, list[float]] = {impl: [] for impl in opts}
    with dist_autograd.context() as context_id:
        _backward(context_id, rrefs)
        for rep in range(reps + 2):
            for impl, opt in opts.items():
                before = rrefs[0].to_here() if rep == 0 else None
                start = time.perf_counter()
                opt.step(context_id)
                if rep >= 2:
                    times[impl].append(time.perf_counter() - start)
                if before is not None and torch.equal(before, rrefs[0].to_here()):
                    raise RuntimeError(f"{impl}'s step did not update the parameters")
    return {impl: median_ms(t) for impl, t in times.items()}


def _run(rank: int, reps: int, conc_steps: int) -> dict[str, Any]:
    from torch import optim
    from torch.distributed import rpc

    rrefs = [rpc.remote("worker1", _owned_param, args=(i,)) for i in range(NUM_PARAMS)]
    results: dict[str, Any] = {}
    for name, optim_cls, kwargs in (
        ("SGD(momentum=0.9)", optim.SGD, {"lr": 1e-3, "momentum": 0.9}),
        ("Adam", optim.Adam, {"lr": 1e-3}),
    ):
        for scripted in (True, False):
            path = "TorchScript" if scripted else "Python"
            opts = {
                impl: _make(impl, optim_cls, rrefs, scripted, kwargs) for impl in ("ours", "torch")
            }
            latency = _latency(opts, rrefs, reps)
            throughput = {}
            for impl in ("ours", "torch"):
                trainers = [
                    _make(impl, optim_cls, rrefs, scripted, kwargs) for _ in range(TRAINERS)
                ]
                throughput[impl] = _concurrent(trainers, rrefs, conc_steps)
            results[f"{name} / {path}"] = {"latency_ms": latency, "steps_per_s": throughput}
    return results


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown table."""
    args = benchmark_parser(__doc__).parse_args(argv)
    reps, conc_steps = (15, 8) if args.quick else (100, 50)
    results = spawn_rpc(_run, reps, conc_steps, timeout_s=120 if args.quick else 900)[0]
    lines = [
        f"### DistributedOptimizer.step over RPC: {NUM_PARAMS} x {PARAM_NUMEL // 1000}k-float "
        f"params on 1 remote worker, {WORLD_SIZE} ranks",
        "",
        f"Latency: median of {reps} steps. Throughput: {TRAINERS} trainer threads x "
        f"{conc_steps} steps on the same params (torch's TorchScript path does not lock them).",
        "",
    ]
    rows = []
    for case, res in results.items():
        lat, thr = res["latency_ms"], res["steps_per_s"]
        rows.append(
            [
                case,
                f"{lat['ours']:.2f}",
                f"{lat['torch']:.2f}",
                f"{lat['ours'] / lat['torch']:.2f}",
                f"{thr['ours']:.0f}",
                f"{thr['torch']:.0f}",
                f"{thr['ours'] / thr['torch']:.2f}",
            ]
        )
    headers = (
        "optimizer / path",
        "ours (ms)",
        "torch (ms)",
        "latency ratio",
        "ours steps/s",
        "torch steps/s",
        "throughput ratio",
    )
    return emit(lines + table(headers, rows, "lrrrrrr"))


if __name__ == "__main__":
    main()
