"""A failed collective as one clear error: which rank failed, what was kept, how to resume.

When a peer dies or hangs, gloo/NCCL raise a bare ``RuntimeError`` ("Connection reset by peer",
"Timed out waiting 1800000ms for recv operation") that names neither the failed rank nor what
the caller's data now holds. :func:`collective_guard` turns such errors into
:class:`CollectiveFailedError`, whose message names the failed rank(s) and says how to resume.

Finding the failed rank: gloo's message names a socket address, not a rank, and the ports are
per connection. Instead, every surviving rank checks in on the default c10d store under a key
unique to the group and the failure; the ranks that have not checked in when this rank's short
window (:data:`CHECK_IN_WINDOW_S`) closes are suspects. Survivors do not fail at the same
moment: one whose peer's socket closed fails at once, one blocked on that survivor waits for
its own timeout. Check-ins stay on the store, so a late survivor sees the early ones; an early
one tells a late survivor from a dead rank by its heartbeat: while a rank is inside a guarded
block a thread bumps a counter on the store every :data:`HEARTBEAT_S` (a SIGKILLed rank's
counter stops, a live rank blocked in a collective keeps beating). The suspects that do not
beat are named; when all of them beat (a hung rank, not a dead one) they all are. A rank that
waited on one peer in a point-to-point exchange (a gather's receiver) knows that peer failed:
it names it at once (:class:`GuardContext`), checks in with it, and survivors that check in
later name it too. When the store cannot be reached (its host, global rank 0, may be the dead
one) the message says "a peer in ranks [...]" instead.

Example::

    >>> # xdoctest: +SKIP("needs a process group")
    >>> with collective_guard("average_parameters", group, kept="the parameters are unchanged"):
    ...     dist.all_reduce(buffer, group=group)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException

from dist_runtime.process_group import resolve_group

__all__ = [
    "CHECK_IN_WINDOW_S",
    "HEARTBEAT_S",
    "CollectiveFailedError",
    "GuardContext",
    "collective_guard",
    "is_collective_failure",
    "name_failed",
    "unresponsive_ranks",
]

#: How long survivors wait for each other to check in after a failure (seconds).
CHECK_IN_WINDOW_S = 2.0
#: How often a rank inside a guarded block bumps its heartbeat on the store (seconds).
HEARTBEAT_S = 0.25
_CHECK_IN = "distopt/collective_failure/"
_HEARTBEAT = "distopt/heartbeat/"

RESUME_HINT = (
    "To resume: re-form the process group (destroy it and create a new one over the live ranks, "
    "or let `torchrun --max-restarts=N` restart the job) and retry the call, or restart from "
    "the latest sharded checkpoint (dist_runtime.sharded_checkpoint.latest_checkpoint)."
)

# Words of gloo/NCCL/c10d transport errors (a RuntimeError that carries one is a failed peer).
_MARKERS = (
    "gloo",
    "nccl",
    "timed out",
    "timeout",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "socket",
    "peer",
)

# Failures seen so far per group name: keys of one failure never collide with an earlier one's.
_FAILURES_SEEN: dict[str, int] = {}


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a failed collective (a dead, hung or unreachable peer).

    Args:
        exc: the exception raised by a collective or by code around one.

    Returns:
        True for ``torch.distributed.DistError``, a ``RuntimeError`` with a transport message,
        and DCP's ``CheckpointException`` wrapping one of those.
    """
    if isinstance(exc, CollectiveFailedError):
        return True
    if isinstance(exc, dist.DistError):
        return True
    if isinstance(exc, CheckpointException):
        return any(is_collective_failure(inner) for inner, _ in exc.failures.values())
    if isinstance(exc, RuntimeError):
        message = str(exc).lower()
        return any(marker in message for marker in _MARKERS)
    return False


class _Heartbeat:
    """Bumps this rank's counter on the default store while a guarded block runs.

    One daemon thread per default store, started at the first guarded block. It beats every
    :data:`HEARTBEAT_S` while one block runs, starting :data:`HEARTBEAT_S` into it, and waits
    (no store traffic) whenever none runs, so nothing touches the store at shutdown.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._running = threading.Event()
        self._store: Any = None
        self._epoch = 0  # bumped whenever a block starts with none running

    def enter(self) -> None:
        """A guarded block starts (nested blocks count)."""
        with self._lock:
            self._active += 1
            if self._active == 1:
                self._epoch += 1
                self._start_if_needed()
                self._running.set()

    def exit(self) -> None:
        """A guarded block ends."""
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._running.clear()

    def _start_if_needed(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            key = _HEARTBEAT + str(dist.get_rank())
        except Exception:  # no process group: nothing to beat on
            return
        if store is self._store:
            return
        self._store = store
        thread = threading.Thread(
            target=self._beat, args=(store, key), name="distopt-heartbeat", daemon=True
        )
        thread.start()

    def _beat(self, store: Any, key: str) -> None:
        while True:
            self._running.wait()
            epoch = self._epoch
            # Beat only in a block that has run for HEARTBEAT_S already: quick healthy calls (a
            # step of a few milliseconds, back to back) send nothing; a rank blocked in a
            # collective beats.
            time.sleep(HEARTBEAT_S)
            if self._store is not store:  # a new default group: its own thread beats
                return
            if not self._running.is_set() or self._epoch != epoch:
                continue
            try:
                store.add(key, 1)
            except Exception:  # the store is gone (its host died or the group was destroyed)
                return


_HEART = _Heartbeat()


def _beats(store: Any, ranks: Sequence[int]) -> dict[int, int]:
    return {r: int(store.add(_HEARTBEAT + str(r), 0)) for r in ranks}


def name_failed(
    ranks: Sequence[int],
    checked_in: Mapping[int, str],
    beating: Sequence[int] = (),
) -> list[int]:
    """Which ranks to name after a check-in (pure).

    Args:
        ranks: the global ranks of the group.
        checked_in: the survivors that checked in, each with the rank it saw fail directly
            (``""`` when it only saw the collective fail).
        beating: the ranks whose heartbeat advanced during the window (alive, maybe blocked).

    Returns:
        The ranks that did not check in, less those that beat (unless all of them do: then a
        hung rank is among them), narrowed to the ranks some survivor saw fail directly when
        that leaves any; empty when every rank checked in.
    """
    missing = [r for r in ranks if r not in checked_in]
    silent = [r for r in missing if r not in beating]
    named = silent or missing
    seen = {int(v) for v in checked_in.values() if v}
    return [r for r in named if r in seen] or named


def unresponsive_ranks(
    process_group: ProcessGroup | None = None,
    window_s: float = CHECK_IN_WINDOW_S,
    failed_peer: int | None = None,
) -> list[int] | None:
    """After a failed collective, check in and name the global ranks of the group that failed.

    Every surviving rank of the failed collective calls this once per failure (the guard
    does): it checks in on the default store, then waits up to ``window_s`` for the other
    ranks of the group (see the module docstring for how the suspects are narrowed).

    Args:
        process_group: the group whose collective failed (None for WORLD).
        window_s: how long to wait for the others.
        failed_peer: a global rank this rank saw fail directly (a point-to-point peer): it is
            named without waiting, and the check-in tells later survivors.

    Returns:
        The global ranks named (sorted), or None when the store could not be used (it lives on
        global rank 0, which may be the dead rank).
    """
    try:
        group = resolve_group(process_group)
        ranks = dist.get_process_group_ranks(group)
        name = group.group_name
        count = _FAILURES_SEEN.get(name, 0)
        _FAILURES_SEEN[name] = count + 1
        store = dist.distributed_c10d._get_default_store()
        prefix = f"{_CHECK_IN}{name}/{count}/"
        store.set(prefix + str(dist.get_rank()), "" if failed_peer is None else str(failed_peer))
    except Exception:  # the store is unreachable too: say so rather than guess
        return None if failed_peer is None else [failed_peer]
    if failed_peer is not None:
        return [failed_peer]
    try:
        missing = _not_checked_in(store, prefix, ranks)
        before = _beats(store, missing)
        deadline = time.monotonic() + window_s
        while missing and time.monotonic() < deadline:
            time.sleep(0.02)
            missing = _not_checked_in(store, prefix, missing)
        after = _beats(store, missing)
        checked_in = {r: store.get(prefix + str(r)).decode() for r in ranks if r not in missing}
    except Exception:
        return None
    return name_failed(ranks, checked_in, [r for r in missing if after[r] != before[r]])


def _not_checked_in(store: Any, prefix: str, ranks: Sequence[int]) -> list[int]:
    return [r for r in ranks if not store.check([prefix + str(r)])]


class CollectiveFailedError(RuntimeError):
    """A collective failed because a peer died, hung or became unreachable.

    A ``RuntimeError`` like torch's own errors, so existing handlers still catch it.

    Attributes:
        operation: what was running (e.g. ``"average_parameters"``).
        group_ranks: the global ranks of the group.
        failed_ranks: the global ranks found dead or hung, or None when unknown.
        kept: what the failed call left unchanged (its promise to the caller).
        cause: the message of the original error.
    """

    def __init__(
        self,
        operation: str,
        group_ranks: Sequence[int],
        failed_ranks: Sequence[int] | None,
        kept: str,
        cause: str,
    ) -> None:
        self.operation = operation
        self.group_ranks = list(group_ranks)
        self.failed_ranks = None if failed_ranks is None else list(failed_ranks)
        self.kept = kept
        self.cause = cause
        if self.failed_ranks:
            if len(self.failed_ranks) == 1:
                who = f"rank {self.failed_ranks[0]} did not answer (dead or hung: it did not"
            else:
                who = f"ranks {self.failed_ranks} did not answer (dead or hung: they did not"
            who += " check in on the c10d store after the failure)"
        else:
            peers = [r for r in self.group_ranks if r != _this_rank()]
            who = f"a peer in ranks {peers} is dead, hung or unreachable (could not tell which)"
        first_line = cause.strip().splitlines()[0] if cause.strip() else "no message"
        super().__init__(
            f"{operation} failed: {who}. {kept} {RESUME_HINT} Cause: {first_line[:300]}"
        )


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class GuardContext:
    """What a guarded block knows about its peers: set ``peer`` around a point-to-point wait.

    Attributes:
        peer: the global rank whose data the block is waiting for right now, or None (a
            collective of the whole group, or a send). Set it only where that rank's failure is
            the only way the wait can fail (a receiver waiting on one sender): at a failure it
            is named at once and the check-in tells the later survivors. A sender must not set
            its receiver: the receiver may have given up on another, dead, sender.
    """

    __slots__ = ("peer",)

    def __init__(self) -> None:
        self.peer: int | None = None


@contextlib.contextmanager
def collective_guard(
    operation: str,
    process_group: ProcessGroup | None = None,
    kept: str = "Nothing was changed.",
    window_s: float = CHECK_IN_WINDOW_S,
) -> Iterator[GuardContext]:
    """Turn a collective failure raised in the block into :class:`CollectiveFailedError`.

    Other exceptions (bad input, programming errors) pass through unchanged. A
    :class:`CollectiveFailedError` from an inner guard keeps its ranks and takes this guard's
    ``operation`` and ``kept``.

    Args:
        operation: what the block does, for the message.
        process_group: the group the block communicates over (None for WORLD).
        kept: what the caller can rely on after the failure (e.g. "The parameters are
            unchanged."); the block must make it true before the exception leaves it.
        window_s: how long to wait for the other survivors (see :func:`unresponsive_ranks`).

    Yields:
        A :class:`GuardContext` (point-to-point code sets ``peer`` before each wait).

    Raises:
        CollectiveFailedError: when the block raised a collective failure.
    """
    context = GuardContext()
    _HEART.enter()
    try:
        yield context
    except CollectiveFailedError as exc:
        if exc.kept == kept:
            raise
        # An inner guard named the ranks; restate the promise of this (outer) operation.
        raise CollectiveFailedError(
            f"{operation} ({exc.operation})", exc.group_ranks, exc.failed_ranks, kept, exc.cause
        ) from exc
    except BaseException as exc:
        if not is_collective_failure(exc):
            raise
        try:
            group_ranks = dist.get_process_group_ranks(resolve_group(process_group))
        except Exception:
            group_ranks = []
        failed = unresponsive_ranks(process_group, window_s, context.peer)
        raise CollectiveFailedError(operation, group_ranks, failed, kept, str(exc)) from exc
    finally:
        _HEART.exit()
