"""Elastic training for the examples: checkpoint every N steps, resume at any world size.

The examples run under ``torchrun --nnodes MIN:MAX --rdzv-backend c10d --max-restarts K``:
torchrun restarts every worker when one fails or a node joins, and the restarted workers form a
group of whatever size is left. This module makes such a restart lose no committed work:

- :class:`DataCursor` is the data-loader position (epoch, offset in the epoch's shuffle, global
  step). The batch of each rank is a pure function of the cursor, the rank and the world size,
  so a run resumed at world size W draws exactly the batches an uninterrupted run at world size
  W draws from the same cursor (at a fixed world size the batches are those of
  :func:`_common.rank_batches`).
- :class:`ElasticCheckpoint` writes folder checkpoints with a commit marker
  (:mod:`dist_runtime.sharded_checkpoint`): the cursor and replicated tensors (model
  parameters) once, the optimizer sharded (ZeRO: every rank writes its shard in parallel,
  resharded on load), per-rank values (RNG state, local-SGD replicas) under the rank's name.
  A rank that did not exist when the checkpoint was written takes the values of rank
  ``rank % saved_world_size`` and a fresh RNG seeded by ``(seed, step, rank)``. Every read
  goes through :mod:`dist_runtime.safe_load` (DCP's ``.metadata`` with an allow-list, entries
  as plain data): a checkpoint that carries code is refused before any of it runs.
- :class:`StopRequest` turns SIGTERM (torchrun stopping its workers because a node joined, or
  a preemption notice forwarded by torchrun) into a checkpoint at the end of the current step:
  the ranks agree on stopping with a one-element all-reduce after every step.
- :func:`log_event` appends one JSON line per start, step, save and stop to
  ``<checkpoint root>/events.jsonl`` (the chaos tests read it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from _common import Stepper
from dist_runtime.safe_load import SafeFileSystemReader, SafeLoadPlanner, unwrap_unsafe
from dist_runtime.sharded_checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    new_checkpoint_folder,
)

EVENTS = "events.jsonl"
CURSOR_KEY = "cursor"
_EXTRA = "extra."


def add_elastic_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--checkpoint-dir`` and ``--checkpoint-every`` (elastic mode when the first is set)."""
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="elastic mode: checkpoint here every --checkpoint-every steps and resume from the "
        "latest committed checkpoint on start, at whatever world size torchrun gives",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints"
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=10.0,
        help="seconds a rank waits for its own SIGTERM after a peer's stop was checkpointed",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="sleep this long after every step (stands in for a heavier model in chaos tests)",
    )


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic-mode options of an example (see :func:`add_elastic_args`)."""

    root: str
    every: int
    grace_s: float
    step_delay_s: float


def elastic_options(args: argparse.Namespace) -> ElasticOptions | None:
    """The parsed elastic options, or None when ``--checkpoint-dir`` was not given."""
    if args.checkpoint_dir is None:
        return None
    return ElasticOptions(
        args.checkpoint_dir, args.checkpoint_every, args.stop_grace, args.step_delay
    )


@dataclass(frozen=True)
class DataCursor:
    """Position in the data: ``step`` steps done, next sample ``offset`` of epoch ``epoch``."""

    step: int = 0
    epoch: int = 0
    offset: int = 0


class DataSchedule:
    """The batches of every rank as a function of the cursor and the world size.

    Each epoch is a seeded shuffle of the training set; a step takes the next
    ``batch_size * world_size`` samples of it (rank ``r`` the ``r``-th slice); an epoch whose
    rest is shorter than one global batch is left (drop-last, as DDP needs equal steps).

    Args:
        n_samples: size of the training set.
        batch_size: samples per rank per step.
        epochs: passes over the data.
        seed: base seed of the per-epoch shuffles.
        max_steps: stop after this many global steps (``None``: all epochs).
    """

    def __init__(
        self, n_samples: int, batch_size: int, epochs: int, seed: int, max_steps: int | None
    ) -> None:
        self.n_samples = n_samples
        self.batch_size = batch_size
        self.epochs = epochs
        self.seed = seed
        self.max_steps = max_steps
        self._orders: dict[int, Tensor] = {}

    def _order(self, epoch: int) -> Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._orders[epoch] = torch.randperm(self.n_samples, generator=generator)
        return self._orders[epoch]

    def total_steps(self, world_size: int) -> int:
        """Number of steps of a whole run at a fixed world size."""
        cursor, steps = DataCursor(), 0
        while True:
            try:
                _, cursor = self.next(cursor, 0, world_size)
            except StopIteration:
                return steps
            steps += 1

    def next(self, cursor: DataCursor, rank: int, world_size: int) -> tuple[Tensor, DataCursor]:
        """This rank's indices for the step at ``cursor`` and the cursor after it.

        Raises:
            ValueError: if one global batch exceeds the training set.
            StopIteration: when the run is over (epochs or ``max_steps`` done).
        """
        global_batch = self.batch_size * world_size
        if global_batch > self.n_samples:
            raise ValueError(
                f"batch_size * world_size = {global_batch} exceeds the {self.n_samples} "
                "training samples; use a smaller batch size or fewer ranks"
            )
        epoch, offset = cursor.epoch, cursor.offset
        if offset + global_batch > self.n_samples:
            epoch, offset = epoch + 1, 0
        if epoch >= self.epochs or (self.max_steps is not None and cursor.step >= self.max_steps):
            raise StopIteration
        start = offset + rank * self.batch_size
        index = self._order(epoch)[start : start + self.batch_size]
        return index, DataCursor(cursor.step + 1, epoch, offset + global_batch)


class StopRequest:
    """SIGTERM -> checkpoint at the end of the current step on every rank, then exit.

    torchrun stops its workers with SIGTERM when a node joins (and forwards SIGTERM to them when
    it is itself asked to stop). Every rank calls :meth:`agreed` after each step: a one-element
    MAX all-reduce, so all ranks stop after the same step even if only one was signalled.
    """

    def __init__(self) -> None:
        self.signalled = False
        self._flag = torch.zeros(1, dtype=torch.int32)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = True

    def agreed(self) -> bool:
        """Whether any rank was signalled (collective: call on every rank after every step)."""
        self._flag.fill_(int(self.signalled))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def exit_after_checkpoint(self, grace_s: float) -> None:
        """Leave once the stop is checkpointed.

        A rank that was signalled itself exits (code 0; torchrun is stopping it anyway). A rank
        that stopped because a peer was signalled waits up to ``grace_s`` for its own agent's
        SIGTERM (the agent notices the joining node within its monitor interval), then exits
        with code 1 so that its agent restarts it rather than report success.
        """
        deadline = time.monotonic() + grace_s
        while not self.signalled and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(0 if self.signalled else 1)


def log_event(root: str, event: str, **fields: Any) -> None:
    """Append ``{"event": event, "time": ..., "pid": ..., **fields}`` to ``root/events.jsonl``."""
    record = {"event": event, "time": time.time(), "pid": os.getpid(), **fields}
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(os.path.join(root, EVENTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write with O_APPEND: lines of concurrent ranks do not interleave
    finally:
        os.close(fd)


def read_events(root: str) -> list[dict[str, Any]]:
    """The events logged under ``root`` so far, in order."""
    try:
        with open(os.path.join(root, EVENTS), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def rank_key(name: str, rank: int) -> str:
    """The checkpoint entry of rank ``rank``'s value ``name``."""
    return f"rank.{rank}.{name}"


def _safe_load(request: dict[str, Any], folder: str, no_dist: bool = False) -> None:
    """DCP's load through the safe reader and planner: nothing pickled in the checkpoint runs.

    Raises:
        UnsafeCheckpointError: if the checkpoint holds anything but plain data.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp_load(
                request,
                storage_reader=SafeFileSystemReader(folder),
                planner=SafeLoadPlanner(),
                no_dist=no_dist,
            )
        except BaseException as exc:  # DCP wraps errors in CheckpointException
            unsafe = unwrap_unsafe(exc)
            if unsafe is not None:
                raise unsafe from exc
            raise


def saved_keys(folder: str) -> dict[str, TensorStorageMetadata]:
    """The tensor entries of a checkpoint folder: saved values (``extra.`` prefix removed) and
    the optimizer's ``state.<index>.<name>`` entries.

    Raises:
        UnsafeCheckpointError: if the checkpoint's ``.metadata`` references anything but DCP's
            metadata types (read with :class:`~dist_runtime.safe_load.SafeFileSystemReader`).
    """
    metadata = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    return {
        key.removeprefix(_EXTRA): md
        for key, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def read_checkpoint_tensors(folder: str, names: list[str] | None = None) -> dict[str, Tensor]:
    """Read whole tensors of a checkpoint in this process (no process group), e.g. to compare.

    Args:
        folder: a committed checkpoint folder.
        names: the entries to read (default: all, optimizer state included).

    Raises:
        UnsafeCheckpointError: if the checkpoint holds anything but plain data.
    """
    metadata = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    full = {key.removeprefix(_EXTRA): key for key in metadata}
    saved = {
        key.removeprefix(_EXTRA): md
        for key, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    wanted = list(saved) if names is None else names
    request = {
        full[name]: torch.empty(tuple(saved[name].size), dtype=saved[name].properties.dtype)
        for name in wanted
    }
    _safe_load(request, folder, no_dist=True)
    return {name: request[full[name]] for name in wanted}


class ElasticCheckpoint:
    """Folder checkpoints of one training run: cursor, replicated and per-rank tensors, optimizer.

    Args:
        root: the checkpoint root (shared by all ranks; created if needed).
        every: save after every ``every`` steps.
        seed: the run's seed (fresh RNG streams of new ranks derive from it).
        zero: a :class:`compat_api.ZeroRedundancyOptimizer` whose shards go in the same
            checkpoint (its :meth:`save_sharded` / :meth:`load_sharded`), or None.
    """

    def __init__(self, root: str, every: int, seed: int, zero: Any = None) -> None:
        if every < 1:
            raise ValueError(f"--checkpoint-every must be at least 1, got {every}")
        self.root = root
        self.every = every
        self.seed = seed
        self.zero = zero
        self.last_saved_step = -1
        os.makedirs(root, exist_ok=True)

    def due(self, cursor: DataCursor) -> bool:
        """Whether the step just done ends a checkpoint interval."""
        return cursor.step % self.every == 0 and cursor.step != self.last_saved_step

    def save(
        self, cursor: DataCursor, replicated: dict[str, Tensor], per_rank: dict[str, Tensor]
    ) -> str:
        """Write and commit a checkpoint (collective: every rank, same ``replicated`` keys).

        Args:
            cursor: the data position after the last step.
            replicated: tensors equal on every rank (written once).
            per_rank: this rank's own tensors (saved under its rank).

        Returns:
            The committed folder.
        """
        rank, world_size = dist.get_rank(), dist.get_world_size()
        values: dict[str, Any] = {
            CURSOR_KEY: torch.tensor([cursor.step, cursor.epoch, cursor.offset, world_size]),
            rank_key("rng", rank): torch.get_rng_state(),
            **{name: t.detach().clone() for name, t in replicated.items()},
            **{rank_key(name, rank): t.detach().clone() for name, t in per_rank.items()},
        }
        if self.zero is not None:
            folder = str(self.zero.save_sharded(self.root, extra=values))
        else:
            folder = new_checkpoint_folder(self.root)
            dcp_save(
                {_EXTRA + key: value for key, value in values.items()},
                storage_writer=FileSystemWriter(folder),
            )
            commit_checkpoint(folder)
        self.last_saved_step = cursor.step
        return folder

    def load(
        self, replicated: dict[str, Tensor], per_rank: dict[str, Tensor]
    ) -> tuple[DataCursor, str | None]:
        """Load the latest committed checkpoint in place, if there is one (collective).

        Per-rank names missing from the checkpoint (an optimizer that had no state yet; all of
        them when there is no checkpoint) are removed from ``per_rank``; replicated ones must
        all be there.

        Args:
            replicated: tensors to fill (e.g. ``param.<i>`` -> the live parameter).
            per_rank: this rank's tensors to fill from rank ``rank % saved_world_size``.

        Returns:
            The cursor to go on from (step 0 without checkpoint) and the folder loaded.

        Raises:
            UnsafeCheckpointError: if the checkpoint holds anything but plain data (every read
                goes through :mod:`dist_runtime.safe_load`: nothing in it runs).
        """
        folder = latest_checkpoint(self.root)
        if folder is None:
            per_rank.clear()
            return DataCursor(), None
        rank = dist.get_rank()
        saved = saved_keys(folder)
        step, epoch, offset, saved_world = (int(v) for v in self._read_cursor(folder))
        source = rank % saved_world
        targets: dict[str, Any] = {CURSOR_KEY: torch.zeros(4, dtype=torch.int64)}
        for name, tensor in replicated.items():
            if name not in saved:
                raise ValueError(f"checkpoint {folder!r} has no entry {name!r}")
            targets[name] = tensor.detach()
        for name in list(per_rank):
            if rank_key(name, source) in saved:
                targets[rank_key(name, source)] = per_rank[name].detach()
            else:
                del per_rank[name]
        rng_key = rank_key("rng", rank)
        if rank < saved_world:
            targets[rng_key] = torch.empty_like(torch.get_rng_state())
        if self.zero is not None:
            self.zero.load_sharded(folder, extra=targets)
        else:
            _safe_load({_EXTRA + key: value for key, value in targets.items()}, folder)
        if rank < saved_world:
            torch.set_rng_state(targets[rng_key])
        else:
            # A rank that did not exist: a fresh stream, a function of (seed, step, rank).
            torch.manual_seed(self.seed * 1_000_003 + step * 1_009 + rank)
        self.last_saved_step = step
        return DataCursor(step, epoch, offset), folder

    @staticmethod
    def _read_cursor(folder: str) -> Tensor:
        return read_checkpoint_tensors(folder, [CURSOR_KEY])[CURSOR_KEY]


def run_failing_fast(train: Callable[[], None], root: str) -> None:
    """Run ``train``; on any error print it, log it and leave at once (exit code 1).

    A rank whose peer died fails its next collective; leaving without interpreter teardown (or
    a ``destroy_process_group`` on a broken group) lets torchrun see the failure and re-form
    the group sooner, so that the survivors rejoin in the same rendezvous round.
    """
    try:
        train()
    except SystemExit as stop:
        if stop.code in (0, None):
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code if isinstance(stop.code, int) else 1)
    except Exception as error:
        traceback.print_exc()
        log_event(root, "failed", error=f"{type(error).__name__}: {error}"[:300])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


#: Returns the tensors to save: ``(replicated, per_rank)``.
StateFn = Callable[[], tuple[dict[str, Tensor], dict[str, Tensor]]]


def train_elastic(
    stepper: Stepper,
    x: Tensor,
    y: Tensor,
    schedule: DataSchedule,
    checkpoint: ElasticCheckpoint,
    cursor: DataCursor,
    state: StateFn,
    stop: StopRequest,
    grace_s: float,
    step_delay_s: float = 0.0,
) -> tuple[DataCursor, list[float]]:
    """Train from ``cursor`` to the end of the schedule, checkpointing on the way.

    Saves after every ``checkpoint.every`` steps, after the last step, and after the step in
    which any rank got SIGTERM (then exits, see :meth:`StopRequest.exit_after_checkpoint`).

    Args:
        stepper: ``(xb, yb) -> loss``, one optimizer step.
        x: training features.
        y: training labels.
        schedule: the batches.
        checkpoint: where to save.
        cursor: the position to start from (from :meth:`ElasticCheckpoint.load`).
        state: returns ``(replicated, per_rank)`` tensors to save.
        stop: the SIGTERM flag.
        grace_s: see :meth:`StopRequest.exit_after_checkpoint`.
        step_delay_s: sleep after every step (``--step-delay``).

    Returns:
        The final cursor and this rank's losses of the steps run here.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses: list[float] = []
    while True:
        try:
            index, cursor = schedule.next(cursor, rank, world_size)
        except StopIteration:
            break
        losses.append(float(stepper(x[index], y[index])))
        if step_delay_s > 0:
            time.sleep(step_delay_s)
        if rank == 0:
            log_event(checkpoint.root, "step", step=cursor.step, world_size=world_size)
        stopping = stop.agreed()
        if stopping or checkpoint.due(cursor):
            _save(checkpoint, cursor, state, rank, world_size)
        if stopping:
            log_event(checkpoint.root, "stop", rank=rank, step=cursor.step)
            stop.exit_after_checkpoint(grace_s)
    if checkpoint.last_saved_step != cursor.step:
        _save(checkpoint, cursor, state, rank, world_size)
    return cursor, losses


def _save(
    checkpoint: ElasticCheckpoint, cursor: DataCursor, state: StateFn, rank: int, world_size: int
) -> None:
    replicated, per_rank = state()
    folder = checkpoint.save(cursor, replicated, per_rank)
    if rank == 0:
        log_event(
            checkpoint.root,
            "save",
            step=cursor.step,
            world_size=world_size,
            folder=os.path.basename(folder),
        )
