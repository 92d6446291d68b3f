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

import argparse
import os
import queue
import socket
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD_SIZE = 2
NUM_PARAMS = 50
PARAM_NUMEL = 100_000
TRAINERS = 4

# -- spawning -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _entry(rank: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed import rpc

    torch.set_num_threads(1)
    try:
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120, num_worker_threads=16
        )
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD_SIZE, rpc_backend_options=options)  # type: ignore[no-untyped-call]
        value = fn(rank, *args) if rank == 0 else None
        rpc.shutdown(graceful=True, timeout=120)
        out.put((rank, "ok", value))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _spawn(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Run ``fn(0, *args)`` on rank 0 of a fresh 2-rank RPC world; kill everything on timeout."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(rank, port, fn, args, out), daemon=True)
        for rank in range(WORLD_SIZE)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < WORLD_SIZE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout_s:.0f} s")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and out.empty():
                    raise RuntimeError(f"benchmark ranks {dead} died") from None
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
    return results[0]


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
    return {impl: statistics.median(t) * 1e3 for impl, t in times.items()}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (< 60 s)")
    args = parser.parse_args(argv)
    reps, conc_steps = (15, 8) if args.quick else (100, 50)
    results = _spawn(_run, reps, conc_steps, timeout_s=120 if args.quick else 900)
    lines = [
        f"### DistributedOptimizer.step over RPC: {NUM_PARAMS} x {PARAM_NUMEL // 1000}k-float "
        f"params on 1 remote worker, {WORLD_SIZE} ranks",
        "",
        f"Latency: median of {reps} steps. Throughput: {TRAINERS} trainer threads x "
        f"{conc_steps} steps on the same params (torch's TorchScript path does not lock them).",
        "",
        "| optimizer / path | ours (ms) | torch (ms) | latency ratio | ours steps/s "
        "| torch steps/s | throughput ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, res in results.items():
        lat, thr = res["latency_ms"], res["steps_per_s"]
        lines.append(
            f"| {case} | {lat['ours']:.2f} | {lat['torch']:.2f} | {lat['ours'] / lat['torch']:.2f} "
            f"| {thr['ours']:.0f} | {thr['torch']:.0f} | {thr['ours'] / thr['torch']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
