"""Benchmark: what rollback-on-failure costs a sharded (ZeRO-style) optimizer step.

Two gloo ranks on 127.0.0.1. The step is what ZeRO does: Adam on this rank's shard of the
parameters, then :class:`dist_runtime.param_sync.ShardBroadcaster` sends every shard to every
rank. Three variants, timed interleaved in the same run:

- ``plain``: the step alone;
- ``rollback (all params)``: under :func:`dist_runtime.step_rollback.rollback_on_failure`,
  snapshotting every parameter (the broadcast writes into the other ranks' parameters) and this
  rank's optimizer state;
- ``rollback (owned only)``: snapshotting only this rank's parameters and state (enough when the
  sync receives into scratch buffers and unpacks only after every wait succeeded).

Shapes: uniform (few large tensors), skewed (one large, many small), many small tensors.

A second table times ``PostLocalSGDOptimizer.step`` on the steps that average (where it
snapshots, always on) against the same local step + averaging without the snapshot.

A third times a DDP iteration (forward, backward with the overlapped ZeRO Adam step in the comm
hook: ``overlap_with_ddp=True``, both hooks, 4 MB buckets) with ``undo_step_on_failure`` off
(the failure guard only) and on (the snapshot too), against the hooks without the guard, all
on the same instance.

Usage: ``python benchmarks/step_rollback.py [--quick]``; ``main(argv) -> str`` returns markdown.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from _harness import WORLD_SIZE, benchmark_parser, emit, interleaved_median_ms, spawn, table


def _shapes(kind: str, quick: bool) -> list[tuple[int, ...]]:
    scale = 4 if quick else 1
    if kind == "uniform":
        return [(1000 // scale, 1000)] * 10
    if kind == "skewed":
        return [(8000 // scale, 1000), *[(10, 100)] * (200 // scale)]
    return [(500,)] * (2000 // scale)


def _time_step(rank: int, kind: str, quick: bool, repeats: int) -> dict[str, float]:
    from dist_runtime.param_sync import ShardBroadcaster
    from dist_runtime.partition import sorted_greedy_partition
    from dist_runtime.step_rollback import OptimizerSnapshot, rollback_on_failure

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in _shapes(kind, quick)]
    plan = sorted_greedy_partition([[p.numel() for p in params]], WORLD_SIZE)
    owned = [[params[i] for i in plan[0][r]] for r in range(WORLD_SIZE)]
    mine = owned[rank]
    optim = torch.optim.Adam(mine, lr=1e-3)
    sync = ShardBroadcaster(owned)
    for p in mine:
        p.grad = torch.randn_like(p)

    def step() -> None:
        optim.step()
        sync.sync()

    snapshots = {"all": OptimizerSnapshot(optim, params), "owned": OptimizerSnapshot(optim, mine)}

    def all_params() -> None:
        with rollback_on_failure("step", optim, params, snapshot=snapshots["all"]):
            step()

    def owned_only() -> None:
        with rollback_on_failure("step", optim, mine, snapshot=snapshots["owned"]):
            step()

    cases: dict[str, Callable[[], None]] = {
        "plain": step,
        "rollback (all params)": all_params,
        "rollback (owned only)": owned_only,
    }
    return interleaved_median_ms(cases, warmup=2, repeats=repeats)


def _time_post_local(rank: int, kind: str, quick: bool, repeats: int) -> dict[str, float]:
    from compat_api.algorithms.model_averaging.averagers import PeriodicModelAverager
    from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer

    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(s)) for s in _shapes(kind, quick)]
    for p in params:
        p.grad = torch.randn_like(p)
    local = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    with warnings.catch_warnings():  # period 1: every step averages (the worst case here)
        warnings.simplefilter("ignore")
        wrapped = PostLocalSGDOptimizer(local, PeriodicModelAverager(period=1))
        bare = PeriodicModelAverager(period=1)

    def without_snapshot() -> None:
        local.step()
        bare.average_parameters(local.param_groups)

    cases: dict[str, Callable[[], None]] = {
        "local step + averaging": without_snapshot,
        "PostLocalSGDOptimizer.step (snapshot)": wrapped.step,
    }
    return interleaved_median_ms(cases, warmup=2, repeats=repeats)


class _Tensors(torch.nn.Module):
    """A model that is just parameters of the given shapes (``forward`` touches each once)."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s)) for s in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * x).sum() for w in self.weights]).sum()


def _time_overlap(rank: int, kind: str, quick: bool, repeats: int) -> dict[str, float]:
    times = {}
    for hook in ("hook_with_zero_step", "hook_with_zero_step_interleaved"):
        for variant, ms in _time_overlap_hook(rank, kind, quick, repeats, hook).items():
            times[f"{hook}|{variant}"] = ms
    return times


def _time_overlap_hook(
    rank: int, kind: str, quick: bool, repeats: int, hook: str
) -> dict[str, float]:
    """One DDP iteration: unguarded (the hooks without the failure guard), undo off, undo on."""
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from compat_api import ZeroRedundancyOptimizer
    from compat_api._zero.overlap_control import OverlapController
    from compat_api.algorithms.ddp_comm_hooks import ddp_zero_hook

    torch.manual_seed(0)
    ddp = DistributedDataParallel(_Tensors(_shapes(kind, quick)), bucket_cap_mb=4)
    zero = ZeroRedundancyOptimizer(
        list(ddp.parameters()), torch.optim.Adam, overlap_with_ddp=True, lr=1e-3
    )
    ddp.register_comm_hook(
        None, getattr(ddp_zero_hook, hook)(default_hooks.allreduce_hook, ddp, zero)
    )
    x = torch.tensor(1.0 + rank)
    guarded = OverlapController.guarded

    def iteration(undo: bool, guard: bool = True) -> None:
        zero.undo_step_on_failure = undo
        if not guard:  # the hooks as they were before the guard
            setattr(OverlapController, "guarded", lambda self: contextlib.nullcontext())  # noqa: B010
        try:
            ddp.zero_grad(set_to_none=True)
            ddp(x).backward()
        finally:
            setattr(OverlapController, "guarded", guarded)  # noqa: B010

    for _ in range(3):  # DDP's warm-up: the hooks update from the third iteration
        iteration(False)
    cases: dict[str, Callable[[], None]] = {
        "unguarded": lambda: iteration(False, guard=False),
        "undo off": lambda: iteration(False),
        "undo on": lambda: iteration(True),
    }
    return interleaved_median_ms(cases, warmup=2, repeats=repeats)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown table."""
    args = benchmark_parser(__doc__).parse_args(argv)
    repeats = 5 if args.quick else 20
    rows = []
    for kind in ("uniform", "skewed", "many small"):
        per_rank = spawn(_time_step, kind, args.quick, repeats, timeout_s=300, pg_timeout_s=60)
        times = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        plain = times["plain"]
        numel = sum(torch.Size(s).numel() for s in _shapes(kind, args.quick))
        label = f"{kind} ({len(_shapes(kind, args.quick))} tensors, {numel / 1e6:.1f}M)"
        for name, ms in times.items():
            rows.append([label, name, f"{ms:.1f}", f"{ms / plain:.2f}"])
    post_rows = []
    for kind in ("uniform", "many small"):
        per_rank = spawn(
            _time_post_local, kind, args.quick, repeats, timeout_s=300, pg_timeout_s=60
        )
        times = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        base = times["local step + averaging"]
        for name, ms in times.items():
            post_rows.append([kind, name, f"{ms:.1f}", f"{ms / base:.2f}"])
    overlap_rows = []
    for kind in ("uniform", "many small"):
        per_rank = spawn(_time_overlap, kind, args.quick, repeats, timeout_s=300, pg_timeout_s=60)
        times = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        for hook in ("hook_with_zero_step", "hook_with_zero_step_interleaved"):
            base, off, on = (times[f"{hook}|{v}"] for v in ("unguarded", "undo off", "undo on"))
            overlap_rows.append(
                [kind, hook, f"{base:.1f}", f"{off / base:.2f}", f"{on / base:.2f}"]
            )
    return emit(
        [
            f"### Rollback-on-failure cost on a ZeRO-style Adam step, {WORLD_SIZE} gloo ranks "
            f"(median of {repeats}, slowest rank)",
            "",
            *table(["model", "variant", "step (ms)", "vs plain"], rows, "llrr"),
            "",
            "### PostLocalSGDOptimizer: an averaging step with and without the snapshot "
            "(SGD momentum, period 1)",
            "",
            *table(["model", "variant", "step (ms)", "ratio"], post_rows, "llrr"),
            "",
            "### ZeRO overlap_with_ddp: a DDP iteration (forward, backward, the Adam step in the "
            "comm hook), with the failure guard and undo_step_on_failure vs without the guard",
            "",
            *table(
                ["model", "hook", "unguarded (ms)", "undo off / unguarded", "undo on / unguarded"],
                overlap_rows,
                "llrrr",
            ),
        ]
    )


if __name__ == "__main__":
    main()
