"""Balanced flat shards at run time: flat buffers, shard pieces, reduce-scatter and all-gather.

The trainable parameters of each ``(dtype, device)`` are copied into one flat buffer (laid out by
:func:`dist_runtime.flat_partition.plan_flat_layout`) and every ``param.data`` becomes a view of
it. Rank ``r`` owns one contiguous, equal-sized shard of each buffer and hands its local optimizer
the *pieces* of that shard: one 1-D view per parameter slice, so a parameter cut by a shard
boundary is updated half here and half on the next rank, and every piece keeps its parameter's
param group (hyperparameters) and its ``grad is None`` status. Only elementwise optimizers give
the same result on pieces as on whole parameters (see :func:`check_elementwise_optimizer`).

One training step::

    shards.reduce_scatter_grads()   # or attach_local_grads() when DDP already averaged them
    shards.clip_grad_norm_(1.0)     # optional: one all-reduce of one scalar
    local_optimizer.step()          # updates this rank's shard in place
    shards.all_gather_params()      # one all_gather per buffer

Communication: reduce-scatter + all-gather move what one all-reduce moves (DDP's volume:
``(N - 1) / N`` of each buffer each way per rank). gloo's own ``reduce_scatter`` (torch 2.13)
sends as many bytes as an all-reduce, so on gloo the gradients go round a ring of point-to-point
sends instead (:func:`dist_runtime.ring_reduce_scatter.ring_reduce_scatter`); other backends
(NCCL) use the native collective. A backend that lacks one of them falls back to ``all_reduce``
(and ``all_gather`` into chunk views); :attr:`FlatShards.collectives` says which ones run
(measured in ``benchmarks/zero_flat.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from dist_runtime.flat_partition import FlatLayout, group_by_key, plan_flat_layout
from dist_runtime.piece_state import Piece
from dist_runtime.process_group import group_rank, group_size, resolve_group
from dist_runtime.ring_reduce_scatter import ring_reduce_scatter
from functional_optim import ALGORITHMS
from functional_optim.lowbit import Placement, Sharing

__all__ = [
    "FlatBucket",
    "FlatShards",
    "check_elementwise_optimizer",
    "clip_grads_by_global_norm",
    "elementwise_optimizers",
]


def elementwise_optimizers() -> tuple[type[torch.optim.Optimizer], ...]:
    """The torch.optim classes whose update of an element reads only that element's grad and
    state: those of the registry's entries declared ``elementwise``."""
    found = (getattr(torch.optim, a.torch_name, None) for a in ALGORITHMS if a.elementwise)
    return tuple(c for c in found if isinstance(c, type))


_UNSUPPORTED = ("not supported", "does not support", "not implemented", "unsupported")


def check_elementwise_optimizer(optimizer_class: Any) -> None:
    """Reject a local optimizer that cannot update parameters piece by piece.

    A class may declare ``elementwise_update = True`` (each element's update reads only that
    element's gradient and state, like Adam) or ``False`` (it needs whole tensors: norms, matrix
    factors, line searches). Undeclared classes are accepted when they derive from one of
    :func:`elementwise_optimizers` (the registry's ``elementwise`` entries).

    Raises:
        ValueError: if the class declares ``elementwise_update = False`` or declares nothing and
            is not a known elementwise optimizer.
    """
    declared = getattr(optimizer_class, "elementwise_update", None)
    name = getattr(optimizer_class, "__name__", repr(optimizer_class))
    if declared is True:
        return
    if (
        declared is None
        and isinstance(optimizer_class, type)
        and issubclass(optimizer_class, elementwise_optimizers())
    ):
        return
    reason = (
        "declares elementwise_update = False"
        if declared is False
        else "is not a known elementwise optimizer"
    )
    raise ValueError(
        f"partition='flat' splits parameters across ranks, so the local optimizer must update "
        f"every element from that element's gradient and state alone; {name} {reason}. Use "
        "partition='sorted_greedy' (whole parameters per rank), or set the class attribute "
        "`elementwise_update = True` if its update really is elementwise."
    )


class FlatBucket:
    """The flat buffer of one ``(dtype, device)``, its layout and this rank's grad shard.

    Attributes:
        indices: global indices (into :attr:`FlatShards.params`) of the bucket's parameters.
        layout: the pure layout (shards, slices).
        flat: the padded parameter buffer; every parameter's ``data`` is a view of it.
    """

    def __init__(self, indices: list[int], params: Sequence[torch.Tensor], world_size: int) -> None:
        self.indices = indices
        members = [params[i] for i in indices]
        self.layout: FlatLayout = plan_flat_layout([p.numel() for p in members], world_size)
        first = members[0]
        self.flat = torch.zeros(self.layout.padded_size, dtype=first.dtype, device=first.device)
        for param, offset in zip(members, self.layout.offsets):
            view = self.flat[offset : offset + param.numel()]
            view.copy_(param.data.reshape(-1))
            param.data = view.view_as(param.data)
        self._grad_flat: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None

    def shard(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of :attr:`flat` (a view)."""
        begin, end = self.layout.shard_range(rank)
        return self.flat[begin:end]

    def grad_flat(self) -> torch.Tensor:
        """The padded gradient buffer (allocated on first use)."""
        if self._grad_flat is None:
            self._grad_flat = torch.zeros_like(self.flat)
            self.grad_shard = torch.zeros(
                self.layout.shard_size, dtype=self.flat.dtype, device=self.flat.device
            )
        return self._grad_flat


class FlatShards:
    """Flat, balanced shards of ``params`` over a process group, and their collectives.

    Frozen parameters (``requires_grad=False``) stay out of the buffers and are never updated.

    Args:
        params: every parameter, in global ``state_dict`` index order.
        process_group: the group to shard over (None for WORLD).

    Example::

        >>> shards = FlatShards(params)
        >>> opt = torch.optim.Adam(shards.local_param_groups([{"params": params}]), lr=1e-3)
        >>> loss.backward(); shards.reduce_scatter_grads(); opt.step(); shards.all_gather_params()
    """

    def __init__(
        self, params: Sequence[torch.Tensor], process_group: ProcessGroup | None = None
    ) -> None:
        self.process_group = resolve_group(process_group)
        self.world_size = group_size(self.process_group)
        self.rank = group_rank(self.process_group)
        self.params: list[torch.Tensor] = []
        self.index_of: dict[torch.Tensor, int] = {}
        self.buckets: list[FlatBucket] = []
        #: This rank's pieces: 1-D views of its shards, and where each comes from.
        self.pieces: list[torch.Tensor] = []
        self.piece_info: dict[torch.Tensor, Piece] = {}
        self._piece_bucket: list[int] = []
        self.add_params(params)
        on_gloo = dist.get_backend(self.process_group) == "gloo"
        #: Which collectives run: updated when a backend refuses the preferred one.
        self.collectives = {
            "reduce_scatter": "ring" if on_gloo else "reduce_scatter",
            "all_gather": "broadcast" if on_gloo else "all_gather",
        }

    def add_params(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Append parameters (global indices continue after the existing ones) in new buffers.

        The existing buffers, pieces and their optimizer state are untouched; the new trainable
        parameters of each ``(dtype, device)`` get a flat buffer of their own, sharded the same
        way.

        Args:
            params: the new parameters, in global index order.

        Returns:
            This rank's new pieces, in local-optimizer order.
        """
        start = len(self.params)
        for offset, param in enumerate(params):
            self.params.append(param)
            self.index_of[param] = start + offset
        trainable = [start + i for i, p in enumerate(params) if p.requires_grad]
        keys = [(self.params[i].dtype, self.params[i].device) for i in trainable]
        new_pieces: list[torch.Tensor] = []
        for members in group_by_key(keys).values():
            bucket = FlatBucket([trainable[j] for j in members], self.params, self.world_size)
            self.buckets.append(bucket)
            for s in bucket.layout.slices[self.rank]:
                index = bucket.indices[s.param_index]
                tensor = bucket.flat[s.offset : s.offset + s.numel]
                new_pieces.append(tensor)
                self.piece_info[tensor] = Piece(
                    index, s.start, s.stop, tuple(self.params[index].shape)
                )
                self._piece_bucket.append(len(self.buckets) - 1)
        self.pieces.extend(new_pieces)
        return new_pieces

    # -- layout queries --------------------------------------------------------------------------

    def rank_pieces(self, rank: int) -> list[Piece]:
        """The pieces rank ``rank`` updates, in its local-optimizer order (pure)."""
        return [
            Piece(
                bucket.indices[s.param_index],
                s.start,
                s.stop,
                tuple(self.params[bucket.indices[s.param_index]].shape),
            )
            for bucket in self.buckets
            for s in bucket.layout.slices[rank]
        ]

    def block_sharing(self) -> Sharing:
        """Where this rank's pieces lie in their parameters, for low-bit optimizer states
        (:mod:`functional_optim.lowbit`): every piece boundary of every parameter (all ranks)
        gets a slot, reduced with MAX over the process group."""
        cuts: dict[int, set[int]] = {}
        for rank in range(self.world_size):
            for piece in self.rank_pieces(rank):
                whole = {0, math.prod(piece.shape)}
                cuts.setdefault(piece.param_index, set()).update({piece.start, piece.stop} - whole)
        slot_of, slots = {}, 0
        for index in sorted(cuts):
            slot_of[index] = slots
            slots += len(cuts[index])
        placements = {
            id(tensor): Placement(
                math.prod(piece.shape),
                piece.start,
                tuple(sorted(cuts[piece.param_index])),
                slot_of[piece.param_index],
            )
            for tensor, piece in self.piece_info.items()
        }
        group = self.process_group

        def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            return t

        return Sharing(placements, slots, all_reduce_max)

    def shard_numels(self) -> list[int]:
        """Parameter elements each rank updates (its optimizer-state footprint)."""
        return [sum(p.numel for p in self.rank_pieces(r)) for r in range(self.world_size)]

    def local_param_groups(self, param_groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """This rank's param groups: each group's options with its pieces as ``"params"``.

        Args:
            param_groups: global groups (dicts with ``"params"``); every parameter must be one
                of :attr:`params`. Pieces of parameters in no given group are left out.

        Returns:
            One shallow copy per group (possibly with no pieces), ready for a local optimizer.
        """
        group_of: dict[int, int] = {}
        for g, group in enumerate(param_groups):
            for param in group["params"]:
                group_of[self.index_of[param]] = g
        local = [dict(group, params=[]) for group in param_groups]
        for tensor in self.pieces:
            owner = group_of.get(self.piece_info[tensor].param_index)
            if owner is not None:
                local[owner]["params"].append(tensor)
        return local

    # -- gradients -------------------------------------------------------------------------------

    def attach_local_grads(self) -> None:
        """Point each piece's ``grad`` at the matching slice of its parameter's local ``grad``.

        Use when the gradients are already averaged (e.g. by DDP); no communication. A parameter
        without a gradient leaves its pieces without one, so the optimizer skips them as torch
        skips the parameter.
        """
        for tensor in self.pieces:
            piece = self.piece_info[tensor]
            grad = self.params[piece.param_index].grad
            tensor.grad = None if grad is None else grad.reshape(-1)[piece.start : piece.stop]

    def reduce_scatter_grads(self, average: bool = True) -> None:
        """Sum (and average) the local gradients, delivering each shard to its owner only.

        A parameter without a gradient counts as zeros (as DDP treats unused parameters). Like
        DDP's default hook, each rank divides by the world size before summing.

        Args:
            average: divide by the world size (DDP's mean); False gives the sum.
        """
        for bucket in self.buckets:
            flat = bucket.grad_flat()
            scale = average and self.world_size > 1
            for index, offset in zip(bucket.indices, bucket.layout.offsets):
                param = self.params[index]
                view = flat[offset : offset + param.numel()]
                if param.grad is None:
                    view.zero_()
                elif scale:
                    # One pass instead of a copy then a division of the whole buffer.
                    torch.div(param.grad.reshape(-1), self.world_size, out=view)
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad.reshape(-1))
            assert bucket.grad_shard is not None
            self._reduce_scatter(bucket.grad_shard, flat)
        self.attach_shard_grads()

    def attach_shard_grads(self) -> None:
        """Point each piece's ``grad`` at its slice of its buffer's reduced gradient shard."""
        for tensor, b in zip(self.pieces, self._piece_bucket):
            bucket = self.buckets[b]
            begin = tensor.storage_offset() - bucket.flat.storage_offset()
            begin -= bucket.layout.shard_range(self.rank)[0]
            assert bucket.grad_shard is not None
            tensor.grad = bucket.grad_shard[begin : begin + tensor.numel()]

    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        if self.world_size == 1:
            out.copy_(flat)
            return
        if self.collectives["reduce_scatter"] == "ring":
            ring_reduce_scatter(out, flat, self.process_group)
            return
        if self.collectives["reduce_scatter"] == "reduce_scatter":
            try:
                dist.reduce_scatter_single(out, flat, group=self.process_group)
                return
            except (RuntimeError, NotImplementedError) as e:
                if not any(word in str(e).lower() for word in _UNSUPPORTED):
                    raise
                self.collectives["reduce_scatter"] = "all_reduce"
        dist.all_reduce(flat, group=self.process_group)
        begin, end = out.numel() * self.rank, out.numel() * (self.rank + 1)
        out.copy_(flat[begin:end])

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the pieces' gradients by the global norm over all shards, in one all-reduce.

        See :func:`clip_grads_by_global_norm`; only the pieces' gradients (what the local
        optimizer reads) are scaled.
        """
        grads = [t.grad for t in self.pieces if t.grad is not None]
        device = self.buckets[0].flat.device if self.buckets else torch.device("cpu")
        return clip_grads_by_global_norm(
            grads, max_norm, norm_type, error_if_nonfinite, self.process_group, device
        )

    # -- parameters ------------------------------------------------------------------------------

    def all_gather_params(self) -> None:
        """Send every rank's updated shard to all ranks: one ``all_gather`` per buffer.

        On gloo each shard is broadcast from its owner instead (all of them in flight at once):
        the same bytes, but gloo's ``all_gather`` into one tensor stages the output through a
        temporary list and runs several times slower (``benchmarks/zero_flat.py``).
        """
        if self.world_size == 1:
            return
        if self.collectives["all_gather"] == "broadcast":
            self._broadcast_shards()
            return
        for bucket in self.buckets:
            mine = bucket.shard(self.rank)
            if self.collectives["all_gather"] == "all_gather":
                try:
                    dist.all_gather_single(bucket.flat, mine, group=self.process_group)
                    continue
                except (RuntimeError, NotImplementedError) as e:
                    if not any(word in str(e).lower() for word in _UNSUPPORTED):
                        raise
                    self.collectives["all_gather"] = "all_gather_list"
            chunks = list(bucket.flat.chunk(self.world_size))
            dist.all_gather(chunks, mine.clone(), group=self.process_group)

    def _broadcast_shards(self) -> None:
        """All-gather as one asynchronous broadcast per (buffer, rank), then wait for all."""
        works = [
            dist.broadcast(
                bucket.shard(rank),
                group=self.process_group,
                group_src=rank,
                async_op=True,
            )
            for bucket in self.buckets
            for rank in range(self.world_size)
        ]
        for work in works:
            if work is not None:
                work.wait()


def clip_grads_by_global_norm(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    process_group: ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Clip disjoint gradient shards by the norm of all of them together, in one all-reduce.

    Each rank passes the gradients (or gradient pieces) it owns; the result equals
    ``torch.nn.utils.clip_grad_norm_`` over the full gradients up to rounding (the partial
    norms are combined in float64).

    Args:
        grads: this rank's gradients, scaled in place.
        max_norm: the largest allowed norm.
        norm_type: the p of the p-norm (``inf`` for the max norm).
        error_if_nonfinite: raise if the total norm is nan or inf.
        process_group: the group (None for WORLD).
        device: where the partial norm travels (the gradients' device; CPU by default).

    Returns:
        The total norm before clipping, a 0-d tensor in the gradients' dtype.

    Raises:
        RuntimeError: if ``error_if_nonfinite`` and the norm is not finite (torch's message).
    """
    group = resolve_group(process_group)
    world_size = group_size(group)
    norm_type = float(norm_type)
    device = device or (grads[0].device if grads else torch.device("cpu"))
    dtype = grads[0].dtype if grads else torch.float32
    nonempty = [g for g in grads if g.numel()]
    if math.isinf(norm_type):
        maxima = [g.detach().abs().max().to(device, torch.float64) for g in nonempty]
        if norm_type > 0:
            part = torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float64)
            op = dist.ReduceOp.MAX
        else:
            minima = [g.detach().abs().min().to(device, torch.float64) for g in nonempty]
            part = (
                torch.stack(minima).min() if minima else torch.tensor(math.inf, dtype=torch.float64)
            )
            op = dist.ReduceOp.MIN
        part = part.to(device)
        if world_size > 1:
            dist.all_reduce(part, op=op, group=group)
        total = part
    else:
        part = torch.zeros((), dtype=torch.float64, device=device)
        for g in nonempty:
            norm = torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float64)
            part += norm if norm_type == 0 else norm**norm_type
        if world_size > 1:
            dist.all_reduce(part, group=group)
        total = part if norm_type == 0 else part ** (1.0 / norm_type)
    total = total.to(dtype)
    if error_if_nonfinite and bool(total.isnan() or total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    return total
