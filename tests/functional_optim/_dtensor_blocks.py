"""DTensors made from whole tensors by torch's own split rules, without communication."""

from __future__ import annotations

from typing import Any

import torch


def from_full(full: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """``full`` as a DTensor with ``placements`` on ``mesh``: this rank's block cut by each
    placement's ``_split_tensor`` in mesh-dim order (a copy: a chain's fused step consumes its
    gradients, which must not share storage with a reference run's)."""
    from torch.distributed.tensor import DTensor

    local, coordinate = full, mesh.get_coordinate()
    for d, placement in enumerate(placements):
        if not placement.is_replicate():
            local = placement._split_tensor(local, mesh.size(d), with_padding=False)[0][
                coordinate[d]
            ]
    return DTensor.from_local(
        local.clone(memory_format=torch.contiguous_format),
        mesh,
        placements,
        shape=full.shape,
        stride=full.stride(),
    )
