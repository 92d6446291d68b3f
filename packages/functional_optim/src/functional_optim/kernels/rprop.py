"""rprop kernel: per-tensor, multi-tensor (``_foreach``) paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def rprop(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    step_size_min: float,
    step_size_max: float,
    etaminus: float,
    etaplus: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Rprop (torch.optim.Rprop)."""
    raise NotImplementedError("rprop kernel not implemented yet")
