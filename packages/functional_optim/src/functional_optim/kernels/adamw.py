"""adamw kernel: Adam with decoupled weight decay, on the paths of :mod:`.adam`.

torch.optim.AdamW is Adam with ``decoupled_weight_decay=True``; the paths here run adam's with
that flag, so each is bitwise equal to torch.optim.AdamW with the matching foreach/fused flag.
"""

from typing import List

from torch import Tensor

from functional_optim.kernels._adam_paths import _adam_foreach, _adam_fused, _adam_single, adam_impl
from functional_optim.kernels._dispatch import resolve_impl


def adamw_single(
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
) -> None:
    """Per-tensor AdamW; bitwise equal to ``torch.optim.AdamW(..., foreach=False)``.

    Args: as :func:`adamw`, without ``impl``."""
    _adam_single(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        amsgrad,
        beta1,
        beta2,
        lr,
        weight_decay,
        eps,
        maximize,
        True,
    )


def adamw_foreach(
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
) -> None:
    """Multi-tensor AdamW; bitwise equal to ``torch.optim.AdamW(..., foreach=True)``.

    Args: as :func:`adamw`, without ``impl``."""
    _adam_foreach(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        amsgrad,
        beta1,
        beta2,
        lr,
        weight_decay,
        eps,
        maximize,
        True,
    )


def adamw_fused(
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
) -> None:
    """Fused AdamW (``torch._fused_adamw_``); bitwise equal to ``torch.optim.AdamW(fused=True)``.

    Needs floating-point (not complex) params; ``state_steps`` on the params' device.

    Args: as :func:`adamw`, without ``impl``."""
    _adam_fused(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        amsgrad,
        beta1,
        beta2,
        lr,
        weight_decay,
        eps,
        maximize,
        True,
    )


def adamw(
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
    """AdamW: Adam with decoupled weight decay (torch.optim.AdamW).

    Same arguments and in-place contract as :func:`functional_optim.kernels.adam.adam`, except
    that ``weight_decay`` shrinks the params by ``1 - lr * weight_decay`` before the update
    instead of being added to the gradient.

    Raises:
        ValueError: if ``impl`` is unknown.
        RuntimeError: if ``impl="fused"`` and the params cannot use the fused kernel.
    """
    adam_impl(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        amsgrad,
        beta1,
        beta2,
        lr,
        weight_decay,
        eps,
        maximize,
        True,
        resolve_impl(impl, params, True, True, True),
    )
