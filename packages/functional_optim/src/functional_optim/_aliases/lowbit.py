"""Low-bit-state aliases: AdamW / Adam / Lion with 8-bit, 4-bit or fp8 moments.

Each is :func:`~functional_optim._lowbit.transform.quantized_state` around the fp32 alias, with
torch's hyperparameter names plus ``block_size`` and ``min_size`` (all in the param groups).
"""

from __future__ import annotations

from torch import Tensor

from functional_optim._aliases import adam as _adam
from functional_optim._aliases._common import LearningRate, scalar_betas
from functional_optim._aliases.optax_sgd import _lion
from functional_optim._base import GradientTransformation
from functional_optim._lowbit.transform import check_lowbit_args, quantized_state
from functional_optim._recipes import transform_factory
from functional_optim._transforms.hyperparams import inject_hyperparams

__all__ = ["adam8bit", "adamw4bit", "adamw8bit", "adamw_fp8", "lion8bit"]

Betas = tuple[float | Tensor, float | Tensor]


def _adam_lowbit(
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    maximize: bool,
    kind: str,
    block_size: int,
    min_size: int,
    decoupled_weight_decay: bool,
) -> GradientTransformation:
    check_lowbit_args(kind, block_size, min_size)
    inner = _adam._build(
        lr, betas, eps, weight_decay, False, maximize, None, False, False, None,
        decoupled_weight_decay,
    )  # fmt: skip
    return quantized_state(inner, kind, block_size, min_size)


def _adam_alias(
    kind: str,
    lr: LearningRate,
    betas: Betas,
    eps: float,
    weight_decay: float,
    maximize: bool,
    block_size: int,
    min_size: int,
    decoupled: bool,
) -> GradientTransformation:
    return inject_hyperparams(_adam_lowbit)(
        lr=lr,
        betas=scalar_betas(betas),
        eps=eps,
        weight_decay=weight_decay,
        maximize=maximize,
        kind=kind,
        block_size=block_size,
        min_size=min_size,
        decoupled_weight_decay=decoupled,
    )


@transform_factory
def adamw8bit(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    maximize: bool = False,
    block_size: int = 256,
    min_size: int = 4096,
) -> GradientTransformation:
    """AdamW (``torch.optim.AdamW``'s maths) with 8-bit moments (``"int8"`` minifloat codes).

    On fp32 CPU params the step is one C++ pass (decode, update, encode; see
    ``docs/lowbit.md``); its operations are ordered as written in
    ``functional_optim._lowbit.adam_maths``, not as torch's fused kernel orders them.

    Args:
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        block_size: elements per scale (over the whole flattened param); a power of two.
        min_size: params with fewer elements keep fp32 moments.

    Returns:
        An injected ``GradientTransformation`` (see :func:`fo.quantized_state` for its state).

    Raises:
        ValueError: torch's messages for bad hyperparameters; a bad ``block_size``.
    """
    return _adam_alias("int8", lr, betas, eps, weight_decay, maximize, block_size, min_size, True)


@transform_factory
def adam8bit(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0,
    *,
    maximize: bool = False,
    block_size: int = 256,
    min_size: int = 4096,
) -> GradientTransformation:
    """Adam (``torch.optim.Adam``'s maths, L2 ``weight_decay``) with 8-bit moments.

    Args: as :func:`adamw8bit`.
    """
    return _adam_alias("int8", lr, betas, eps, weight_decay, maximize, block_size, min_size, False)


@transform_factory
def adamw4bit(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    maximize: bool = False,
    block_size: int = 128,
    min_size: int = 4096,
) -> GradientTransformation:
    """AdamW with 4-bit moments, two codes per byte; the second moment never rounds a
    non-zero value to zero (Li et al. 2023). On fp32 CPU params, one C++ pass per step, as
    :func:`adamw8bit`.

    Args: as :func:`adamw8bit` (``block_size`` defaults to 128).
    """
    return _adam_alias("int4", lr, betas, eps, weight_decay, maximize, block_size, min_size, True)


@transform_factory
def adamw_fp8(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    maximize: bool = False,
    block_size: int = 256,
    min_size: int = 4096,
) -> GradientTransformation:
    """AdamW with ``float8_e4m3fn`` moments and blockwise scales (on fp32 CPU params, one C++
    pass per step, as :func:`adamw8bit`).

    Args: as :func:`adamw8bit`.
    """
    return _adam_alias("fp8", lr, betas, eps, weight_decay, maximize, block_size, min_size, True)


def _lion_lowbit(
    lr: LearningRate,
    betas: Betas,
    weight_decay: float,
    kind: str,
    block_size: int,
    min_size: int,
) -> GradientTransformation:
    check_lowbit_args(kind, block_size, min_size)
    inner = _lion(lr, betas[0], betas[1], None, weight_decay, None)
    return quantized_state(inner, kind, block_size, min_size)


@transform_factory
def lion8bit(
    lr: LearningRate = 1e-4,
    betas: Betas = (0.9, 0.99),
    weight_decay: float = 0.0,
    *,
    block_size: int = 256,
    min_size: int = 4096,
) -> GradientTransformation:
    """Lion (Chen et al. 2023) with an 8-bit momentum.

    Args:
        lr: learning rate.
        betas: ``(b1, b2)``: the sign's mix and the momentum's decay.
        weight_decay: decoupled weight decay (multiplied by ``lr``).
        block_size, min_size: as :func:`adamw8bit`.
    """
    return inject_hyperparams(_lion_lowbit)(
        lr=lr,
        betas=scalar_betas(betas),
        weight_decay=weight_decay,
        kind="int8",
        block_size=block_size,
        min_size=min_size,
    )
