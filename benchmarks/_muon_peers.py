"""Peers and the byte counter of ``sharded_muon.py`` (private to the benchmarks).

- :class:`SentBytes`: a dispatch mode that adds up the bytes this rank sends in the collectives
  called while it is active (``c10d`` and functional collectives alike), so that every
  contender's bytes per step are measured the same way instead of derived from its design.
- :data:`PEERS`: other Muon implementations for FSDP2 (``Shard(0)`` DTensor) params, each built
  by :func:`build_peer` on the same params as ours. The imports are lazy: a peer that is not
  installed, or that cannot run here (CUDA/NCCL only, an API we cannot feed), raises, and the
  caller reports the error in its row.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the mesh dimension name every contender's FSDP2 mesh carries (torchtitan wants a named axis)
MESH_AXIS = "dp_shard"


# -- bytes --------------------------------------------------------------------------------------


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group(arg: Any) -> tuple[int, int]:
    """``(rank, size)`` of a c10d ProcessGroup object or a functional collective's group name."""
    import torch.distributed as dist

    if isinstance(arg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        arg = _resolve_process_group(arg)
    elif isinstance(arg, torch.ScriptObject):
        arg = dist.ProcessGroup.unbox(arg)
    return int(arg.rank()), int(arg.size())


def _split_sent(tensor: torch.Tensor, splits: Sequence[int], rank: int, world: int) -> int:
    """Bytes of ``tensor`` (split along dim 0 by ``splits``, or evenly) not kept by ``rank``."""
    rows = tensor.shape[0] if tensor.dim() else 1
    per_row = _nbytes(tensor) // max(rows, 1)
    own = splits[rank] if splits else rows // world
    return (rows - own) * per_row


#: collective -> the index of its group argument (c10d: a ProcessGroup; functional: a name)
_GROUP_ARG = {
    "c10d::broadcast_": 1,
    "c10d::allgather_": 2,
    "c10d::_allgather_base_": 2,
    "c10d::allgather_into_tensor_coalesced_": 2,
    "c10d::gather_": 2,
    "c10d::scatter_": 2,
    "c10d::allreduce_": 1,
    "c10d::allreduce_coalesced_": 1,
    "c10d::alltoall_base_": 2,
    "_c10d_functional::all_to_all_single": 3,
    "_c10d_functional::all_gather_into_tensor": 2,
    "_c10d_functional::all_gather_into_tensor_coalesced": 2,
    "_c10d_functional::all_reduce": 2,
    "_c10d_functional::broadcast": 2,
    "_c10d_functional::reduce_scatter_tensor": 3,
}


#: c10d ops that move no data
_NOT_SENT = frozenset(
    {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::barrier"}
)


def _sent_bytes(name: str, args: Sequence[Any]) -> int | None:
    """Bytes this rank sends in collective ``name`` (None: not a collective we know)."""
    where = _GROUP_ARG.get(name)
    if where is None:
        return None
    rank, world = _group(args[where])
    op = name.split("::")[1].rstrip("_")
    if op in ("allgather", "_allgather_base", "allgather_into_tensor_coalesced"):
        return _nbytes(args[1]) * (world - 1)
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return _nbytes(args[0]) * (world - 1)
    if op in ("allreduce", "allreduce_coalesced", "all_reduce"):
        return 2 * (world - 1) * _nbytes(args[0]) // world  # a ring all-reduce
    if op == "reduce_scatter_tensor":
        return (world - 1) * _nbytes(args[0]) // world
    if op == "broadcast":  # c10d's root is args[2], the functional one's args[1]
        root = args[2] if name.startswith("c10d") else args[1]
        return _nbytes(args[0]) * (world - 1) if rank == root else 0
    if op == "gather":
        return _nbytes(args[1]) if rank != args[3] else 0
    if op == "scatter":
        pieces = args[1][0] if rank == args[3] else []
        return sum(_nbytes(t) for i, t in enumerate(pieces) if i != rank)
    if op == "alltoall_base":
        return _split_sent(args[1], args[4], rank, world)
    return _split_sent(args[0], args[2], rank, world)  # all_to_all_single


class SentBytes(TorchDispatchMode):
    """Count the bytes this rank sends in collectives while active.

    A broadcast counts ``bytes * (world - 1)`` on its root, an all-gather ``bytes * (world - 1)``
    on every rank, a gather or scatter the pieces that leave their rank, an all-to-all what does
    not stay on the sender, an all-reduce the ``2 (world - 1) / world`` of a ring: the payload
    the collective must deliver, not gloo's wire protocol.

    Attributes:
        sent: bytes counted so far.
        unknown: names of collectives met that have no rule (their bytes are not counted).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.unknown: set[str] = set()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile``d code (a peer's Newton-Schulz loop) run compiled under it."""
        return True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func._schema.name
        if name.startswith(("c10d::", "_c10d_functional::")) and name not in _NOT_SENT:
            sent = _sent_bytes(name, args)
            if sent is None:
                self.unknown.add(name)
            else:
                self.sent += sent
        return func(*args, **(kwargs or {}))


# -- peers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    """One peer implementation.

    Args:
        label: its row label.
        module: the module it is imported from (checked with ``find_spec`` first).
        pip: what to install to get it.
        note: how its maths or settings differ from ours (printed under the table).
        build: ``build(params, names, muon)`` -> its ``step`` callable.
    """

    label: str
    module: str
    pip: str
    note: str
    build: Callable[[list[Any], list[str], dict[str, Any]], Callable[[], Any]]


def _muon_fsdp2(params: list[Any], names: list[str], muon: dict[str, Any]) -> Callable[[], Any]:
    from muon_fsdp2 import Muon

    del names
    group = {
        "params": params,
        "use_muon": True,
        "lr": muon["lr"],
        "momentum": muon["momentum"],
        "weight_decay": muon["weight_decay"],
        "nesterov": muon["nesterov"],
        "ns_steps": muon["ns_steps"],
        "rms_scale": False,  # KellerJordan's sqrt(max(1, m / n)) lr scale, as ours and torch's
    }
    optimizer = Muon([group])
    grads = [p.grad._local_tensor.clone() for p in params]

    def step() -> None:
        # It overwrites p.grad with the momentum and then the update: restore the fixed gradient.
        for p, g in zip(params, grads, strict=True):
            p.grad._local_tensor.copy_(g)
        optimizer.step()

    return step


def _torchtitan(params: list[Any], names: list[str], muon: dict[str, Any]) -> Callable[[], Any]:
    from torchtitan.distributed.flex_shard import (
        BucketConfig,
        ComputeLayout,
        Owned,
        build_dist_muon,
    )

    layout = ComputeLayout(shardings_by_mesh_axis={MESH_AXIS: Owned()})
    optimizer = build_dist_muon(
        [{"params": params, "param_names": names}],
        compute_sharding_by_fqn=dict.fromkeys(names, layout),
        bucket_configs=[BucketConfig(patterns=("*",), name="all")],
        lr=muon["lr"],
        weight_decay=muon["weight_decay"],
        momentum=muon["momentum"],
        nesterov=muon["nesterov"],
        ns_steps=muon["ns_steps"],
    )
    return optimizer.step


PEERS = (
    Peer(
        "torchtitan 0.3.0 build_dist_muon",
        "torchtitan",
        "torchtitan==0.3.0",
        "torchtitan: `Owned()` compute layout on the mesh axis (one owner rank per matrix), one "
        "bucket; torch's NS coefficients and lr scale (`adjust_lr_fn=None`).",
        _torchtitan,
    ),
    Peer(
        "muon_fsdp2 0.3.0 Muon",
        "muon_fsdp2",
        "muon_fsdp2==0.3.0",
        "muon_fsdp2: `rms_scale=False` (KellerJordan's `sqrt(max(1, m/n))` lr scale, as ours); "
        "owner = matrix index % world (round-robin), fp32 `gather` to it and `scatter` back, one "
        "call per matrix; its NS loop (under `torch.compile`, inductor) is written as separate "
        "ops (`b*A + c*A@A`, no `addmm`) and normalised by `norm + eps`, so its bfloat16 "
        "rounding differs from torch's and its params drift from ours by that rounding; it "
        "overwrites `p.grad`, so its timed step includes one copy restoring the gradient.",
        _muon_fsdp2,
    ),
)


def build_peer(
    peer: Peer, params: list[Any], names: list[str], muon: dict[str, Any]
) -> Callable[[], Any]:
    """Build ``peer`` on ``params``.

    Raises:
        ModuleNotFoundError: the peer is not installed (the message says what to install).
        Exception: whatever the peer raises when it cannot run here.
    """
    if importlib.util.find_spec(peer.module) is None:
        raise ModuleNotFoundError(f"not installed (pip install {peer.pip})")
    return peer.build(params, names, muon)


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters."""
    if isinstance(exc, ModuleNotFoundError) and str(exc).startswith("not installed"):
        return str(exc)
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}".replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."
