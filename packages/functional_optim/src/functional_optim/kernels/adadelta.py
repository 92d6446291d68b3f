"""adadelta kernel: per-tensor, multi-tensor (``_foreach``) paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def adadelta(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    rho: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adadelta (torch.optim.Adadelta)."""
    raise NotImplementedError("adadelta kernel not implemented yet")
