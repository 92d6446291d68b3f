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

__all__ = [
    "SCALAR_STATE_NAMES",
    "Piece",
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
    state: Mapping[str, Any], shape: Sequence[int], start: int, stop: int, copy: bool = True
) -> dict[str, Any]:
    """Cut a whole parameter's torch-format state down to elements ``[start, stop)``.

    Args:
        state: the parameter's state (``optimizer.state[param]`` or ``state_dict["state"][i]``).
        shape: the parameter's shape.
        start: first element of the piece.
        stop: one past its last element.
        copy: copy the values (False: views of ``state``'s tensors where possible).

    Returns:
        A new dict: elementwise tensors become 1-D slices, other values copies (or the same
        objects without ``copy``).
    """
    out: dict[str, Any] = {}
    for name, value in state.items():
        if is_elementwise(name, value, shape):
            piece = value.detach().reshape(-1)[start:stop]
            out[name] = piece.clone() if copy else piece
        else:
            out[name] = _copy(value) if copy else value
    return out


def join_piece_states(
    parts: Sequence[tuple[int, int, Mapping[str, Any]]], shape: Sequence[int]
) -> dict[str, Any]:
    """Join piece states (1-D elementwise values) into one torch-format parameter state.

    Args:
        parts: ``(start, stop, state)`` for pieces that together cover the parameter; they are
            joined in ``start`` order, scalars taken from the first piece.
        shape: the parameter's shape.

    Returns:
        The parameter's state with elementwise tensors shaped like the parameter.

    Raises:
        ValueError: if the pieces do not tile ``[0, numel)`` or disagree on the state names.
    """
    ordered = sorted(parts, key=lambda part: part[0])
    numel = _numel(shape)
    position = 0
    for start, stop, _ in ordered:
        if start != position:
            raise ValueError(f"pieces leave a gap or overlap at element {position}")
        position = stop
    if position != numel or not ordered:
        raise ValueError(f"pieces cover {position} of the parameter's {numel} elements")
    names = list(ordered[0][2])
    if any(list(state) != names for _, _, state in ordered):
        raise ValueError("pieces of one parameter hold different state names")
    joined: dict[str, Any] = {}
    for name in names:
        first = ordered[0][2][name]
        piece_shape = (ordered[0][1] - ordered[0][0],)
        if is_elementwise(name, first, piece_shape):
            values = [state[name].detach().reshape(-1) for _, _, state in ordered]
            # One piece (a whole parameter) is reshaped without a copy.
            joined[name] = (values[0] if len(values) == 1 else torch.cat(values)).reshape(shape)
        else:
            joined[name] = _copy(first)
    return joined


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
        elif value.numel() == tensor.numel() and (value.dim() > 0 or tensor.dim() == 0):
            dtype = tensor.dtype if value.is_floating_point() else value.dtype
            placed[name] = value.to(device=tensor.device, dtype=dtype).reshape(tensor.shape)
        else:
            placed[name] = value.to(device=tensor.device)
    return placed
