"""``muon``: torch.optim.Muon as a transform chain with a fused step."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import Tensor

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import (
    LearningRate,
    scalar_lr,
)
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._aliases._kernel_step import KernelSpec, with_kernel
from functional_optim._base import GradientTransformation, chain
from functional_optim._recipes import transform_factory
from functional_optim._sharded_matrix import shards_matrices
from functional_optim._transforms._leaf import is_traced
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.muon import (
    DEFAULT_NS_COEFFICIENTS,
    ScaleByMuonState,
    check_muon_inputs,
    scale_by_muon,
)
from functional_optim._transforms.scale import scale_by_learning_rate
from functional_optim._transforms.weight_decay import add_decayed_weights
from functional_optim.functional import FunctionalMuon

__all__ = ["MUON", "fused_tensor_lr", "muon"]

#: kernel declaration -> that declaration taking ``lr`` as the builder gives it
_TENSOR_LR_SPECS: dict[int, tuple[KernelSpec, KernelSpec]] = {}


def _tensor_lr_spec(spec: KernelSpec) -> KernelSpec:
    """``spec`` with the ``lr`` argument passed as the builder has it (the ``LR`` source reads
    a tensor as a float)."""
    cached = _TENSOR_LR_SPECS.get(id(spec))
    if cached is None or cached[0] is not spec:
        args = tuple("lr" if arg is LR else arg for arg in spec.args)
        cached = (spec, dataclasses.replace(spec, args=args))
        _TENSOR_LR_SPECS[id(spec)] = cached
    return cached[1]


def fused_tensor_lr(
    tx: GradientTransformation, entry: Algorithm, **values: Any
) -> GradientTransformation:
    """``entry.fused(tx, **values)``, but a tensor ``lr`` reaches the kernel as the tensor:
    torch's Muon and SparseAdam compute their step sizes from a tensor lr in tensor maths (in
    its dtype), which the kernel reproduces only when it gets the tensor. A float, a schedule
    or a traced (vmapped) lr goes through :meth:`Algorithm.fused` as before."""
    lr = values["lr"]
    spec = entry.kernel_spec
    if not isinstance(lr, Tensor) or is_traced(lr) or spec is None:
        return entry.fused(tx, **values)
    return with_kernel(tx, _tensor_lr_spec(spec), values)


def _check(
    lr: LearningRate, weight_decay: float, momentum: float, adjust_lr_fn: str | None
) -> None:
    """torch.optim.Muon's checks and messages, in its order."""
    if callable(lr):
        return
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not is_traced(lr) and not lr >= 0.0:  # a vmapped lr (a sweep) has no readable value
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not momentum >= 0.0:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")


def _build_muon(
    lr: LearningRate,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    eps: float,
    ns_steps: int,
    adjust_lr_fn: str | None,
) -> GradientTransformation:
    _check(lr, weight_decay, momentum, adjust_lr_fn)
    lr = scalar_lr(lr)
    tx = chain(
        scale_by_muon(momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )
    # the registered kernel, wrapped to step FSDP2-sharded matrices on one owner rank each
    tensor_lr = isinstance(lr, Tensor) and not is_traced(lr)
    spec = MUON.kernel_spec
    assert spec is not None
    spec = _tensor_lr_spec(spec) if tensor_lr else spec
    return with_kernel(
        tx,
        shards_matrices(spec),
        {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        },
    )


@transform_factory
def muon(
    lr: LearningRate = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon (``torch.optim.Muon``, 2-D params only): ``chain(scale_by_muon,
    add_decayed_weights, scale_by_learning_rate)`` with a fused ``step`` (``kernels.muon``).

    Args:
        lr: learning rate: a float, a 0-d tensor or a schedule.
        weight_decay: decoupled weight decay (scaled by ``lr``).
        momentum: momentum factor.
        nesterov: orthogonalise the Nesterov look-ahead.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz iteration.
        eps: floor of the normalising norm.
        ns_steps: Newton-Schulz iterations (< 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.

    Returns:
        An injected ``GradientTransformation``; ``init`` rejects params that are not 2-D.

    Raises:
        ValueError: with torch's messages.
    """
    return inject_hyperparams(_build_muon)(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.Muon.
MUON = Algorithm(
    name="muon",
    torch_name="Muon",
    alias=muon,
    transform=scale_by_muon,
    state_type=ScaleByMuonState,
    state_names={ScaleByMuonState: {"momentum_buffer": "momentum_buffer"}},
    kernel=kernels.muon,
    kernel_args=(
        PARAMS, GRADS, state("momentum_buffer"), LR, "weight_decay", "momentum",
        "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn", IMPL,
    ),
    check_inputs=check_muon_inputs,
    functional=FunctionalMuon,
)  # fmt: skip
