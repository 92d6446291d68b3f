"""DDP + ZeroRedundancyOptimizer(Adam) on the digits, ours vs torch's, same seeds.

Launch with torchrun (one process per rank, gloo)::

    torchrun --nproc-per-node 2 examples/train_zero.py --epochs 10

Both runs start from the same weights and see the same batches, so their loss curves should
coincide; each rank keeps Adam's state only for the parameters it owns.

Elastic mode (``--checkpoint-dir``) trains our side only and survives failures: it saves a
sharded checkpoint every ``--checkpoint-every`` steps and resumes from the latest committed one
at whatever world size torchrun restarts it with (see docs/elastic.md)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 1 \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --max-restarts 3 \
        examples/train_zero.py --checkpoint-dir /tmp/zero-ckpt --timeout 15
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
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

PHASE = "1 ZeRO"


def run_zero(cfg: TrainConfig, sides: Sequence[str] = ("torch", "ours")) -> list[RunMetrics]:
    """Train DDP + ZeroRedundancyOptimizer(Adam) once per side, step by step; needs a process group.

    Args:
        cfg: hyperparameters.
        sides: names in :data:`_impls.IMPLEMENTATIONS` (``"torch"``, ``"ours"``).

    Returns:
        One metrics object per side (losses averaged over ranks; the same on every rank).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    data = load_digits_split(seed=cfg.seed)
    batches = rank_batches(
        len(data.x_train), rank, world_size, cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps
    )
    models, optimizers = [], []
    for side in sides:
        model = make_mlp(cfg.seed, cfg.hidden)
        ddp = DistributedDataParallel(model)
        optimizer = IMPLEMENTATIONS[side].ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr
        )
        models.append(model)
        optimizers.append((ddp, optimizer))
    samples_per_step = cfg.batch_size * world_size
    progress = StepProgress(
        [f"ZeRO Adam ({side})" for side in sides], len(batches), samples_per_step, rank == 0
    )
    history = train_interleaved(
        [ddp_stepper(ddp, optimizer) for ddp, optimizer in optimizers],
        data.x_train,
        data.y_train,
        batches,
        progress,
    )

    runs = []
    for side, model, (_, optimizer), (losses, times) in zip(sides, models, optimizers, history):
        local_state = tensor_bytes(dict(optimizer.optim.state))
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (losses, local_state))
        per_rank_state = [int(state) for _, state in gathered]
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
        params = param_bytes(list(model.parameters()))
        impl = IMPLEMENTATIONS[side]
        runs.append(
            RunMetrics(
                phase=PHASE,
                run=f"ZeRO Adam ({side})",
                side=side,
                implementation={"ZeroRedundancyOptimizer": impl.source("ZeroRedundancyOptimizer")},
                losses=mean_over_ranks([rank_losses for rank_losses, _ in gathered]),
                step_times_ms=times,
                test_accuracy=accuracy,
                test_loss=test_loss,
                opt_state_bytes_per_rank=per_rank_state,
                opt_state_bytes_unsharded=sum(per_rank_state),
                # DDP all-reduces every gradient, then ZeRO broadcasts each parameter from its
                # owner: one gradient's and one parameter's worth of payload per step.
                comm_bytes_per_step=float(2 * params),
                samples_per_step=samples_per_step,
            )
        )
    return runs


def run_zero_elastic(cfg: TrainConfig, options: ElasticOptions) -> None:
    """Train our DDP + ZeroRedundancyOptimizer(Adam) from the latest checkpoint, checkpointing.

    The model parameters (replicated) and each rank's Adam shard go into one checkpoint every
    ``options.every`` steps; a restart at another world size reshards the Adam state on load.
    """
    root = options.root
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stop = StopRequest()
    data = load_digits_split(seed=cfg.seed)
    model = make_mlp(cfg.seed, cfg.hidden)
    ddp = DistributedDataParallel(model)
    optimizer = IMPLEMENTATIONS["ours"].ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr
    )
    checkpoint = ElasticCheckpoint(root, options.every, cfg.seed, zero=optimizer)
    params = {f"param.{i}": p.data for i, p in enumerate(model.parameters())}
    cursor, folder = checkpoint.load(params, {})
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
    schedule = DataSchedule(len(data.x_train), cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps)
    cursor, _ = train_elastic(
        ddp_stepper(ddp, optimizer),
        data.x_train,
        data.y_train,
        schedule,
        checkpoint,
        cursor,
        lambda: (params, {}),
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
    """Parse options, join the process group, train torch's and our ZeRO side by side, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_args(parser, epochs=10, lr=1e-3)
    add_elastic_args(parser)
    args = parser.parse_args(argv)
    cfg = train_config(args)
    setup_worker()
    rank, _ = init_process_group_from_env(cfg.timeout_s)
    options = elastic_options(args)
    if options is not None:
        run_failing_fast(lambda: run_zero_elastic(cfg, options), options.root)
        destroy_process_group()
        return []
    try:
        runs = run_zero(cfg)
        dist.barrier()
    finally:
        destroy_process_group()
    if rank == 0:
        print_summary(runs)
        write_metrics(args.metrics, PHASE, runs)
    return runs


if __name__ == "__main__":
    main()
