"""A persistent multi-process world for distributed tests.

Spawning torch processes is slow on small machines, so a test module starts one world (gloo
process group and/or TensorPipe RPC on 127.0.0.1, free ports) and runs many checks in it::

    @pytest.fixture(scope="module")
    def world2():
        with World(2) as world:
            yield world

    def test_allreduce(world2):
        results = world2.run(_check_allreduce, 3.0)   # one result per rank

``fn`` must be importable by reference (a module-level function of a test module or package
module); it runs on every rank as ``fn(rank, world_size, *args)``. Every collective has the
process-group timeout, every task a wall-clock timeout, and closing the world kills stragglers.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_CTX = mp.get_context("spawn")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WorldError(RuntimeError):
    """A rank raised; the message carries every failing rank's traceback."""


def _worker_main(
    rank: int,
    world_size: int,
    pg_port: int,
    rpc_port: int,
    init_pg: bool,
    init_rpc: bool,
    backend: str,
    collective_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(pg_port)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{pg_port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout_s),
            )
        if init_rpc:
            from torch.distributed import rpc

            options = rpc.TensorPipeRpcBackendOptions(
                init_method=f"tcp://127.0.0.1:{rpc_port}",
                rpc_timeout=collective_timeout_s,
                num_worker_threads=16,
            )
            rpc.init_rpc(
                f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options
            )
        results.put((rank, "ready", None))
    except BaseException:  # report start-up failures to the parent instead of hanging it
        results.put((rank, "error", traceback.format_exc()))
        return

    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(rank, world_size, *args, **kwargs)
            results.put((rank, "ok", value))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
    try:
        if init_rpc:
            from torch.distributed import rpc

            rpc.shutdown(graceful=True, timeout=collective_timeout_s)
        if init_pg and dist.is_initialized():
            dist.destroy_process_group()
    finally:
        results.put((rank, "closed", None))


class World:
    """``world_size`` spawned ranks that keep their process group / RPC agent between tasks.

    Args:
        world_size: number of ranks (2-4 on CI).
        init_pg: initialise a default process group on every rank.
        init_rpc: initialise TensorPipe RPC, ranks named ``worker{rank}``.
        backend: process-group backend (``gloo`` on CPU).
        collective_timeout_s: timeout for every collective and RPC.
        start_timeout_s: how long to wait for every rank to come up.
    """

    def __init__(
        self,
        world_size: int,
        *,
        init_pg: bool = True,
        init_rpc: bool = False,
        backend: str = "gloo",
        collective_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.world_size = world_size
        # One results queue per rank: a queue's writers share a lock, which a rank SIGKILLed
        # while its feeder thread writes would hold forever, silencing every other rank.
        self._results = [_CTX.Queue() for _ in range(world_size)]
        self._tasks = [_CTX.Queue() for _ in range(world_size)]
        self._broken = False
        pg_port, rpc_port = free_port(), free_port()
        self._procs = [
            _CTX.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    pg_port,
                    rpc_port,
                    init_pg,
                    init_rpc,
                    backend,
                    collective_timeout_s,
                    self._tasks[rank],
                    self._results[rank],
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        try:
            self._collect("ready", start_timeout_s, range(world_size))
        except BaseException:
            self.close(graceful=False)
            raise

    def _collect(self, expected: str, timeout_s: float, ranks: Sequence[int]) -> list[Any]:
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        start = time.monotonic()
        while len(values) + len(errors) < len(ranks):
            deadline_left = timeout_s - (time.monotonic() - start)
            if deadline_left <= 0:
                self._broken = True
                missing = sorted(set(ranks) - set(values) - set(errors))
                raise TimeoutError(
                    f"ranks {missing} did not answer within {timeout_s:.0f} s"
                    + (f"; errors so far: {errors}" if errors else "")
                )
            pending = [r for r in ranks if r not in values and r not in errors]
            received = self._poll(pending, min(deadline_left, 1.0))
            if not received:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and set(pending) & set(dead):
                    self._broken = True
                    died = sorted(set(pending) & set(dead))
                    raise WorldError(f"ranks {died} died; errors: {errors}") from None
                continue
            for rank, status, value in received:
                if status == "error":
                    errors[rank] = value
                elif status == expected:
                    values[rank] = value
        if errors:
            body = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorldError(f"{len(errors)} rank(s) failed:\n{body}")
        return [values[r] for r in ranks]

    def _poll(self, ranks: Sequence[int], timeout_s: float) -> list[tuple[int, str, Any]]:
        """The messages waiting from ``ranks``, waiting up to ``timeout_s`` for the first."""
        deadline = time.monotonic() + timeout_s
        while True:
            received = []
            for rank in ranks:
                with contextlib.suppress(queue.Empty):
                    received.append(self._results[rank].get_nowait())
            if received or time.monotonic() >= deadline:
                return received
            time.sleep(0.005)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = 180.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results by rank."""
        return self.run_on(range(self.world_size), fn, *args, timeout_s=timeout_s, **kwargs)

    def run_on(
        self,
        ranks: Sequence[int],
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float = 180.0,
        **kwargs: Any,
    ) -> list[Any]:
        """Like :meth:`run` but only on ``ranks`` (for RPC tests driven from one rank)."""
        if self._broken:
            raise WorldError("the world is broken by an earlier timeout or crash")
        ranks = list(ranks)
        for rank in ranks:
            self._tasks[rank].put((fn, args, kwargs))
        return self._collect("ok", timeout_s, ranks)

    def kill(self, rank: int) -> None:
        """Kill ``rank`` (SIGKILL: a real dead peer); the other ranks keep taking tasks.

        Run later tasks with :meth:`run_on` over the live ranks.
        """
        proc = self._procs[rank]
        proc.kill()
        proc.join(timeout=10)

    def close(self, graceful: bool = True) -> None:
        """Shut every rank down; kill any that do not exit in time."""
        if graceful and not self._broken:
            for tasks in self._tasks:
                tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=60)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(graceful=exc[0] is None)
