"""Broadcast every rank's updated parameter shard to the whole group, with few collectives.

After a sharded optimizer step each rank has updated only the parameters it owns; this module
copies each shard from its owner to every other rank. Two entry points:

- :func:`broadcast_buckets` for flat buckets (``parameters_as_bucket_view=True``): one
  asynchronous broadcast per (device, rank) bucket, waited on together.
- :class:`ShardBroadcaster` for ordinary parameters: torch issues one broadcast per parameter,
  which costs a fixed overhead per collective (dominant for models with many small tensors). We
  broadcast large contiguous parameters in place and pack runs of small ones into reusable flat
  buffers of up to ``bucket_cap_bytes``, so a shard of hundreds of small tensors travels in one
  or a few messages. All collectives are issued asynchronously and waited on once.

The data that arrives is bit-for-bit the owner's data: packing only moves bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dist_runtime.buckets import params_by_device
from dist_runtime.process_group import group_rank, group_size, resolve_group

__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_DIRECT_MIN_BYTES",
    "ShardBroadcaster",
    "Waitable",
    "broadcast_buckets",
    "plan_chunks",
]

#: Parameters at least this large (and contiguous) are broadcast in place, without packing.
DEFAULT_DIRECT_MIN_BYTES = 1 << 20
#: Largest packed buffer; a run of small parameters is split into buffers of at most this size.
DEFAULT_BUCKET_CAP_BYTES = 32 << 20


class Waitable(Protocol):
    """What an asynchronous collective returns: something to ``wait()`` on."""

    def wait(self) -> object:
        """Block until the operation completes."""


def plan_chunks(
    nbytes: Sequence[int],
    contiguous: Sequence[bool],
    direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES,
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
) -> list[list[int]]:
    """Group a rank's parameters (in order) into broadcast chunks.

    A contiguous parameter of at least ``direct_min_bytes`` is a chunk of its own (sent in
    place); the others are packed, in order, into chunks of at most ``bucket_cap_bytes`` (a
    single parameter larger than the cap still gets a chunk of its own).

    Args:
        nbytes: size in bytes of each parameter.
        contiguous: whether each parameter can be sent in place.
        direct_min_bytes: threshold for in-place sends.
        bucket_cap_bytes: capacity of a packed chunk.

    Returns:
        Lists of parameter indices; every index appears exactly once, in increasing order within
        and across chunks of the same kind.
    """
    chunks: list[list[int]] = []
    pending: list[int] = []
    pending_bytes = 0
    for index, (size, is_contiguous) in enumerate(zip(nbytes, contiguous)):
        if is_contiguous and size >= direct_min_bytes:
            chunks.append([index])
            continue
        if pending and pending_bytes + size > bucket_cap_bytes:
            chunks.append(pending)
            pending, pending_bytes = [], 0
        pending.append(index)
        pending_bytes += size
    if pending:
        chunks.append(pending)
    return chunks


@dataclass
class _Chunk:
    """One broadcast: a parameter sent in place, or several packed into ``buffer``."""

    src: int
    params: list[torch.Tensor]
    buffer: torch.Tensor | None = None
    numels: list[int] = field(default_factory=list)
    direct: torch.Tensor | None = None

    def tensor(self) -> torch.Tensor:
        """The tensor handed to the collective (allocating the pack buffer on first use)."""
        if self.buffer is None and len(self.params) == 1 and self.params[0].is_contiguous():
            return self._alias(self.params[0])
        if self.buffer is None:
            first = self.params[0]
            self.numels = [p.numel() for p in self.params]
            self.buffer = torch.empty(sum(self.numels), dtype=first.dtype, device=first.device)
        return self.buffer

    def _alias(self, param: torch.Tensor) -> torch.Tensor:
        """A detached alias of ``param``, kept while it still views the parameter's data.

        Handing the collective a long-lived tensor (not a fresh ``param.data`` that dies when
        this call returns) means gloo's worker thread never drops the last reference to a
        Python tensor, which aborts the process if that happens during interpreter shutdown.
        """
        alias = self.direct
        if alias is None or alias.data_ptr() != param.data_ptr() or alias.shape != param.shape:
            alias = self.direct = param.detach()
        return alias

    def pack(self) -> torch.Tensor:
        """Fill the buffer from the parameters (on the owner) and return the tensor to send."""
        tensor = self.tensor()
        if self.buffer is not None:
            torch.cat([p.data.reshape(-1) for p in self.params], out=self.buffer)
        return tensor

    def unpack(self) -> None:
        """Copy the received buffer back into the parameters (on the other ranks)."""
        if self.buffer is None:
            return
        for param, piece in zip(self.params, torch.split(self.buffer, self.numels)):
            param.data.copy_(piece.view_as(param.data))


class _UnpackOnWait:
    """Wraps a work handle so that waiting on it also scatters the packed data."""

    def __init__(self, work: Waitable, chunk: _Chunk) -> None:
        self._work = work
        self._chunk = chunk

    def wait(self) -> bool:
        self._work.wait()
        self._chunk.unpack()
        return True


class ShardBroadcaster:
    """Send each rank's parameter shard from its owner to all ranks in few broadcasts.

    The plan (which parameters travel together) depends only on the partition, the shapes and
    the devices, so it is the same on every rank; build a new broadcaster when the partition
    changes.

    Args:
        params_per_rank: ``params_per_rank[r]``: the parameters owned by group rank ``r``.
        process_group: the group (None for WORLD).
        direct_min_bytes: contiguous parameters at least this large are sent in place.
        bucket_cap_bytes: capacity of each packed buffer.

    Example::

        >>> sync = ShardBroadcaster(params_per_rank, group)
        >>> optimizer_step_on_my_shard()
        >>> sync.sync()  # every rank now holds every shard
    """

    def __init__(
        self,
        params_per_rank: Sequence[Sequence[torch.Tensor]],
        process_group: ProcessGroup | None = None,
        *,
        direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    ) -> None:
        self.process_group = resolve_group(process_group)
        self.world_size = group_size(self.process_group)
        self.rank = group_rank(self.process_group)
        if len(params_per_rank) != self.world_size:
            raise ValueError(
                f"params_per_rank has {len(params_per_rank)} entries but the group has "
                f"{self.world_size} ranks"
            )
        self._chunks_per_rank: list[list[_Chunk]] = [[] for _ in range(self.world_size)]
        for per_rank in params_by_device(params_per_rank).values():
            for src, params in enumerate(per_rank):
                plan = plan_chunks(
                    [p.numel() * p.element_size() for p in params],
                    [p.is_contiguous() for p in params],
                    direct_min_bytes,
                    bucket_cap_bytes,
                )
                self._chunks_per_rank[src].extend(
                    _Chunk(src, [params[i] for i in indices]) for indices in plan
                )

    @property
    def num_collectives(self) -> int:
        """How many broadcasts one :meth:`sync` issues."""
        return sum(len(chunks) for chunks in self._chunks_per_rank)

    def start(self, src: int) -> list[Waitable]:
        """Issue the broadcasts of rank ``src``'s shard; waiting on a handle completes it.

        Args:
            src: the owning group rank.

        Returns:
            One handle per broadcast; after ``wait()`` the parameters hold the owner's data.
        """
        handles: list[Waitable] = []
        for chunk in self._chunks_per_rank[src]:
            tensor = chunk.pack() if src == self.rank else chunk.tensor()
            work = dist.broadcast(tensor, group=self.process_group, group_src=src, async_op=True)
            assert work is not None
            if src == self.rank or chunk.buffer is None:
                handles.append(work)
            else:
                handles.append(_UnpackOnWait(work, chunk))
        return handles

    def sync(self) -> None:
        """Broadcast every shard from its owner and wait until all ranks hold all of them."""
        if self.world_size == 1:
            return
        handles: list[Waitable] = []
        for src in range(self.world_size):
            handles.extend(self.start(src))
        for handle in handles:
            handle.wait()


def broadcast_buckets(
    buckets: Sequence[Sequence[torch.Tensor]],
    process_group: ProcessGroup | None = None,
    src: int | None = None,
) -> list[Waitable]:
    """Issue one asynchronous broadcast per flat bucket, from the rank that owns it.

    Args:
        buckets: ``buckets[d][r]``: the bucket of the ``d``-th device owned by group rank ``r``.
        process_group: the group (None for WORLD).
        src: only broadcast the buckets of this group rank (all ranks' when None).

    Returns:
        The work handles, in issue order; wait on all of them.
    """
    group = resolve_group(process_group)
    handles: list[Waitable] = []
    ranks = range(group_size(group)) if src is None else [src]
    for rank in ranks:
        for per_rank in buckets:
            work = dist.broadcast(per_rank[rank], group=group, group_src=rank, async_op=True)
            assert work is not None
            handles.append(work)
    return handles
