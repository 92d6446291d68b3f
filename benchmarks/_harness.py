"""Plumbing shared by the benchmark scripts: process worlds, timing, markdown, options.

- :func:`spawn` / :func:`spawn_rpc` start a fresh gloo process group or TensorPipe RPC world of
  ``world_size`` processes on a free 127.0.0.1 port, run a module-level function on the ranks,
  collect the per-rank results, and kill every process on timeout or error (no strays).
- :func:`slowest_rank_seconds`, :func:`median_ms`, :func:`median_call_ms`,
  :func:`interleaved_median_ms`: timing.
- :func:`table` / :func:`emit`: markdown rendering.
- :func:`benchmark_parser`: the ``--quick`` option every benchmark takes.

The module is private (``_``-prefixed), so ``run_all.py`` does not take it for a benchmark.
Scripts import it by name: ``benchmarks/`` is on ``sys.path`` when a script runs, when
``run_all.py`` imports one, and in the processes they spawn.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

WORLD_SIZE = 2
QUICK_HELP = "smoke-test sizes (< 60 s)"

# -- process worlds -------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _init_gloo(rank: int, world_size: int, port: int, timeout_s: float) -> Callable[[], None]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return dist.destroy_process_group


def _init_rpc(rank: int, world_size: int, port: int, timeout_s: float) -> Callable[[], None]:
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout_s, num_worker_threads=16
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options
    )
    return lambda: rpc.shutdown(graceful=True, timeout=timeout_s)


_BACKENDS = {"gloo": _init_gloo, "rpc": _init_rpc}


def _entry(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    on_ranks: Collection[int] | None,
    out: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        finish = _BACKENDS[backend](rank, world_size, port, timeout_s)
        value = fn(rank, *args) if on_ranks is None or rank in on_ranks else None
        finish()
        out.put((rank, "ok", value))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def _run_world(
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    timeout_s: float,
    world_size: int,
    comm_timeout_s: float,
    on_ranks: Collection[int] | None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(rank, world_size, port, backend, comm_timeout_s, fn, args, on_ranks, out),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark ranks did not finish within {timeout_s:.0f} s")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and out.empty():
                    time.sleep(1.0)  # a rank that just exited may still be flushing its result
                    if out.empty():
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
    return [results[r] for r in range(world_size)]


def spawn(
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    world_size: int = WORLD_SIZE,
    pg_timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on every rank of a fresh gloo process group.

    Args:
        fn: a module-level function (it is pickled by name into the spawned processes).
        *args: its arguments after the rank (picklable).
        timeout_s: wall-clock limit of the whole run; every process is killed after it.
        world_size: number of processes.
        pg_timeout_s: timeout of each collective.

    Returns:
        The results of ``fn`` by rank.

    Raises:
        TimeoutError: the ranks did not finish within ``timeout_s``.
        RuntimeError: a rank raised (its traceback in the message) or died.
    """
    return _run_world(
        "gloo",
        fn,
        args,
        timeout_s=timeout_s,
        world_size=world_size,
        comm_timeout_s=pg_timeout_s,
        on_ranks=None,
    )


def spawn_rpc(
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    world_size: int = WORLD_SIZE,
    rpc_timeout_s: float = 120.0,
    on_ranks: Collection[int] = (0,),
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``on_ranks`` of a fresh TensorPipe RPC world.

    Ranks are named ``worker<rank>``; the others only serve RPCs until the graceful shutdown.

    Returns:
        The results of ``fn`` by rank (``None`` for the ranks that did not run it).

    Raises:
        TimeoutError: the ranks did not finish within ``timeout_s``.
        RuntimeError: a rank raised (its traceback in the message) or died.
    """
    return _run_world(
        "rpc",
        fn,
        args,
        timeout_s=timeout_s,
        world_size=world_size,
        comm_timeout_s=rpc_timeout_s,
        on_ranks=on_ranks,
    )


# -- timing ---------------------------------------------------------------------------------------


def median_ms(seconds: Iterable[float]) -> float:
    """The median of ``seconds``, in milliseconds."""
    return 1e3 * statistics.median(seconds)


def median_call_ms(step: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Call ``step`` ``warmup`` times, then time ``repeats`` calls; the median in milliseconds."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return median_ms(times)


def interleaved_median_ms(
    steps: dict[str, Callable[[], Any]], warmup: int, repeats: int
) -> dict[str, float]:
    """Median ms of each step, timed in rounds of one call each (rotating order).

    Alternating the contenders means a change of machine load hits all of them alike, instead
    of whichever happened to run during it.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return {name: median_ms(t) for name, t in times.items()}


def slowest_rank_seconds(fn: Callable[[], Any]) -> float:
    """Time ``fn`` on every rank from a barrier; the slowest rank's seconds (a collective)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state``."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


# -- report ---------------------------------------------------------------------------------------


def _row(cells: Sequence[object]) -> str:
    return "|" + "|".join(f" {cell} " if cell != "" else " " for cell in cells) + "|"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> list[str]:
    """Markdown table lines.

    Args:
        headers: the header cells.
        rows: the body rows, cells already formatted (``str()`` is applied).
        align: one letter per column: ``l`` (``---``) or ``r`` (``---:``).
    """
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} letters for {len(headers)} columns")
    separator = "|" + "|".join({"l": "---", "r": "---:"}[a] for a in align) + "|"
    return [_row(headers), separator, *(_row(row) for row in rows)]


def emit(lines: Sequence[str]) -> str:
    """Join ``lines``, print the report and return it."""
    report = "\n".join(lines)
    print(report)
    return report


def benchmark_parser(doc: str | None, quick_help: str = QUICK_HELP) -> argparse.ArgumentParser:
    """An argument parser described by the first line of ``doc``, with ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser
