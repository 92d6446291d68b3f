"""adam kernel: per-tensor, multi-tensor (``_foreach``) and fused paths behind one dispatch.

Each path reproduces torch.optim.Adam's matching implementation op for op (``foreach=False``,
``foreach=True``, ``fused=True``), so results are bitwise equal. The paths themselves are in
:mod:`functional_optim.kernels._adam_paths`, shared with :mod:`functional_optim.kernels.adamw`.
"""

from typing import List

from torch import Tensor

from functional_optim.kernels._adam_paths import (
    _adam_foreach,
    _adam_fused,
    _adam_single,
    adam_impl,
)
from functional_optim.kernels._dispatch import resolve_impl

__all__ = ["adam", "adam_foreach", "adam_fused", "adam_impl", "adam_single"]


def adam_single(
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
    """Per-tensor Adam; bitwise equal to ``torch.optim.Adam(..., foreach=False)``.

    Args: as :func:`adam`, without ``impl``."""
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
        False,
    )


def adam_foreach(
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
    """Multi-tensor Adam; bitwise equal to ``torch.optim.Adam(..., foreach=True)``.

    Args: as :func:`adam`, without ``impl``."""
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
        False,
    )


def adam_fused(
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
    """Fused Adam (``torch._fused_adam_``); bitwise equal to ``torch.optim.Adam(..., fused=True)``.

    Needs floating-point (not complex) params; ``state_steps`` on the params' device.

    Args: as :func:`adam`, without ``impl``."""
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
        False,
    )


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
    """Adam with L2 weight decay, AMSGrad and maximize (torch.optim.Adam).

    Updates ``params``, ``exp_avgs``, ``exp_avg_sqs``, ``max_exp_avg_sqs`` and ``state_steps``
    in place; call it under ``torch.no_grad()`` or on detached tensors.

    Args:
        params: parameters to update.
        grads: one gradient per param.
        exp_avgs: first-moment buffers, one per param.
        exp_avg_sqs: second-moment buffers, one per param.
        max_exp_avg_sqs: running max of ``exp_avg_sqs`` (one per param when ``amsgrad``,
            else may be empty).
        state_steps: 0-d float step counters, one per param (incremented here).
        amsgrad: use the AMSGrad variant.
        beta1: first-moment decay.
        beta2: second-moment decay.
        lr: learning rate.
        weight_decay: L2 penalty added to the gradient.
        eps: term added to the denominator.
        maximize: maximize the objective instead of minimizing.
        impl: ``auto`` (fastest for the device: fused where possible), ``single``,
            ``foreach`` or ``fused``.

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
        False,
        resolve_impl(impl, params, True, True, True),
    )
