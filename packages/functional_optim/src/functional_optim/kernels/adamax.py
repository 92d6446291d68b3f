"""adamax kernel: per-tensor, multi-tensor (``_foreach``) paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def adamax(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adamax (torch.optim.Adamax)."""
    raise NotImplementedError("adamax kernel not implemented yet")
