"""Sharded optimizer state as a torch.distributed.checkpoint (DCP) state dict, any layout.

:func:`shard_state_dict` returns this rank's share of the optimizer state in a form that
``torch.distributed.checkpoint.save`` writes in parallel (one file per rank, nothing gathered)
and ``torch.distributed.checkpoint.load`` reads back at any world size or partition (DCP
reshards). The keys do not depend on the layout:

- ``state.<index>.<name>``: state ``name`` of the parameter with global ``state_dict`` index
  ``index``. Elementwise values are one logical 1-D tensor of the parameter's ``numel``
  elements (the flattened state, torch's dtype and values): a plain tensor where this rank holds
  the whole parameter, else a ``ShardedTensor`` whose local shard is this rank's element range
  (a parameter cut by the flat partition spans several ranks). Per-parameter scalars (Adam's
  ``step``) are plain values, saved by every holder and deduplicated by DCP.
- ``meta``: sizes, shapes and param groups (hyperparameters), identical on every rank, as
  ``torch.save`` bytes read back with ``weights_only=True`` (plain data only, no code).

An optimizer without state gets its initial state first (a step with zero gradients and zero
learning rates, as ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does), so
that a fresh optimizer offers load targets; the parameters do not change.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard

from dist_runtime.block_state import (
    BlockFormat,
    elementwise_codes,
    formats_of,
    is_blockwise,
    owned_blocks,
    region_codes,
    touched_blocks,
)
from dist_runtime.piece_state import Piece, is_elementwise, place_state, split_param_state
from dist_runtime.process_group import all_gather_objects, global_rank, resolve_group
from dist_runtime.safe_load import UnsafeCheckpointError, dump_plain, load_plain

__all__ = [
    "FORMAT_VERSION",
    "init_empty_state",
    "load_shard_state_dict",
    "read_meta",
    "shard_meta",
    "shard_state_dict",
    "sharded_view",
    "state_key",
]

#: Version of the format, stored in ``meta`` (3: ``meta`` is ``torch.save`` bytes, not a pickle).
FORMAT_VERSION = 3
_KEY = re.compile(r"^state\.(\d+)\.(.+)$")


def state_key(index: int, name: str) -> str:
    """The DCP key of state ``name`` of parameter ``index``."""
    return f"state.{index}.{name}"


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def shard_meta(params: Sequence[torch.Tensor], param_groups: Sequence[Mapping[str, Any]]) -> bytes:
    """Sizes, shapes and hyperparameters (``meta``) as plain-data bytes; groups list indices."""
    index_of = {p: i for i, p in enumerate(params)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index_of[p] for p in g["params"]],
        }
        for g in param_groups
    ]
    meta = {
        "version": FORMAT_VERSION,
        "numels": [p.numel() for p in params],
        "shapes": [list(p.shape) for p in params],
        "param_groups": groups,
    }
    return dump_plain(meta)


def init_empty_state(
    optimizer: torch.optim.Optimizer, trainable: Sequence[torch.Tensor] | None = None
) -> None:
    """Give an optimizer without state its initial state (zero gradients, zero learning rates).

    Parameters and existing gradients are left as they were; does nothing when the optimizer has
    state already or no trainable tensor.

    Args:
        optimizer: the optimizer.
        trainable: its tensors to initialise (default: those with ``requires_grad``; pieces of
            flat buffers do not require grad themselves).
    """
    if optimizer.state:
        return
    tensors = (
        [t for g in optimizer.param_groups for t in g["params"] if t.requires_grad]
        if trainable is None
        else list(trainable)
    )
    if not tensors:
        return
    grads = [t.grad for t in tensors]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for t in tensors:
            t.grad = torch.zeros_like(t)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        with torch.no_grad():
            optimizer.step()
    finally:
        for t, grad in zip(tensors, grads):
            t.grad = grad
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr


def sharded_view(
    local: torch.Tensor,
    piece: Piece,
    holders: Sequence[tuple[int, Piece]],
    process_group: ProcessGroup | None = None,
) -> Any:
    """``local`` (elements ``[piece.start, piece.stop)``) as one chunk of a 1-D logical tensor.

    Args:
        local: this rank's 1-D values (not copied: DCP loads into it in place).
        piece: where they lie in the flattened parameter.
        holders: ``(group rank, piece)`` for every rank's chunk of this parameter.
        process_group: the group (None for WORLD).

    Returns:
        ``local`` itself for a whole parameter, else a ``ShardedTensor``.

    Raises:
        ValueError: if the chunks do not tile the parameter.
    """
    numel = _numel(piece.shape)
    if piece.whole:
        return local
    covered = sorted((p.start, p.stop) for _, p in holders)
    position = 0
    for start, stop in covered:
        if start != position:
            break
        position = stop
    if position != numel:
        raise ValueError(
            f"parameter {piece.param_index}: the ranks that hold its pieces do not all have the "
            "same optimizer state (some stepped it, some did not), so its state cannot be saved "
            "as one tensor; step every rank with the same gradients first"
        )
    group = resolve_group(process_group)
    device = local.device
    shards_md = [
        ShardMetadata(
            shard_offsets=[p.start],
            shard_sizes=[p.numel],
            placement=f"rank:{global_rank(group, r)}/{device}",
        )
        for r, p in holders
    ]
    properties = TensorProperties(
        dtype=local.dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(shards_md, torch.Size([numel]), properties)
    mine = [md for (r, _), md in zip(holders, shards_md) if md.shard_offsets == [piece.start]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, mine[0])], metadata, process_group=group
        )


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def shard_state_dict(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    params: Sequence[torch.Tensor],
    param_groups: Sequence[Mapping[str, Any]],
    process_group: ProcessGroup | None = None,
    init_empty: bool = True,
) -> dict[str, Any]:
    """This rank's optimizer state as a DCP state dict (see the module docstring).

    Collective when torch.distributed is initialised (one small ``all_gather_object`` to learn
    the other ranks' pieces): call on every rank of the group. Elementwise values are views of
    the live state, so ``dcp.load`` into the result writes the state in place;
    :func:`load_shard_state_dict` then also handles a dict that came from elsewhere.

    Args:
        optimizer: this rank's local optimizer (initialised first when it has no state).
        pieces: where each tensor of ``optimizer`` lies in the global parameters.
        params: every parameter, in global index order.
        param_groups: the global param groups (their hyperparameters go to ``meta``).
        process_group: the group (None for WORLD; ignored without torch.distributed).
        init_empty: give an optimizer without state its initial state first, so that the dict
            has load targets (False for a save that must not change the optimizer).

    Returns:
        ``{"meta": bytes, "state.<index>.<name>": value}``.

    Raises:
        ValueError: if one parameter's pieces disagree on having state (checked on all ranks).
    """
    if init_empty:
        init_empty_state(
            optimizer, [t for t, p in pieces.items() if params[p.param_index].requires_grad]
        )
    local: list[tuple[Piece, dict[str, Any]]] = []
    for tensor, piece in pieces.items():
        saved = optimizer.state.get(tensor)
        if saved:
            local.append(
                (piece, split_param_state(saved, tuple(tensor.shape), 0, tensor.numel(), False))
            )
    split = [(p, sorted(s)) for p, s in local if not p.whole]
    everyone = all_gather_objects(split, process_group) if _is_dist() else [split]
    holders: dict[tuple[int, str], list[tuple[int, Piece]]] = {}
    for rank, entries in enumerate(everyone):
        for piece, names in entries:
            for name in names:
                holders.setdefault((piece.param_index, name), []).append((rank, piece))
    out: dict[str, Any] = {"meta": shard_meta(params, param_groups)}
    formats = formats_of(param_groups, params)
    for piece, state in local:
        fmt = formats.get(piece.param_index)
        for name, value in state.items():
            key = state_key(piece.param_index, name)
            held = holders.get((piece.param_index, name), [])
            if fmt is not None and is_blockwise(name, state):
                out[key] = _blockwise_view(name, value, piece, held, fmt, process_group)
            elif is_elementwise(name, value, (piece.numel,)):
                value = value.contiguous()
                out[key] = sharded_view(
                    value, piece, holders.get((piece.param_index, name), []), process_group
                )
            else:
                out[key] = value
    return out


def _blockwise_view(
    name: str,
    value: torch.Tensor,
    piece: Piece,
    holders: Sequence[tuple[int, Piece]],
    fmt: BlockFormat,
    process_group: ProcessGroup | None,
) -> Any:
    """A low-bit entry in a layout-free form (:mod:`dist_runtime.block_state`): codes as one
    code per element of the parameter, scales as one per block, each block saved by the
    rank that holds its first element."""
    if name.endswith("_codes"):
        codes = elementwise_codes(value, piece.start, piece.stop, fmt)
        return sharded_view(codes, piece, holders, process_group)
    blocks = -(-_numel(piece.shape) // fmt.block_size)
    first = piece.start // fmt.block_size
    lo, hi = owned_blocks(piece.start, piece.stop, fmt)
    mine = value[lo - first : hi - first].contiguous()
    in_blocks = [
        (r, Piece(p.param_index, *owned_blocks(p.start, p.stop, fmt), (blocks,)))
        for r, p in holders
    ]
    in_blocks = [(r, p) for r, p in in_blocks if p.numel]
    return sharded_view(mine, Piece(piece.param_index, lo, hi, (blocks,)), in_blocks, process_group)


def _local_values(name: str, value: Any, piece: Piece) -> Any:
    """This piece's elements of a loaded elementwise value; scalars unchanged."""
    if isinstance(value, ShardedTensor):
        for shard in value.local_shards():
            start = shard.metadata.shard_offsets[0]
            if start <= piece.start and piece.stop <= start + shard.tensor.numel():
                return shard.tensor[piece.start - start : piece.stop - start]
        raise ValueError(
            f"state {name!r} of parameter {piece.param_index} holds no chunk for elements "
            f"[{piece.start}, {piece.stop})"
        )
    if is_elementwise(name, value, (_numel(piece.shape),)):
        return value[piece.start : piece.stop]
    return value


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (the ``meta`` of format version 2, a bare pickle)."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(
            f"refusing to load the checkpoint's meta: it references {module}.{name}, which "
            "plain data never does. Load checkpoints only from trusted storage."
        )


def read_meta(raw: bytes) -> dict[str, Any]:
    """Decode ``meta`` without running code from it.

    Format 3 (``torch.save``) loads with ``weights_only=True``; format 2 (a bare pickle of
    plain values) loads with an unpickler that resolves no global at all.

    Raises:
        UnsafeCheckpointError: if ``meta`` holds anything but plain data.
    """
    if raw[:2] == b"PK":  # torch.save's zip container
        meta = load_plain(raw, "the checkpoint's meta")
    else:
        meta = _PlainUnpickler(io.BytesIO(raw)).load()
    if not isinstance(meta, dict):
        raise UnsafeCheckpointError(f"the checkpoint's meta is a {type(meta).__name__}, not a dict")
    return meta


def load_shard_state_dict(
    optimizer: torch.optim.Optimizer,
    pieces: Mapping[torch.Tensor, Piece],
    state_dict: Mapping[str, Any],
) -> dict[str, Any]:
    """Load a :func:`shard_state_dict` (after ``dcp.load`` filled it) into the local optimizer.

    Args:
        optimizer: this rank's local optimizer; its param groups match the saved ones one to
            one and take their hyperparameters.
        pieces: where each of its tensors lies in the global parameters.
        state_dict: the loaded dict (``meta`` and ``state.<index>.<name>`` entries).

    Returns:
        The saved ``meta`` (sizes, shapes, param groups).

    Raises:
        ValueError: if the param groups or the parameter sizes differ from the saved ones
            (before anything is loaded).
    """
    raw = state_dict["meta"]
    meta: dict[str, Any] = read_meta(raw) if isinstance(raw, bytes) else dict(raw)
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved_groups)} param groups but the optimizer has "
            f"{len(optimizer.param_groups)}"
        )
    names: dict[int, list[str]] = {}
    for key in state_dict:
        match = _KEY.match(key)
        if match:
            names.setdefault(int(match.group(1)), []).append(match.group(2))
    for piece in pieces.values():
        if piece.param_index in names and (
            piece.param_index >= len(meta["numels"])
            or meta["numels"][piece.param_index] != _numel(piece.shape)
        ):
            saved = (
                meta["numels"][piece.param_index]
                if piece.param_index < len(meta["numels"])
                else "no"
            )
            raise ValueError(
                f"parameter {piece.param_index} has {_numel(piece.shape)} elements but the "
                f"checkpoint saved {saved}"
            )
    group_of = {t: g for g in optimizer.param_groups for t in g["params"]}
    formats = formats_of(saved_groups, [])
    loaded: dict[torch.Tensor, dict[str, Any]] = {}
    for tensor, piece in pieces.items():
        if piece.param_index not in names:
            continue
        saved_names = names[piece.param_index]
        fmt = formats.get(piece.param_index)
        state = {}
        for name in saved_names:
            value = state_dict[state_key(piece.param_index, name)]
            if fmt is not None and is_blockwise(name, dict.fromkeys(saved_names)):
                state[name] = _blockwise_piece(name, value, piece, fmt)
            else:
                state[name] = _local_values(name, value, piece)
        placed = place_state(state, tensor, group_of[tensor])
        live = optimizer.state.get(tensor, {})
        for name, value in placed.items():
            old = live.get(name)
            if not isinstance(value, torch.Tensor):
                continue
            if (
                isinstance(old, torch.Tensor)
                and old.shape == value.shape
                and old.dtype == value.dtype
            ):
                # dcp.load may have written the live state already (the dict holds its views).
                if old.data_ptr() != value.data_ptr():
                    old.copy_(value)
                placed[name] = old
            else:
                placed[name] = value.clone()  # never alias the caller's dict
        loaded[tensor] = placed
    for local, saved in zip(optimizer.param_groups, saved_groups):
        for key, value in saved.items():
            if key != "params":
                local[key] = value
    if hasattr(optimizer, "transform_states"):  # functional_optim.Optimizer: its own load
        sd = optimizer.state_dict()
        order = [t for g in optimizer.param_groups for t in g["params"]]
        sd["state"] = {i: loaded[t] for i, t in enumerate(order) if t in loaded}
        optimizer.load_state_dict(sd)
    else:
        for tensor, placed in loaded.items():
            optimizer.state[tensor] = placed
    return meta


def _blockwise_piece(name: str, value: Any, piece: Piece, fmt: BlockFormat) -> torch.Tensor:
    """This piece's codes or scales (its blocks) from a loaded layout-free low-bit entry."""
    if name.endswith("_codes"):
        codes = _local_values(name, value, piece)
        return region_codes(codes, piece.start, piece.stop, fmt)
    first, end = touched_blocks(piece.start, piece.stop, fmt)
    if isinstance(value, ShardedTensor):  # a template from shard_state_dict: the owned blocks
        blocks = -(-_numel(piece.shape) // fmt.block_size)
        owned = Piece(piece.param_index, *owned_blocks(piece.start, piece.stop, fmt), (blocks,))
        whole: torch.Tensor = _local_values(name, value, owned)
        if owned.start != first or owned.stop != end:
            raise ValueError(
                f"state {name!r} of parameter {piece.param_index} straddles another rank's "
                "block; load low-bit states with dist_runtime.sharded_checkpoint "
                "(load_optimizer_shards), which reads whole scales"
            )
        return whole
    part: torch.Tensor = value[first:end]
    return part
