"""adam kernel: per-tensor, multi-tensor (``_foreach``) and fused paths behind one dispatch.

Placeholder signature fixed by the workspace skeleton; the implementation replaces the body.
"""

from typing import List

from torch import Tensor


def adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    impl: str = "auto",
) -> None:
    """Adam with L2 weight decay, AMSGrad and maximize (torch.optim.Adam)."""
    raise NotImplementedError("adam kernel not implemented yet")
