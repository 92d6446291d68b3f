"""adagrad kernel: per-tensor, multi-tensor (``_foreach``) and fused paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def adagrad(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    weight_decay: float,
    lr_decay: float,
    eps: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adagrad (torch.optim.Adagrad)."""
    raise NotImplementedError("adagrad kernel not implemented yet")
