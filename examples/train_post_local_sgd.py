"""DDP + post-local SGD on the digits: plain DDP vs torch's post-local SGD vs ours, same seeds.

Launch with torchrun (one process per rank, gloo)::

    torchrun --nproc-per-node 2 examples/train_post_local_sgd.py --epochs 10

Post-local SGD all-reduces gradients for the first ``--warmup`` steps (the DDP comm hook), then
lets each rank step on its own and averages the parameters every ``--period`` steps
(PostLocalSGDOptimizer + PeriodicModelAverager): far fewer bytes on the wire than plain DDP.

Elastic mode (``--checkpoint-dir``) trains our post-local SGD only and survives failures: every
``--checkpoint-every`` steps each rank saves its replica (parameters and momentum, which differ
between averagings) and the step; a restart resumes from the latest committed checkpoint at
whatever world size torchrun gives, rank ``r`` taking the replica of saved rank
``r % saved_world_size`` (see docs/elastic.md)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --max-restarts 3 \
        examples/train_post_local_sgd.py --checkpoint-dir /tmp/pls-ckpt --timeout 15
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from _common import (
    RunMetrics,
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
from _impls import IMPLEMENTATIONS

PHASE = "2 local SGD"
MOMENTUM = 0.9


def averaging_steps(total_steps: int, warmup: int, period: int) -> int:
    """Count the steps on which PeriodicModelAverager(period, warmup) averages parameters."""
    return sum(1 for step in range(total_steps) if step >= warmup and (step - warmup) % period == 0)


def run_post_local_sgd(cfg: TrainConfig, warmup: int, period: int) -> list[RunMetrics]:
    """Train plain DDP, torch's post-local SGD and ours, step by step; needs a process group.

    Args:
        cfg: hyperparameters (SGD with momentum 0.9 at ``cfg.lr``).
        warmup: steps of global gradient all-reduce before local SGD starts.
        period: parameter-averaging period once local SGD has started.

    Returns:
        Metrics of the three runs (losses averaged over ranks; the same on every rank).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed=cfg.seed)
    batches = rank_batches(
        len(data.x_train), rank, world_size, cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps
    )
    names = ["plain DDP", "post-local SGD (torch)", "post-local SGD (ours)"]
    sides = ["torch", "torch", "ours"]
    models, optimizers = [], []
    for name, side in zip(names, sides):
        impl = IMPLEMENTATIONS[side]
        model = make_mlp(cfg.seed, cfg.hidden)
        ddp = DistributedDataParallel(model)
        local = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=MOMENTUM)
        optimizer: Any = local
        if name != "plain DDP":
            # Gradients are all-reduced for `warmup` steps, then not at all (each rank steps on
            # its own data); the averager brings the replicas together every `period` steps.
            state = impl.PostLocalSGDState(
                process_group=None,
                subgroup=None,
                start_localSGD_iter=warmup,
                post_local_gradient_allreduce=False,
            )
            ddp.register_comm_hook(state, impl.post_localSGD_hook)
            averager = impl.PeriodicModelAverager(period=period, warmup_steps=warmup)
            optimizer = impl.PostLocalSGDOptimizer(optim=local, averager=averager)
        models.append((ddp, model))
        optimizers.append(optimizer)
    samples_per_step = cfg.batch_size * world_size
    progress = StepProgress(names, len(batches), samples_per_step, rank == 0)
    steppers = [ddp_stepper(ddp, opt) for (ddp, _), opt in zip(models, optimizers)]
    history = train_interleaved(steppers, data.x_train, data.y_train, batches, progress)

    total = len(batches)
    runs = []
    for name, side, (_, model), optimizer, (losses, times) in zip(
        names, sides, models, optimizers, history
    ):
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (losses, tensor_bytes(dict(optimizer.state))))
        per_rank_state = [int(state) for _, state in gathered]
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
        params = param_bytes(list(model.parameters()))
        if name == "plain DDP":
            comm = float(params)
            implementation = {"DistributedDataParallel": "torch.nn.parallel"}
        else:
            averaged = averaging_steps(total, warmup, period)
            comm = (min(warmup, total) * params + averaged * params) / total
            impl = IMPLEMENTATIONS[side]
            implementation = {
                attr: impl.source(attr)
                for attr in (
                    "PostLocalSGDState",
                    "post_localSGD_hook",
                    "PostLocalSGDOptimizer",
                    "PeriodicModelAverager",
                )
            }
        runs.append(
            RunMetrics(
                phase=PHASE,
                run=name,
                side=side,
                implementation=implementation,
                losses=mean_over_ranks([rank_losses for rank_losses, _ in gathered]),
                step_times_ms=times,
                test_accuracy=accuracy,
                test_loss=test_loss,
                opt_state_bytes_per_rank=per_rank_state,
                # SGD's momentum is replicated, not sharded: each rank holds all of it.
                opt_state_bytes_unsharded=max(per_rank_state),
                comm_bytes_per_step=comm,
                samples_per_step=samples_per_step,
                extra={"warmup": warmup, "period": period, "baseline": name == "plain DDP"},
            )
        )
    return runs


def run_post_local_sgd_elastic(
    cfg: TrainConfig, warmup: int | None, period: int, options: ElasticOptions
) -> None:
    """Train our post-local SGD from the latest checkpoint under ``root`` (see the docstring).

    Args:
        cfg: hyperparameters.
        warmup: global steps before local SGD (default: a quarter of the run's steps at world
            size 1, so that it does not change when the world size does).
        period: parameter-averaging period.
        options: checkpoint root and cadence.
    """
    root = options.root
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stop = StopRequest()
    data = load_digits_split(seed=cfg.seed)
    schedule = DataSchedule(len(data.x_train), cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps)
    if warmup is None:
        warmup = max(1, schedule.total_steps(world_size=1) // 4)
    impl = IMPLEMENTATIONS["ours"]
    model = make_mlp(cfg.seed, cfg.hidden)
    ddp = DistributedDataParallel(model)
    local = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=MOMENTUM)
    hook_state = impl.PostLocalSGDState(
        process_group=None,
        subgroup=None,
        start_localSGD_iter=warmup,
        post_local_gradient_allreduce=False,
    )
    ddp.register_comm_hook(hook_state, impl.post_localSGD_hook)
    averager = impl.PeriodicModelAverager(period=period, warmup_steps=warmup)
    optimizer = impl.PostLocalSGDOptimizer(optim=local, averager=averager)
    params = list(model.parameters())

    def replica() -> dict[str, torch.Tensor]:
        values = {f"param.{i}": p.data for i, p in enumerate(params)}
        for i, p in enumerate(params):
            if "momentum_buffer" in local.state.get(p, {}):
                values[f"momentum.{i}"] = local.state[p]["momentum_buffer"]
        return values

    checkpoint = ElasticCheckpoint(root, options.every, cfg.seed)
    targets = {f"param.{i}": p.data for i, p in enumerate(params)}
    targets.update({f"momentum.{i}": torch.empty_like(p) for i, p in enumerate(params)})
    cursor, folder = checkpoint.load({}, targets)
    for i, p in enumerate(params):
        if f"momentum.{i}" in targets:
            local.state[p]["momentum_buffer"] = targets[f"momentum.{i}"]
    # The step counters of the hook (global all-reduce until warm-up ends) and the averager.
    hook_state.iter = min(cursor.step, warmup)
    averager.step = cursor.step
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
        lambda: ({}, replica()),
        stop,
        options.grace_s,
        options.step_delay_s,
    )
    accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
    if rank == 0:
        log_event(root, "done", step=cursor.step, world_size=world_size, accuracy=accuracy)
        print(
            f"{PHASE} elastic: step {cursor.step} at world size {world_size}, "
            f"acc {accuracy:6.2%}, test loss {test_loss:.4f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> list[RunMetrics]:
    """Parse options, join the process group, train the three runs side by side, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_args(parser, epochs=10, lr=0.05)
    parser.add_argument(
        "--warmup", type=int, default=None, help="global steps (default: a quarter of the run)"
    )
    parser.add_argument("--period", type=int, default=4, help="parameter-averaging period")
    add_elastic_args(parser)
    args = parser.parse_args(argv)
    cfg = train_config(args)
    setup_worker()
    rank, world_size = init_process_group_from_env(cfg.timeout_s)
    options = elastic_options(args)
    if options is not None:
        run_failing_fast(
            lambda: run_post_local_sgd_elastic(cfg, args.warmup, args.period, options),
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
            warmup = max(1, total // 4)
        runs = run_post_local_sgd(cfg, warmup, args.period)
        dist.barrier()
    finally:
        destroy_process_group()
    if rank == 0:
        print_summary(runs)
        write_metrics(args.metrics, PHASE, runs)
    return runs


if __name__ == "__main__":
    main()
