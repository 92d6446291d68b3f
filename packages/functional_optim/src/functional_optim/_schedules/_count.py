"""The step count every schedule takes, as a float64 tensor."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_count"]


def as_count(count: Tensor | int) -> Tensor:
    """``count`` (a 0-d integer tensor or an int) as a float64 tensor, on its device; no
    ``.item()``, so a traced count stays traced."""
    return torch.as_tensor(count).to(torch.float64)
