"""Parameter-server model parallelism over RPC with DistributedOptimizer: ours vs torch's.

Launch with torchrun (rank 0 is the parameter server, every other rank a trainer)::

    torchrun --nproc-per-node 2 examples/train_rpc_ps.py --epochs 5

The parameter server owns the body of the classifier (three ReLU layers); each trainer owns a
head, runs the body remotely with ``rpc_sync``, back-propagates with distributed autograd, and
steps the remote and local parameters together with ``DistributedOptimizer(Adam)``. Both sides
train at once, step by step, on separate copies of the same seeded model.
"""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn
from torch.distributed import rpc
from torch.nn.functional import cross_entropy

from _common import (
    N_FEATURES,
    RunMetrics,
    Stepper,
    StepProgress,
    TrainConfig,
    adam_state_bytes,
    add_train_args,
    evaluate,
    load_digits_split,
    make_mlp,
    print_summary,
    rank_batches,
    setup_worker,
    train_config,
    train_interleaved,
    write_metrics,
)
from _impls import IMPLEMENTATIONS

PHASE = "3 RPC PS"
SIDES = ("torch", "ours")


def worker_name(rank: int) -> str:
    """RPC name of ``rank``: the parameter server is rank 0, trainers follow."""
    return "ps" if rank == 0 else f"trainer{rank}"


def _body_forward(body: rpc.RRef[nn.Module], x: Tensor) -> Tensor:
    """On the parameter server: run the body (recorded by distributed autograd)."""
    return body.local_value()(x)  # type: ignore[no-any-return]


@torch.no_grad()
def _body_eval(body: rpc.RRef[nn.Module], x: Tensor) -> Tensor:
    """On the parameter server: run the body without recording autograd."""
    return body.local_value()(x)  # type: ignore[no-any-return]


_TURNS_GUARD = threading.Lock()
_TURNS: dict[int, threading.Lock] = {}


def _turn_lock(body: rpc.RRef[nn.Module]) -> threading.Lock:
    """On the parameter server: the lock that gives one trainer at a time a step on ``body``."""
    with _TURNS_GUARD:
        return _TURNS.setdefault(id(body.local_value()), threading.Lock())


def _take_turn(body: rpc.RRef[nn.Module], timeout_s: float) -> None:
    """On the parameter server: wait until no other trainer is stepping ``body``."""
    if not _turn_lock(body).acquire(timeout=timeout_s):
        raise TimeoutError(f"no turn on the parameter server's body within {timeout_s} s")


def _end_turn(body: rpc.RRef[nn.Module]) -> None:
    """On the parameter server: let the next trainer step ``body``."""
    _turn_lock(body).release()


def _param_rrefs(module: rpc.RRef[nn.Module]) -> list[rpc.RRef[Tensor]]:
    """On the owner: an RRef per parameter of ``module``."""
    return [rpc.RRef(p) for p in module.local_value().parameters()]


class _RemoteBody(nn.Module):
    """The parameter server's body seen from a trainer: forward is one ``rpc_sync``."""

    def __init__(self, body: rpc.RRef[nn.Module], timeout_s: float) -> None:
        super().__init__()
        self.body = body
        self.timeout_s = timeout_s

    def forward(self, x: Tensor) -> Tensor:
        fn = _body_forward if torch.is_grad_enabled() else _body_eval
        return rpc.rpc_sync(  # type: ignore[no-any-return]
            self.body.owner(), fn, args=(self.body, x), timeout=self.timeout_s
        )


def _rpc_stepper(model: nn.Sequential, optimizer: Any, shared: bool, timeout_s: float) -> Stepper:
    """Return a step function: forward through the remote body, distributed backward, step.

    With several trainers (``shared``) each step is one turn on the server's body: another
    trainer's in-place update in the middle of this step's backward would change tensors that
    backward still needs (a synchronous parameter server; the turn costs two small RPCs).
    """
    remote_body = model[0]
    assert isinstance(remote_body, _RemoteBody)
    body = remote_body.body

    def step(xb: Tensor, yb: Tensor) -> Tensor:
        if shared:
            rpc.rpc_sync(body.owner(), _take_turn, args=(body, timeout_s), timeout=timeout_s * 2)
        try:
            with dist_autograd.context() as context_id:
                loss = cross_entropy(model(xb), yb)
                dist_autograd.backward(context_id, [loss])  # type: ignore[attr-defined]
                optimizer.step(context_id)
        finally:
            if shared:
                rpc.rpc_sync(body.owner(), _end_turn, args=(body,), timeout=timeout_s)
        return loss.detach()

    return step


def run_trainer(
    bodies: list[rpc.RRef[nn.Module]], cfg: TrainConfig, index: int, n_trainers: int
) -> list[dict[str, Any]]:
    """On trainer ``index``: train one run per side against the parameter server's bodies.

    Args:
        bodies: one body per side in :data:`SIDES`, owned by the parameter server.
        cfg: hyperparameters (Adam at ``cfg.lr``).
        index: this trainer's index among the trainers (its data shard).
        n_trainers: number of trainers sharing the data.

    Returns:
        One metrics dictionary per side.
    """
    data = load_digits_split(seed=cfg.seed)
    batches = rank_batches(
        len(data.x_train), index, n_trainers, cfg.batch_size, cfg.epochs, cfg.seed, cfg.max_steps
    )
    models, optimizers, state_bytes = [], [], []
    for side, body in zip(SIDES, bodies):
        head = make_mlp(cfg.seed, cfg.hidden)[1]
        model = nn.Sequential(_RemoteBody(body, cfg.timeout_s), head)
        remote = rpc.rpc_sync(body.owner(), _param_rrefs, args=(body,), timeout=cfg.timeout_s)
        local = [rpc.RRef(p) for p in head.parameters()]
        optimizer = IMPLEMENTATIONS[side].DistributedOptimizer(
            torch.optim.Adam, remote + local, lr=cfg.lr
        )
        models.append(model)
        optimizers.append(optimizer)
        body_params = list(make_mlp(cfg.seed, cfg.hidden)[0].parameters())
        # Adam's state lives with the parameters: the body's on the server (one copy per
        # trainer's optimizer), the head's on the trainer.
        state_bytes.append(
            (n_trainers * adam_state_bytes(body_params), adam_state_bytes(list(head.parameters())))
        )
    samples_per_step = cfg.batch_size * n_trainers
    progress = StepProgress(
        [f"DistOptim Adam ({side})" for side in SIDES],
        len(batches),
        samples_per_step,
        enabled=index == 0,
    )
    steppers = [
        _rpc_stepper(model, opt, n_trainers > 1, cfg.timeout_s)
        for model, opt in zip(models, optimizers)
    ]
    history = train_interleaved(steppers, data.x_train, data.y_train, batches, progress)
    results = []
    for side, model, (losses, times), (server, head_bytes) in zip(
        SIDES, models, history, state_bytes
    ):
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
        results.append(
            {
                "side": side,
                "losses": losses,
                "times": times,
                "accuracy": accuracy,
                "test_loss": test_loss,
                "state": [server] + [head_bytes] * n_trainers,
                "unsharded": adam_state_bytes(list(make_mlp(cfg.seed, cfg.hidden).parameters())),
                # Per step: the batch goes to the server, activations come back, and their
                # gradients go to the server again (the optimizer's step messages are tiny).
                "comm": float(cfg.batch_size * (N_FEATURES + 2 * cfg.hidden) * 4),
                "samples_per_step": samples_per_step,
            }
        )
    return results


def run_parameter_server(cfg: TrainConfig, world_size: int) -> list[RunMetrics]:
    """On the parameter server: create the bodies, drive every trainer, collect metrics."""
    if world_size < 2:
        raise ValueError(f"need at least 2 processes (a server and a trainer), got {world_size}")
    bodies = [rpc.RRef(make_mlp(cfg.seed, cfg.hidden)[0]) for _ in SIDES]
    n_trainers = world_size - 1
    futures = [
        rpc.rpc_async(
            worker_name(rank),
            run_trainer,
            args=(bodies, cfg, rank - 1, n_trainers),
            timeout=cfg.timeout_s * 10,
        )
        for rank in range(1, world_size)
    ]
    per_trainer = [future.wait() for future in futures]
    runs = []
    for side_index, side in enumerate(SIDES):
        reports = [trainer[side_index] for trainer in per_trainer]
        first = reports[0]
        runs.append(
            RunMetrics(
                phase=PHASE,
                run=f"DistOptim Adam ({side})",
                side=side,
                implementation={
                    "DistributedOptimizer": IMPLEMENTATIONS[side].source("DistributedOptimizer")
                },
                losses=[
                    sum(values) / len(values)
                    for values in zip(*(report["losses"] for report in reports))
                ],
                step_times_ms=first["times"],
                test_accuracy=first["accuracy"],
                test_loss=first["test_loss"],
                opt_state_bytes_per_rank=first["state"],
                opt_state_bytes_unsharded=first["unsharded"],
                comm_bytes_per_step=first["comm"],
                samples_per_step=first["samples_per_step"],
                extra={"trainers": n_trainers},
            )
        )
    return runs


def main(argv: list[str] | None = None) -> list[RunMetrics]:
    """Parse options, join RPC, run the parameter server (rank 0) or serve as a trainer."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_train_args(parser, epochs=5, lr=1e-3)
    args = parser.parse_args(argv)
    cfg = train_config(args)
    setup_worker()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=cfg.timeout_s, num_worker_threads=16)
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options
    )
    runs: list[RunMetrics] = []
    try:
        if rank == 0:
            runs = run_parameter_server(cfg, world_size)
    finally:
        # Waits for every rank's outstanding work; trainers serve the server until then.
        rpc.shutdown(graceful=True, timeout=cfg.timeout_s)
    if rank == 0:
        print_summary(runs)
        write_metrics(args.metrics, PHASE, runs)
    return runs


if __name__ == "__main__":
    main()
