"""Small typed wrappers over torch.distributed process groups.

Every compat class resolves ``process_group=None`` to the default (WORLD) group, maps group ranks
to global ranks for collectives that take a global ``src``/``dst``, and fails with a clear error
instead of a hang or a cryptic message when the default group was never initialised.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_objects",
    "broadcast_object",
    "global_rank",
    "group_rank",
    "group_size",
    "receiver_group",
    "recv_object",
    "require_initialized",
    "resolve_group",
    "send_object",
    "wait_work",
]


def require_initialized(what: str = "this operation") -> None:
    """Raise a clear error when torch.distributed has no default process group.

    Args:
        what: the operation that needs the group, quoted in the message.

    Raises:
        RuntimeError: if torch.distributed is unavailable or not initialised.
    """
    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs the default process group: call "
            "torch.distributed.init_process_group(...) first (e.g. launch with torchrun)."
        )


def resolve_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """Return ``process_group``, or the default WORLD group when it is None.

    Args:
        process_group: a process group or None for the default group.

    Raises:
        RuntimeError: if the default group is needed but not initialised.
    """
    require_initialized("resolving the process group")
    if process_group is None:
        world = dist.group.WORLD
        assert world is not None
        return world
    return process_group


def group_rank(process_group: ProcessGroup | None = None) -> int:
    """This process's rank inside ``process_group`` (-1 when it is not a member)."""
    return dist.get_rank(resolve_group(process_group))


def group_size(process_group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``process_group``."""
    return dist.get_world_size(resolve_group(process_group))


def global_rank(process_group: ProcessGroup | None, rank_in_group: int) -> int:
    """Map a rank of ``process_group`` to its global rank (what ``src``/``dst`` arguments take).

    Args:
        process_group: the group; None means WORLD, where both ranks coincide.
        rank_in_group: a rank in ``[0, group_size)``.

    Raises:
        ValueError: if ``rank_in_group`` is outside the group.
    """
    group = resolve_group(process_group)
    size = dist.get_world_size(group)
    if not 0 <= rank_in_group < size:
        raise ValueError(f"rank {rank_in_group} is not in a process group of size {size}")
    if group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def broadcast_object(
    obj: Any,
    src_rank_in_group: int,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Any:
    """Broadcast a picklable object from ``src_rank_in_group`` to every rank of the group.

    Args:
        obj: the object on the source rank (ignored elsewhere).
        src_rank_in_group: the source, as a rank of ``process_group``.
        process_group: the group (None for WORLD).
        device: staging device for the pickled bytes (CUDA for NCCL groups).

    Returns:
        The source rank's object, on every rank.
    """
    group = resolve_group(process_group)
    holder = [obj]
    dist.broadcast_object_list(
        holder, src=global_rank(group, src_rank_in_group), group=group, device=device
    )
    return holder[0]


def all_gather_objects(obj: Any, process_group: ProcessGroup | None = None) -> list[Any]:
    """Gather one picklable object from every rank of the group, in group-rank order."""
    group = resolve_group(process_group)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def send_object(
    obj: Any,
    dst_rank_in_group: int,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> None:
    """Send a picklable object to one rank of the group (point to point; pair with recv_object).

    Args:
        obj: the object to send.
        dst_rank_in_group: the receiver, as a rank of ``process_group``.
        process_group: the group (None for WORLD).
        device: staging device for the pickled bytes (CUDA for NCCL groups).
    """
    group = resolve_group(process_group)
    dist.send_object_list([obj], group=group, device=device, group_dst=dst_rank_in_group)


def recv_object(
    src_rank_in_group: int,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Any:
    """Receive the object that ``src_rank_in_group`` sends with :func:`send_object`.

    Args:
        src_rank_in_group: the sender, as a rank of ``process_group``.
        process_group: the group (None for WORLD).
        device: staging device for the pickled bytes (CUDA for NCCL groups).

    Returns:
        The sender's object (tensors come back on the device they were pickled from).
    """
    group = resolve_group(process_group)
    holder: list[Any] = [None]
    dist.recv_object_list(holder, group=group, device=device, group_src=src_rank_in_group)
    return holder[0]


def receiver_group(process_group: ProcessGroup | None, to: int) -> tuple[ProcessGroup, int, int]:
    """Resolve the group of a gather onto group rank ``to`` and check ``to`` on every rank.

    Returns:
        ``(group, world_size, this rank in the group)``.

    Raises:
        ValueError: if ``to`` is not a rank of the group (raised on every rank: no hang).
    """
    group = resolve_group(process_group)
    world_size = group_size(group)
    if not 0 <= to < world_size:
        raise ValueError(f"`to` must be a rank in [0, {world_size}), got {to}")
    return group, world_size, group_rank(group)


def wait_work(work: dist.Work | None, timeout: timedelta | None, what: str, hint: str = "") -> None:
    """Wait for an asynchronous send, receive or collective; fail clearly instead of hanging.

    Args:
        work: the request (None, as p2p calls return on ranks outside the group: no wait).
        timeout: the longest wait (None: the process group's own timeout).
        what: what the request does, for the message (``"receive from group rank 1"``).
        hint: a sentence appended to the message (what usually causes it).

    Raises:
        RuntimeError: if the request fails or does not finish in time.
    """
    if work is None:
        return
    suffix = f"; {hint}" if hint else ""
    after = f" after {timeout}" if timeout is not None else ""
    try:
        done = work.wait() if timeout is None else work.wait(timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{what} failed or timed out{after} ({e}){suffix}") from e
    if done is False:
        raise RuntimeError(f"{what} did not finish{after}{suffix}")
