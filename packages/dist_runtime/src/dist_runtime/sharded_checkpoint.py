"""Sharded optimizer checkpoints with torch.distributed.checkpoint: parallel writes, any reload.

Every rank writes only the state of the parameter pieces it updates, in parallel (one DCP file per
rank; nothing is gathered on one rank). The on-disk form does not depend on the partition that
wrote it: each value is stored under ``state.<index>.<start>.<stop>.<name>``, where ``index`` is
the parameter's global ``state_dict`` index, ``[start, stop)`` an element range of the flattened
parameter, and elementwise values are 1-D tensors of ``stop - start`` elements (torch's dtype
and values, as ``torch.optim`` keeps them). Scalars (``step``) are stored with every range. Rank 0
adds ``meta`` (parameter sizes and shapes, the param groups' hyperparameters). Any layout (flat
shards at another world size, whole parameters per rank, a plain optimizer in one process) loads
it by reading the ranges that overlap its own pieces.

Atomicity: a checkpoint is written to a new folder ``<root>/ckpt-<n>``; only after every rank has
written (DCP's metadata is the commit record) does rank 0 atomically replace ``<root>/LATEST``
with the new folder's name. A crash before that leaves ``LATEST`` on the previous checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter

from dist_runtime.piece_state import Piece, place_state, split_param_state

__all__ = [
    "LATEST",
    "latest_checkpoint",
    "load_optimizer_shards",
    "load_plain_optimizer",
    "save_optimizer_shards",
    "whole_param_pieces",
]

#: Name of the pointer file in the checkpoint root.
LATEST = "LATEST"
_KEY = re.compile(r"^state\.(\d+)\.(\d+)\.(\d+)\.(.+)$")
_FORMAT_VERSION = 1
# DCP warns on every single-process call; one process is a supported use here.
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"

WriterFactory = Callable[[str], StorageWriter]


def _is_dist(process_group: ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(process_group: ProcessGroup | None) -> int:
    return dist.get_rank(process_group) if _is_dist(process_group) else 0


def latest_checkpoint(root: str) -> str | None:
    """The folder ``<root>/LATEST`` points to, or None when nothing was committed yet."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    return os.path.join(root, name) if name else None


def whole_param_pieces(param_groups: Sequence[Mapping[str, Any]]) -> dict[torch.Tensor, Piece]:
    """Pieces for an optimizer that updates whole parameters (global index = group order)."""
    params = [p for group in param_groups for p in group["params"]]
    return {p: Piece(i, 0, p.numel(), tuple(p.shape)) for i, p in enumerate(params)}


def _meta(params: Sequence[torch.Tensor], param_groups: Sequence[Mapping[str, Any]]) -> Any:
    index_of = {p: i for i, p in enumerate(params)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index_of[p] for p in g["params"]],
        }
        for g in param_groups
    ]
    return {
        "version": _FORMAT_VERSION,
        "numels": [p.numel() for p in params],
        "shapes": [list(p.shape) for p in params],
        "param_groups": groups,
    }


def save_optimizer_shards(
    root: str,
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    params: Sequence[torch.Tensor],
    param_groups: Sequence[Mapping[str, Any]],
    process_group: ProcessGroup | None = None,
    extra: Mapping[str, Any] | None = None,
    storage_writer: WriterFactory | None = None,
) -> str:
    """Write this rank's optimizer shard (all ranks in parallel), then commit the checkpoint.

    Call on every rank of the group.

    Args:
        root: the checkpoint root folder (created if needed; shared by all ranks).
        optimizer: this rank's local optimizer.
        pieces: where each tensor of ``optimizer`` lies in the global parameters.
        params: every parameter in global index order (for the sizes and shapes in ``meta``).
        param_groups: the global param groups (hyperparameters saved by rank 0).
        process_group: the group (None for WORLD, ignored without torch.distributed).
        extra: replicated values to save too (e.g. the model's ``state_dict``); written once.
        storage_writer: ``folder -> StorageWriter`` (default: DCP's ``FileSystemWriter``).

    Returns:
        The committed checkpoint folder.
    """
    rank = _rank(process_group)
    previous = latest_checkpoint(root)
    number = 0 if previous is None else int(os.path.basename(previous).split("-")[-1]) + 1
    name = [f"ckpt-{number:06d}"]
    if _is_dist(process_group):
        # Every rank must agree on the folder even if one read LATEST late.
        dist.broadcast_object_list(name, group_src=0, group=process_group)
    folder = os.path.join(root, name[0])
    os.makedirs(folder, exist_ok=True)

    state: dict[str, Any] = {}
    for tensor, piece in pieces.items():
        saved = optimizer.state.get(tensor)
        if not saved:
            continue
        flat = split_param_state(saved, tuple(tensor.shape), 0, tensor.numel())
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                value = value.cpu()
            state[f"state.{piece.param_index}.{piece.start}.{piece.stop}.{key}"] = value
    if rank == 0:
        # Pickled so that DCP stores it as one value instead of flattening the nested dicts.
        state["meta"] = pickle.dumps(_meta(params, param_groups))
    for key, value in (extra or {}).items():
        state[f"extra.{key}"] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    writer = (storage_writer or FileSystemWriter)(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp_save(
            state,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not _is_dist(process_group),
        )
    if rank == 0:
        tmp = os.path.join(root, f".{LATEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name[0])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, LATEST))
    if _is_dist(process_group):
        dist.barrier(group=process_group)
    return folder


def _saved_ranges(
    metadata: Mapping[str, Any],
) -> dict[int, list[tuple[int, int, dict[str, Any]]]]:
    """``{index: [(start, stop, {name: storage metadata})]}`` parsed from the DCP keys."""
    by_range: dict[tuple[int, int, int], dict[str, Any]] = {}
    for key, md in metadata.items():
        match = _KEY.match(key)
        if match:
            i, s, e, name = match.groups()
            by_range.setdefault((int(i), int(s), int(e)), {})[name] = md
    ranges: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    for (i, s, e), names in sorted(by_range.items()):
        ranges.setdefault(i, []).append((s, e, names))
    return ranges


def _placeholder(md: Any) -> Any:
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)
    if isinstance(md, BytesStorageMetadata):
        return None
    raise TypeError(f"unexpected checkpoint entry {type(md).__name__}")


def load_optimizer_shards(
    folder_or_root: str,
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    process_group: ProcessGroup | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into this rank's local optimizer, whatever layout wrote it.

    Call on every rank of the group. The local optimizer's param groups must match the saved
    ones one to one; their hyperparameters are restored from the checkpoint.

    Args:
        folder_or_root: a checkpoint folder, or a root whose ``LATEST`` names one.
        optimizer: the local optimizer to fill.
        pieces: where each tensor of ``optimizer`` lies in the global parameters.
        process_group: the group (None for WORLD; ignored without torch.distributed).
        extra: names to read back from the saved ``extra`` (filled in place: each value is
            replaced by the saved one; tensors are copied into the given tensors).

    Returns:
        The checkpoint's ``meta`` (sizes, shapes and param groups).

    Raises:
        FileNotFoundError: if the root has no committed checkpoint.
        ValueError: if the checkpoint's parameters differ from ``pieces`` or its param groups
            from the optimizer's.
    """
    folder = folder_or_root
    if os.path.exists(os.path.join(folder_or_root, LATEST)):
        latest = latest_checkpoint(folder_or_root)
        assert latest is not None
        folder = latest
    if not os.path.exists(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"no committed checkpoint in {folder_or_root!r}")
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    ranges = _saved_ranges(metadata)

    request: dict[str, Any] = {"meta": None}
    wanted: list[tuple[torch.Tensor, Piece, list[tuple[int, int, dict[str, Any]]]]] = []
    for tensor, piece in pieces.items():
        overlapping = [
            r for r in ranges.get(piece.param_index, []) if r[0] < piece.stop and piece.start < r[1]
        ]
        if not overlapping:
            continue
        wanted.append((tensor, piece, overlapping))
        for s, e, names in overlapping:
            for name, md in names.items():
                request[f"state.{piece.param_index}.{s}.{e}.{name}"] = _placeholder(md)
    for key in extra or {}:
        request[f"extra.{key}"] = _placeholder(metadata[f"extra.{key}"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp_load(
            request,
            storage_reader=reader,
            process_group=process_group,
            no_dist=not _is_dist(process_group),
        )
    meta: dict[str, Any] = pickle.loads(request["meta"])

    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups but the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    group_of = {t: g for g, group in enumerate(optimizer.param_groups) for t in group["params"]}
    for tensor, piece, overlapping in wanted:
        if meta["numels"][piece.param_index] != _numel(piece.shape):
            raise ValueError(
                f"parameter {piece.param_index} has {_numel(piece.shape)} elements but the "
                f"checkpoint saved {meta['numels'][piece.param_index]}"
            )
        state: dict[str, Any] = {}
        for name in overlapping[0][2]:
            first = request[
                f"state.{piece.param_index}.{overlapping[0][0]}.{overlapping[0][1]}.{name}"
            ]
            if (
                isinstance(first, torch.Tensor)
                and first.dim() == 1
                and (first.numel() == overlapping[0][1] - overlapping[0][0])
            ):
                parts = []
                for s, e, _ in overlapping:
                    value = request[f"state.{piece.param_index}.{s}.{e}.{name}"]
                    parts.append(value[max(piece.start, s) - s : min(piece.stop, e) - s])
                state[name] = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
            else:
                state[name] = first
        optimizer.state[tensor] = place_state(
            state, tensor, optimizer.param_groups[group_of[tensor]]
        )
    for local, saved in zip(optimizer.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                local[key] = value
    for key in extra or {}:
        assert extra is not None
        value = request[f"extra.{key}"]
        if isinstance(extra[key], torch.Tensor) and isinstance(value, torch.Tensor):
            extra[key].detach().copy_(value)
        else:
            extra[key] = value
    return meta


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def load_plain_optimizer(
    folder_or_root: str, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Load a sharded checkpoint into a plain ``torch.optim`` optimizer, in one process.

    Args:
        folder_or_root: a checkpoint folder or root.
        optimizer: an optimizer over all the parameters, groups as in the saving run.
        extra: as in :func:`load_optimizer_shards`.

    Returns:
        The checkpoint's ``meta``.
    """
    return load_optimizer_shards(
        folder_or_root,
        optimizer,
        whole_param_pieces(optimizer.param_groups),
        process_group=None,
        extra=extra,
    )
