"""sgd kernel: per-tensor, multi-tensor (``_foreach``) and fused paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List, Optional

from torch import Tensor


def sgd(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffers: List[Optional[Tensor]],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """SGD with momentum, dampening, weight decay, Nesterov and maximize (torch.optim.SGD).

    ``momentum_buffers[i]`` may be None before the first step; the kernel stores the new buffer
    there (a clone of the first gradient), as torch does."""
    raise NotImplementedError("sgd kernel not implemented yet")
