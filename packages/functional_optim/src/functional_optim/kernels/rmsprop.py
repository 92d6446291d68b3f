"""rmsprop kernel: per-tensor, multi-tensor (``_foreach``) paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def rmsprop(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffers: List[Tensor],
    state_steps: List[Tensor],
    lr: float,
    alpha: float,
    eps: float,
    weight_decay: float,
    momentum: float,
    centered: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """RMSprop (torch.optim.RMSprop). ``grad_avgs`` is empty unless ``centered``;
    ``momentum_buffers`` is empty unless ``momentum > 0``."""
    raise NotImplementedError("rmsprop kernel not implemented yet")
