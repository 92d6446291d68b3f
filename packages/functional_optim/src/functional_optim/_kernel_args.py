"""The arguments of a list kernel's call, by name (the kernel's order), for the code that runs
a call in another way: the low-bit steps and the out-of-place kernels of ``pure_step``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import Tensor

__all__ = ["AdamArgs", "SgdArgs", "adam_args", "sgd_args"]


class AdamArgs(NamedTuple):
    """The arguments of a :func:`functional_optim.kernels.adam` / ``adamw`` call."""

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    exp_avgs: Sequence[Tensor]
    exp_avg_sqs: Sequence[Tensor]
    max_exp_avg_sqs: Sequence[Tensor]
    state_steps: Sequence[Tensor]
    amsgrad: bool
    beta1: Any
    beta2: Any
    lr: Any
    weight_decay: Any
    eps: Any
    maximize: bool
    impl: str = "auto"


class SgdArgs(NamedTuple):
    """The arguments of a :func:`functional_optim.kernels.sgd` call."""

    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    momentum_buffers: Sequence[Tensor | None]
    lr: Any
    momentum: Any
    dampening: Any
    weight_decay: Any
    nesterov: bool
    maximize: bool
    impl: str = "auto"


def adam_args(args: Sequence[Any]) -> AdamArgs:
    """``args`` of an Adam / AdamW kernel call, named."""
    return AdamArgs(*args)


def sgd_args(args: Sequence[Any]) -> SgdArgs:
    """``args`` of an SGD kernel call, named."""
    return SgdArgs(*args)
