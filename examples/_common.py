"""Shared pieces of the examples: digits data, the classifier, the training loop, metrics.

The data set is scikit-learn's handwritten digits (1,797 8x8 images, bundled inside the
scikit-learn wheel, so nothing is downloaded). The model is a small MLP; the examples split it
differently (whole model under DDP, or body on a parameter server and head on a trainer), but
always build it from the same seed so every run starts from the same weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import cross_entropy

N_FEATURES = 64
N_CLASSES = 10
DEFAULT_HIDDEN = 256
DEFAULT_TIMEOUT_S = 120.0
QUICK_STEPS = 24


@dataclass(frozen=True)
class Digits:
    """Train / test split of the digits data, features standardised with train statistics."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> Digits:
    """Load scikit-learn's digits from the files bundled in its wheel and split them.

    Args:
        test_fraction: share of the 1,797 images held out for testing.
        seed: seed of the shuffle before the split.

    Returns:
        The split, as float32 features and int64 labels.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean = x[train].mean(dim=0)
    std = x[train].std(dim=0).clamp_min(1e-3)
    x = (x - mean) / std
    return Digits(x[train], y[train], x[test], y[test])


def make_mlp(seed: int, hidden: int = DEFAULT_HIDDEN) -> nn.Sequential:
    """Build the classifier: three ReLU layers (the body) and a linear head, seeded.

    Args:
        seed: seed of the weight initialisation (the global RNG is restored afterwards).
        hidden: width of the hidden layers.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        body = nn.Sequential(
            nn.Linear(N_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        head = nn.Linear(hidden, N_CLASSES)
    return nn.Sequential(body, head)


def rank_batches(
    n_samples: int,
    rank: int,
    world_size: int,
    batch_size: int,
    epochs: int,
    seed: int,
    max_steps: int | None = None,
) -> list[Tensor]:
    """Index batches of one rank: each epoch a seeded shuffle, each step a disjoint slice per rank.

    Every rank gets the same number of steps (the last partial global batch is dropped), as DDP
    needs.

    Args:
        n_samples: size of the training set.
        rank: this rank, in ``[0, world_size)``.
        world_size: number of ranks sharing the data.
        batch_size: samples per rank per step.
        epochs: passes over the data.
        seed: base seed of the per-epoch shuffles.
        max_steps: stop after this many steps (``None``: all epochs).
    """
    global_batch = batch_size * world_size
    steps_per_epoch = n_samples // global_batch
    if steps_per_epoch == 0:
        raise ValueError(
            f"batch_size * world_size = {global_batch} exceeds the {n_samples} training samples; "
            "use a smaller batch size or fewer ranks"
        )
    batches: list[Tensor] = []
    for epoch in range(epochs):
        order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed + epoch))
        for step in range(steps_per_epoch):
            start = step * global_batch + rank * batch_size
            batches.append(order[start : start + batch_size])
            if max_steps is not None and len(batches) >= max_steps:
                return batches
    return batches


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """Return ``(accuracy, mean cross-entropy)`` of ``model`` on ``(x, y)``."""
    logits = model(x)
    accuracy = float((logits.argmax(dim=1) == y).float().mean())
    return accuracy, float(cross_entropy(logits, y))


class StepProgress:
    """rich progress bars (one per run) with loss and throughput, drawn by one rank only.

    Args:
        labels: one bar per label.
        total: number of steps of every run.
        samples_per_step: samples consumed per step by all ranks together.
        enabled: draw the bars (``True`` on the reporting rank only).
    """

    def __init__(
        self, labels: Sequence[str], total: int, samples_per_step: int, enabled: bool
    ) -> None:
        self._samples_per_step = samples_per_step
        self._progress: Any = None
        self._tasks: list[Any] = []
        self._busy_s = [0.0] * len(labels)
        if not enabled:
            return
        from rich.markup import escape
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description:<26}"),
            BarColumn(bar_width=16),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TextColumn("{task.fields[rate]:>8,.0f} samples/s"),
            TimeElapsedColumn(),
        )
        self._tasks = [
            self._progress.add_task(escape(label), total=total, loss=float("nan"), rate=0.0)
            for label in labels
        ]

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, run: int, step: int, loss: float, step_s: float) -> None:
        """Record that run ``run`` finished ``step + 1`` steps, the last in ``step_s`` seconds."""
        self._busy_s[run] += step_s
        if self._progress is None:
            return
        rate = (step + 1) * self._samples_per_step / max(self._busy_s[run], 1e-9)
        self._progress.update(self._tasks[run], completed=step + 1, loss=loss, rate=rate)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


@dataclass
class RunMetrics:
    """What one training run reports (JSON-serialisable).

    ``comm_bytes_per_step`` is the tensor payload each rank hands to collectives or RPCs per
    step, averaged over the run and computed from the algorithm's schedule (not wire bytes).
    """

    phase: str
    run: str
    side: str
    implementation: dict[str, str]
    losses: list[float]
    step_times_ms: list[float]
    test_accuracy: float
    test_loss: float
    opt_state_bytes_per_rank: list[int]
    opt_state_bytes_unsharded: int
    comm_bytes_per_step: float
    samples_per_step: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last tenth of the steps (at least one step)."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)

    @property
    def step_time_ms(self) -> float:
        """Median step time, leaving out the first steps (warm-up) when there are enough."""
        times = self.step_times_ms[3:] if len(self.step_times_ms) > 6 else self.step_times_ms
        return statistics.median(times)

    def to_json(self) -> dict[str, Any]:
        """Return the fields plus the derived ``final_loss`` and ``step_time_ms``."""
        data = asdict(self)
        data["final_loss"] = self.final_loss
        data["step_time_ms"] = self.step_time_ms
        return data


class Stepper(Protocol):
    """One training run: ``step`` does a full optimizer step on a batch, returns the loss."""

    def __call__(self, xb: Tensor, yb: Tensor) -> Tensor: ...


def ddp_stepper(model: nn.Module, optimizer: Any) -> Stepper:
    """Return a step function: ``zero_grad``, forward, cross-entropy, backward, ``step``."""

    def step(xb: Tensor, yb: Tensor) -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(xb), yb)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        return loss.detach()

    return step


def train_interleaved(
    steppers: Sequence[Stepper],
    x: Tensor,
    y: Tensor,
    batches: Sequence[Tensor],
    progress: StepProgress,
) -> list[tuple[list[float], list[float]]]:
    """Train every run on the same batches, alternating runs step by step.

    Alternating (rather than one run after the other) exposes the runs to the same machine
    load, so their step times compare fairly on a busy machine.

    Returns:
        Per run: this rank's losses and step times in milliseconds.
    """
    history: list[tuple[list[float], list[float]]] = [([], []) for _ in steppers]
    with progress:
        for step, index in enumerate(batches):
            xb, yb = x[index], y[index]
            for run, stepper in enumerate(steppers):
                start = time.perf_counter()
                loss = float(stepper(xb, yb))
                elapsed = time.perf_counter() - start
                history[run][0].append(loss)
                history[run][1].append(elapsed * 1e3)
                progress.update(run, step, loss, elapsed)
    return history


def mean_over_ranks(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Average equally long per-rank series step by step."""
    return [sum(values) / len(values) for values in zip(*per_rank)]


def tensor_bytes(obj: Any) -> int:
    """Total bytes of every tensor nested in ``obj`` (dicts, lists, tuples)."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def param_bytes(params: Iterator[Tensor] | Sequence[Tensor]) -> int:
    """Total bytes of ``params``."""
    return sum(p.numel() * p.element_size() for p in params)


def adam_state_bytes(params: Sequence[Tensor]) -> int:
    """Bytes of Adam's state for ``params``: two moments per element and a float32 step each."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def init_process_group_from_env(timeout_s: float) -> tuple[int, int]:
    """Join the gloo process group that torchrun describes in the environment.

    Returns:
        ``(rank, world_size)``.
    """
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def destroy_process_group() -> None:
    """Leave the process group after collecting garbage.

    Objects in reference cycles (an optimizer holding work handles or the group) would
    otherwise be freed during interpreter shutdown, after the group is gone.
    """
    gc.collect()
    dist.destroy_process_group()


def setup_worker() -> None:
    """Per-process settings of every example worker: one intra-op thread, quiet TorchScript."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # Warnings torch itself raises on the torch side of the comparisons (not ours): its
    # DistributedOptimizer scripts functional optimizers (and forces that warning on with
    # simplefilter("always"), so it is dropped at display time), and rpc.shutdown gathers over
    # a backend object.
    for message, category in (
        (r"`torch\.jit\.script` is deprecated", DeprecationWarning),
        (r"You are using a Backend .* as a ProcessGroup", UserWarning),
    ):
        warnings.filterwarnings("ignore", message=message, category=category)
    show = warnings.showwarning

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if not str(message).startswith(_TORCH_FORCED_WARNING):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


_TORCH_FORCED_WARNING = "`TorchScript` support for functional optimizers is deprecated"


def write_metrics(path: str | None, phase: str, runs: Sequence[RunMetrics]) -> None:
    """Write ``{"phase": ..., "runs": [...]}`` to ``path`` (if given)."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"phase": phase, "runs": [run.to_json() for run in runs]}
    target.write_text(json.dumps(payload, indent=1) + "\n")


def print_summary(runs: Sequence[RunMetrics]) -> None:
    """Print one line per run (used when a script is launched by hand with torchrun)."""
    for run in runs:
        print(
            f"{run.phase:<15} {run.run:<28} acc {run.test_accuracy:6.2%}  "
            f"final loss {run.final_loss:.4f}  step {run.step_time_ms:7.3f} ms",
            flush=True,
        )


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters and limits shared by the example scripts."""

    epochs: int
    batch_size: int
    lr: float
    hidden: int
    seed: int
    max_steps: int | None
    timeout_s: float


def add_train_args(parser: argparse.ArgumentParser, *, epochs: int, lr: float) -> None:
    """Add the options every example script takes."""
    parser.add_argument("--epochs", type=int, default=epochs, help="passes over the data")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=lr, help="learning rate")
    parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN, help="hidden layer width")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and shuffles")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument(
        "--quick", action="store_true", help=f"one epoch, at most {QUICK_STEPS} steps (tests)"
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per collective / RPC"
    )
    parser.add_argument("--metrics", default=None, help="write the run metrics to this JSON file")


def train_config(args: argparse.Namespace) -> TrainConfig:
    """Build the config from parsed options (``--quick`` caps epochs and steps)."""
    max_steps = args.max_steps
    epochs = args.epochs
    if args.quick:
        epochs = 1
        max_steps = QUICK_STEPS if max_steps is None else min(max_steps, QUICK_STEPS)
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    return TrainConfig(
        epochs=epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        hidden=args.hidden,
        seed=args.seed,
        max_steps=max_steps,
        timeout_s=args.timeout,
    )
