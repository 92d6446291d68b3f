"""DiLoCo on the digits: DDP vs post-local SGD vs DiLoCo vs Streaming DiLoCo, loss vs bytes.

Launch with torchrun (one process per rank, gloo)::

    torchrun --nproc-per-node 2 examples/train_diloco.py --epochs 10 --period 8

Every run trains the same MLP with AdamW as the inner optimizer, from the same weights on the
same batches. After ``--warmup`` steps of DDP gradient all-reduce (the post-local SGD comm hook)
each rank steps on its own data, and every ``--period`` steps:

* post-local SGD (``PeriodicModelAverager``) averages the parameters;
* DiLoCo (``DiLoCoAverager``, ours: torch has none) averages the pseudo-gradient (parameters at
  the last sync minus now) and applies it to the synced parameters with Nesterov SGD
  (``--outer-lr`` 0.7, ``--outer-momentum`` 0.5);
* Streaming DiLoCo syncs the model in ``--fragments`` fragments at staggered steps, overlaps
  each all-reduce with the next inner step and sends int8 (blockwise scales, error feedback).

Each run records the bytes every rank has sent after each step, for the loss-vs-bytes plot.
The averager's default outer step (lr 0.7, momentum 0.9, Douillard et al.) was tuned for 8
replicas over many outer steps; with 2 ranks and about 25 outer steps its momentum overshoots
(on the digits: DiLoCo 94.99% accuracy against DDP's 97.49%, 2026-11-23), so the two DiLoCo
runs here use momentum 0.5 (97.49%), as ``benchmarks/lm_diloco.py``'s sweep found
(docs/benchmarks.md).

Elastic mode (``--checkpoint-dir``) trains one DiLoCo run (``--elastic-variant``: Streaming
DiLoCo int8 by default, or plain DiLoCo) and survives failures: every ``--checkpoint-every``
steps each rank saves its parameters, its AdamW state and the averager's state (step, synced
copy, outer Nesterov momentum, int8 error feedback, in-flight mean); a restart resumes from the
latest committed checkpoint at whatever world size torchrun gives, rank ``r`` taking all of it
from saved rank ``r % saved_world_size`` (see :func:`run_diloco_elastic` and
docs/elastic.md)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --max-restarts 3 \
        examples/train_diloco.py --checkpoint-dir /tmp/diloco-ckpt --timeout 15
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import compat_api.algorithms.ddp_comm_hooks.post_localSGD_hook as pls_hook
import functional_optim as fo
from _common import (
    RunMetrics,
    Stepper,
    StepProgress,
    TrainConfig,
    add_train_args,
    ddp_stepper,
    destroy_process_group,
    evaluate,
    init_process_group_from_env,
    load_digits_split,
    make_mlp,
    mean_over_ranks,
    param_bytes,
    print_summary,
    rank_batches,
    setup_worker,
    tensor_bytes,
    train_config,
    train_interleaved,
    write_metrics,
)
from _elastic import (
    DataSchedule,
    ElasticCheckpoint,
    ElasticOptions,
    StopRequest,
    add_elastic_args,
    elastic_options,
    log_event,
    process_age_s,
    restart_count,
    run_failing_fast,
    train_elastic,
)
from _nested_state import pack_state, saved_like, unpack_state
from compat_api.algorithms.model_averaging import DiLoCoAverager
from compat_api.algorithms.model_averaging.averagers import PeriodicModelAverager
from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer

PHASE = "4 DiLoCo"
# Outer Nesterov SGD (lr, momentum) of the side-by-side DiLoCo runs. The paper's (0.7, 0.9) was
# tuned for 8 replicas over many outer steps; with 2-4 ranks and a few dozen outer steps its
# momentum overshoots (benchmarks/lm_diloco.py's sweep, docs/benchmarks.md), so this uses
# momentum 0.5.
OUTER = (0.7, 0.5)
WEIGHT_DECAY = 0.01


@dataclass
class Run:
    """One configuration: its model, optimizer, averager and bytes sent so far per step."""

    name: str
    model: nn.Module
    ddp: DistributedDataParallel
    optimizer: Any
    averager: Any
    implementation: dict[str, str]
    sent: Callable[[int], int]
    cumulative_bytes: list[int]


def _module(obj: Any) -> str:
    return str(obj.__module__)


def build_runs(
    cfg: TrainConfig,
    warmup: int,
    period: int,
    fragments: int,
    params_bytes: int,
    outer: tuple[float, float] = OUTER,
) -> list[Run]:
    """Build the four runs (DDP, post-local SGD, DiLoCo, Streaming DiLoCo) from one seed.

    ``outer`` is the (lr, momentum) of both DiLoCo runs' outer Nesterov SGD.
    """
    runs = []

    def outer_sgd() -> fo.GradientTransformation:
        return fo.sgd(lr=outer[0], momentum=outer[1], nesterov=outer[1] > 0)

    configs: list[tuple[str, Callable[[], Any] | None]] = [
        ("DDP AdamW", None),
        (
            f"post-local SGD (H={period})",
            lambda: PeriodicModelAverager(period=period, warmup_steps=warmup),
        ),
        (
            f"DiLoCo (H={period})",
            lambda: DiLoCoAverager(outer_sgd(), period=period, warmup_steps=warmup),
        ),
        (
            f"Streaming DiLoCo int8 (P={fragments})",
            lambda: DiLoCoAverager(
                outer_sgd(),
                period=period,
                warmup_steps=warmup,
                fragments=fragments,
                overlap=True,
                compression="int8",
            ),
        ),
    ]
    for name, make_averager in configs:
        model = make_mlp(cfg.seed, cfg.hidden)
        ddp = DistributedDataParallel(model)
        inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=WEIGHT_DECAY)
        if make_averager is None:
            runs.append(
                Run(
                    name,
                    model,
                    ddp,
                    inner,
                    None,
                    {"DistributedDataParallel": _module(DistributedDataParallel)},
                    lambda step: (step + 1) * params_bytes,  # a gradient all-reduce per step
                    [],
                )
            )
            continue
        state = pls_hook.PostLocalSGDState(
            process_group=None,
            subgroup=None,
            start_localSGD_iter=warmup,
            post_local_gradient_allreduce=False,
        )
        ddp.register_comm_hook(state, pls_hook.post_localSGD_hook)
        averager = make_averager()
        optimizer = PostLocalSGDOptimizer(optim=inner, averager=averager)
        warmup_bytes: Callable[[int], int] = lambda step: min(step + 1, warmup) * params_bytes  # noqa: E731
        if isinstance(averager, DiLoCoAverager):
            sent = _diloco_bytes(averager, warmup_bytes)
        else:
            sent = _periodic_bytes(warmup, period, params_bytes, warmup_bytes)
        runs.append(
            Run(
                name,
                model,
                ddp,
                optimizer,
                averager,
                {
                    "post_localSGD_hook": _module(pls_hook.post_localSGD_hook),
                    "PostLocalSGDOptimizer": _module(PostLocalSGDOptimizer),
                    type(averager).__name__: _module(type(averager)),
                },
                sent,
                [],
            )
        )
    return runs


def _diloco_bytes(
    averager: DiLoCoAverager, warmup_bytes: Callable[[int], int]
) -> Callable[[int], int]:
    return lambda step: warmup_bytes(step) + averager.bytes_communicated


def _periodic_bytes(
    warmup: int, period: int, params_bytes: int, warmup_bytes: Callable[[int], int]
) -> Callable[[int], int]:
    def sent(step: int) -> int:
        syncs = 0 if step < warmup else (step - warmup) // period + 1
        return warmup_bytes(step) + syncs * params_bytes

    return sent


def _recording(run: Run, stepper: Stepper) -> Stepper:
    """``stepper`` that also records the bytes sent once each step is done."""

    def step(xb: Tensor, yb: Tensor) -> Tensor:
        loss = stepper(xb, yb)
        run.cumulative_bytes.append(run.sent(len(run.cumulative_bytes)))
        return loss

    return step


def run_diloco(
    cfg: TrainConfig,
    warmup: int,
    period: int,
    fragments: int,
    outer: tuple[float, float] = OUTER,
) -> list[RunMetrics]:
    """Train the four runs step by step; needs a process group.

    ``outer``: the (lr, momentum) of the DiLoCo runs' outer Nesterov SGD.

    Returns:
        Metrics of each run (losses averaged over ranks), with ``extra["cumulative_bytes"]``.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed=cfg.seed)
    batches = rank_batches(
        len(data.x_train), rank, world_size, cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps
    )
    params_bytes = param_bytes(list(make_mlp(cfg.seed, cfg.hidden).parameters()))
    runs = build_runs(cfg, warmup, period, fragments, params_bytes, outer)
    samples_per_step = cfg.batch_size * world_size
    progress = StepProgress([r.name for r in runs], len(batches), samples_per_step, rank == 0)
    steppers = [_recording(r, ddp_stepper(r.ddp, r.optimizer)) for r in runs]
    history = train_interleaved(steppers, data.x_train, data.y_train, batches, progress)

    out = []
    for run, (losses, times) in zip(runs, history, strict=True):
        state = tensor_bytes(dict(run.optimizer.state))
        if isinstance(run.averager, DiLoCoAverager):
            state += tensor_bytes(run.averager.state_dict()["sync"])  # synced copy, momentum
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (losses, state))
        per_rank_state = [int(s) for _, s in gathered]
        accuracy, test_loss = evaluate(run.model, data.x_test, data.y_test)
        total = run.cumulative_bytes[-1]
        out.append(
            RunMetrics(
                phase=PHASE,
                run=run.name,
                side="torch" if run.averager is None else "ours",
                implementation=run.implementation,
                losses=mean_over_ranks([rank_losses for rank_losses, _ in gathered]),
                step_times_ms=times,
                test_accuracy=accuracy,
                test_loss=test_loss,
                opt_state_bytes_per_rank=per_rank_state,
                opt_state_bytes_unsharded=max(per_rank_state),
                comm_bytes_per_step=total / len(run.cumulative_bytes),
                samples_per_step=samples_per_step,
                extra={
                    "warmup": warmup,
                    "period": period,
                    "fragments": fragments,
                    "baseline": run.averager is None,
                    "cumulative_bytes": run.cumulative_bytes,
                },
            )
        )
    return out


def make_elastic_averager(variant: str, warmup: int, period: int, fragments: int) -> DiLoCoAverager:
    """The averager of the elastic run: ``"streaming"`` (as in the side-by-side runs) or
    ``"diloco"``."""
    if variant == "diloco":
        return DiLoCoAverager(period=period, warmup_steps=warmup)
    if variant == "streaming":
        return DiLoCoAverager(
            period=period,
            warmup_steps=warmup,
            fragments=fragments,
            overlap=True,
            compression="int8",
        )
    raise ValueError(f"unknown elastic variant {variant!r}: use 'streaming' or 'diloco'")


def run_diloco_elastic(
    cfg: TrainConfig,
    warmup: int | None,
    period: int,
    fragments: int,
    variant: str,
    options: ElasticOptions,
) -> None:
    """Train one DiLoCo run from the latest checkpoint under ``options.root``.

    Every rank saves its own parameters, AdamW state and averager state (they differ between
    syncs: the parameters, the inner state and the int8 error feedback are the rank's own). A
    run at a new world size loads all of it from saved rank ``rank % saved_world_size``. The
    synced copy, the outer momentum and an in-flight mean are equal on every rank after a
    sync, so any saved rank gives the right ones; the error feedback is per rank: a grown
    group starts with copies of the saved ranks' residuals, a shrunk one drops the residuals of
    the ranks that left (each at most one int8 rounding error per parameter, which error
    feedback would have sent at the next sync).

    Args:
        cfg: hyperparameters.
        warmup: DDP steps first (default: a tenth of the run's steps at world size 1, so that
            it does not change when the world size does).
        period: inner steps between syncs.
        fragments: Streaming DiLoCo fragments.
        variant: see :func:`make_elastic_averager`.
        options: checkpoint root and cadence.
    """
    root = options.root
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stop = StopRequest()
    data = load_digits_split(seed=cfg.seed)
    schedule = DataSchedule(len(data.x_train), cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps)
    if warmup is None:
        warmup = max(1, schedule.total_steps(world_size=1) // 10)
    model = make_mlp(cfg.seed, cfg.hidden)
    ddp = DistributedDataParallel(model)
    inner = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=WEIGHT_DECAY)
    hook_state = pls_hook.PostLocalSGDState(
        process_group=None,
        subgroup=None,
        start_localSGD_iter=warmup,
        post_local_gradient_allreduce=False,
    )
    ddp.register_comm_hook(hook_state, pls_hook.post_localSGD_hook)
    averager = make_elastic_averager(variant, warmup, period, fragments)
    optimizer = PostLocalSGDOptimizer(optim=inner, averager=averager)
    params = list(model.parameters())

    def rank_state() -> dict[str, Tensor]:
        values = {f"param.{i}": p.data for i, p in enumerate(params)}
        values.update(pack_state(inner.state_dict(), "inner."))
        values.update(pack_state(averager.state_dict(), "averager."))
        return values

    checkpoint = ElasticCheckpoint(root, options.every, cfg.seed)
    targets = {f"param.{i}": p.data for i, p in enumerate(params)}
    targets.update(saved_like(root, "inner."))
    targets.update(saved_like(root, "averager."))
    cursor, folder = checkpoint.load({}, targets)
    if "inner.tree" in targets:
        inner.load_state_dict(unpack_state(targets, "inner."))
    if "averager.tree" in targets:
        averager.load_state_dict(unpack_state(targets, "averager."))
    hook_state.iter = min(cursor.step, warmup)  # the hook all-reduces gradients until warm-up
    log_event(
        root,
        "start",
        rank=rank,
        world_size=world_size,
        step=cursor.step,
        folder=folder and os.path.basename(folder),
        restart=restart_count(),
        startup_s=process_age_s(),
    )
    cursor, _ = train_elastic(
        ddp_stepper(ddp, optimizer),
        data.x_train,
        data.y_train,
        schedule,
        checkpoint,
        cursor,
        lambda: ({}, rank_state()),
        stop,
        options.grace_s,
        options.step_delay_s,
    )
    accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
    if rank == 0:
        log_event(root, "done", step=cursor.step, world_size=world_size, accuracy=accuracy)
        print(
            f"{PHASE} elastic ({variant}): step {cursor.step} at world size {world_size}, "
            f"acc {accuracy:6.2%}, test loss {test_loss:.4f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> list[RunMetrics]:
    """Parse options, join the process group, train the four runs side by side, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_args(parser, epochs=10, lr=2e-3)
    parser.add_argument(
        "--warmup", type=int, default=None, help="DDP steps first (default: a tenth of the run)"
    )
    parser.add_argument("--period", type=int, default=8, help="inner steps between syncs (H)")
    parser.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo fragments")
    parser.add_argument(
        "--outer-lr", type=float, default=OUTER[0], help="DiLoCo outer Nesterov SGD lr"
    )
    parser.add_argument(
        "--outer-momentum", type=float, default=OUTER[1], help="DiLoCo outer SGD momentum"
    )
    parser.add_argument(
        "--elastic-variant",
        choices=("streaming", "diloco"),
        default="streaming",
        help="the run elastic mode trains: Streaming DiLoCo int8 or plain DiLoCo",
    )
    add_elastic_args(parser)
    args = parser.parse_args(argv)
    cfg = train_config(args)
    setup_worker()
    rank, world_size = init_process_group_from_env(cfg.timeout_s)
    options = elastic_options(args)
    if options is not None:
        run_failing_fast(
            lambda: run_diloco_elastic(
                cfg, args.warmup, args.period, args.fragments, args.elastic_variant, options
            ),
            options.root,
        )
        destroy_process_group()
        return []
    try:
        warmup = args.warmup
        if warmup is None:
            n_train = len(load_digits_split(seed=cfg.seed).x_train)
            total = len(
                rank_batches(
                    n_train, 0, world_size, cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps
                )
            )
            warmup = max(1, total // 10)
        outer = (args.outer_lr, args.outer_momentum)
        runs = run_diloco(cfg, warmup, args.period, args.fragments, outer)
        dist.barrier()
    finally:
        destroy_process_group()
    if rank == 0:
        print_summary(runs)
        write_metrics(args.metrics, PHASE, runs)
    return runs


if __name__ == "__main__":
    main()
