"""Optimizer state of parameter pieces <-> torch-format per-parameter state.

A sharded optimizer may hand its local optimizer a *piece* of a parameter: elements
``[start, stop)`` of the flattened parameter (the flat partition cuts parameters at shard
boundaries). For an elementwise optimizer the state of a piece is the matching slice of the
state a plain optimizer keeps for the whole parameter, plus scalars (Adam's ``step``) that are
the same for every piece. This module cuts torch-format state into pieces and joins pieces back,
so checkpoints and consolidated state dicts keep torch's layout whatever the partition.

A state value is *elementwise* when it is a tensor shaped like the tensor it belongs to (the
piece or the parameter); for 0-d parameters, where ``step`` is shaped like the parameter too,
the names in :data:`SCALAR_STATE_NAMES` are scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dist_runtime.block_state import BlockFormat, cut_blockwise, is_blockwise, join_blockwise

__all__ = [
    "SCALAR_STATE_NAMES",
    "Incoming",
    "Piece",
    "PieceJoiner",
    "is_elementwise",
    "join_piece_states",
    "place_state",
    "split_param_state",
]

#: State names that are per-parameter scalars in the torch.optim algorithms (never sliced).
SCALAR_STATE_NAMES = frozenset({"step", "eta", "mu"})


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of the flattened parameter ``index`` (global state index).

    Attributes:
        param_index: the parameter's global ``state_dict`` index.
        start: first element.
        stop: one past the last element.
        shape: the whole parameter's shape.
    """

    param_index: int
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        """Whether the piece is the whole parameter."""
        return self.start == 0 and self.stop == _numel(self.shape)


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def is_elementwise(name: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether state ``name`` of a tensor shaped ``shape`` holds one entry per element."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        return False
    return len(shape) > 0 or name not in SCALAR_STATE_NAMES


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def split_param_state(
    state: Mapping[str, Any],
    shape: Sequence[int],
    start: int,
    stop: int,
    copy: bool = True,
    block: BlockFormat | None = None,
) -> dict[str, Any]:
    """Cut a whole parameter's torch-format state down to elements ``[start, stop)``.

    Args:
        state: the parameter's state (``optimizer.state[param]`` or ``state_dict["state"][i]``).
        shape: the parameter's shape.
        start: first element of the piece.
        stop: one past its last element.
        copy: copy the values (False: views of ``state``'s tensors where possible).
        block: the layout of a low-bit state's codes and scales (cut by block, see
            :mod:`dist_runtime.block_state`); None: the param has none.

    Returns:
        A new dict: elementwise tensors become 1-D slices, other values copies (or the same
        objects without ``copy``).
    """
    out: dict[str, Any] = {}
    for name, value in state.items():
        if block is not None and is_blockwise(name, state):
            out[name] = cut_blockwise(name, value, start, stop, block)
        elif is_elementwise(name, value, shape):
            piece = value.detach().reshape(-1)[start:stop]
            out[name] = piece.clone() if copy else piece
        else:
            out[name] = _copy(value) if copy else value
    return out


class _Joined:
    """The state of one parameter being assembled from its pieces."""

    def __init__(self, shape: tuple[int, ...], names: list[str]) -> None:
        self.shape = shape
        self.names = names
        self.values: dict[str, Any] = {}
        self.first_start = _numel(shape) + 1  # scalars come from the lowest piece
        self.covered: list[tuple[int, int]] = []


class Incoming(NamedTuple):
    """Marks an elementwise piece value still to arrive (see :meth:`PieceJoiner.slots`).

    Attributes:
        dtype: the value's dtype.
    """

    dtype: torch.dtype


class PieceJoiner:
    """Assemble torch-format parameter states from piece states as they arrive.

    Each piece's elementwise values go once into a buffer of the whole parameter's size (a
    whole-parameter value given to :meth:`add` is kept as it is), so a caller can drop every
    piece after :meth:`add`, or receive values straight into the buffers that :meth:`slots`
    hands out: the joined states plus at most one piece are all that is ever held.
    """

    def __init__(self, blocks: Mapping[int, BlockFormat] | None = None) -> None:
        self._joined: dict[int, _Joined] = {}
        self._blocks = blocks or {}

    def _join_block(self, joined: _Joined, piece: Piece, name: str, value: Any, state: Any) -> bool:
        """File a low-bit codes/scales entry by block; False when ``name`` is not one."""
        fmt = self._blocks.get(piece.param_index)
        if fmt is None or not is_blockwise(name, state):
            return False
        join_blockwise(
            joined.values, name, value, piece.start, piece.stop, _numel(piece.shape), fmt
        )
        return True

    def _register(self, piece: Piece, names: list[str]) -> _Joined:
        joined = self._joined.get(piece.param_index)
        if joined is None:
            joined = self._joined[piece.param_index] = _Joined(piece.shape, names)
        elif names != joined.names:
            raise ValueError("pieces of one parameter hold different state names")
        joined.covered.append((piece.start, piece.stop))
        return joined

    def _keep_scalar(self, joined: _Joined, piece: Piece, name: str, value: Any) -> None:
        if piece.start <= joined.first_start:
            joined.values[name] = _copy(value)

    def add(self, piece: Piece, state: Mapping[str, Any]) -> None:
        """File the state of ``piece`` (1-D elementwise values) under its parameter.

        Raises:
            ValueError: if the pieces of one parameter disagree on the state names.
        """
        joined = self._register(piece, list(state))
        numel = _numel(piece.shape)
        for name, value in state.items():
            if self._join_block(joined, piece, name, value, state):
                continue
            if not is_elementwise(name, value, (piece.numel,)):
                self._keep_scalar(joined, piece, name, value)
                continue
            flat = value.detach().reshape(-1)
            if piece.whole:
                joined.values[name] = flat
                continue
            buffer = joined.values.get(name)
            if buffer is None:
                buffer = joined.values[name] = flat.new_empty(numel)
            buffer[piece.start : piece.stop].copy_(flat)
        joined.first_start = min(joined.first_start, piece.start)

    def slots(self, piece: Piece, state: Mapping[str, Any]) -> list[torch.Tensor]:
        """File ``piece``'s scalars; return where its :class:`Incoming` values are to be written.

        Args:
            piece: where the state lies in its parameter.
            state: the piece's state with :class:`Incoming` markers for the elementwise values.

        Returns:
            For each marker in ``state`` order, the 1-D CPU tensor of ``piece.numel`` elements
            (a view of the joined buffer) that the value must be copied or received into.

        Raises:
            ValueError: if the pieces of one parameter disagree on the state names.
        """
        joined = self._register(piece, list(state))
        numel = _numel(piece.shape)
        out = []
        for name, value in state.items():
            if self._join_block(joined, piece, name, value, state):
                continue
            if not isinstance(value, Incoming):
                self._keep_scalar(joined, piece, name, value)
                continue
            buffer = joined.values.get(name)
            if buffer is None:
                buffer = joined.values[name] = torch.empty(numel, dtype=value.dtype)
            out.append(buffer[piece.start : piece.stop])
        joined.first_start = min(joined.first_start, piece.start)
        return out

    def finish(self) -> dict[int, dict[str, Any]]:
        """The joined states by parameter index, sorted, elementwise values parameter-shaped.

        Raises:
            ValueError: if the pieces of a parameter do not tile it.
        """
        out: dict[int, dict[str, Any]] = {}
        for index in sorted(self._joined):
            joined = self._joined[index]
            numel = _numel(joined.shape)
            position = 0
            for start, stop in sorted(joined.covered):
                if start != position:
                    raise ValueError(f"pieces leave a gap or overlap at element {position}")
                position = stop
            if position != numel:
                raise ValueError(f"pieces cover {position} of the parameter's {numel} elements")
            out[index] = {
                name: (
                    joined.values[name].reshape(joined.shape)
                    if is_elementwise(name, joined.values[name], (numel,))
                    and not is_blockwise(name, joined.values)
                    else joined.values[name]
                )
                for name in joined.names
            }
        self._joined.clear()
        return out


def join_piece_states(
    parts: Sequence[tuple[int, int, Mapping[str, Any]]], shape: Sequence[int]
) -> dict[str, Any]:
    """Join piece states (1-D elementwise values) into one torch-format parameter state.

    Args:
        parts: ``(start, stop, state)`` for pieces that together cover the parameter; scalars
            are taken from the piece that starts first.
        shape: the parameter's shape.

    Returns:
        The parameter's state with elementwise tensors shaped like the parameter.

    Raises:
        ValueError: if the pieces do not tile ``[0, numel)`` or disagree on the state names.
    """
    if not parts:
        raise ValueError(f"pieces cover 0 of the parameter's {_numel(shape)} elements")
    joiner = PieceJoiner()
    for start, stop, state in parts:
        joiner.add(Piece(0, start, stop, tuple(shape)), state)
    return joiner.finish()[0]


def place_state(
    state: Mapping[str, Any], tensor: torch.Tensor, group: Mapping[str, Any]
) -> dict[str, Any]:
    """Move a (piece or parameter) state next to ``tensor`` as ``torch.optim`` expects.

    Elementwise values take ``tensor``'s device, dtype and shape. ``step`` stays where it is
    (a CPU float32 scalar) unless the group is ``fused`` or ``capturable``, where it goes to
    ``tensor``'s device (torch's policy; getting this wrong is pytorch issue 124133).

    Args:
        state: the state to place (not modified).
        tensor: the tensor the local optimizer updates.
        group: the local param group that holds ``tensor``.

    Returns:
        A new dict, ready for ``optimizer.state[tensor]``.
    """
    on_device = bool(group.get("fused") or group.get("capturable"))
    placed: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            placed[name] = value
        elif name == "step":
            placed[name] = (
                value.to(dtype=torch.float32, device=tensor.device) if on_device else value
            )
        elif (
            value.numel() == tensor.numel()
            and (value.dim() > 0 or tensor.dim() == 0)
            and not is_blockwise(name, state)
        ):
            dtype = tensor.dtype if value.is_floating_point() else value.dtype
            placed[name] = value.to(device=tensor.device, dtype=dtype).reshape(tensor.shape)
        else:
            placed[name] = value.to(device=tensor.device)
    return placed
