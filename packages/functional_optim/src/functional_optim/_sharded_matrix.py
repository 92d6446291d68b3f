"""Muon on sharded DTensor matrices: each matrix orthogonalised once, on one owner rank.

Newton-Schulz reads a whole matrix, so it cannot run on a shard. ``fo.muon``'s kernel is
wrapped (:func:`shards_matrices`) so that, inside ``fo.Optimizer``'s local step of DTensor
params (:mod:`functional_optim._sharded_params` installs ``outer_params``), the sharded
matrices of a step go through :func:`muon_on_shards`:

1. the momentum is updated element-wise on the local shards (it stays sharded);
2. the local blocks of the direction, cast to bfloat16 (the dtype Newton-Schulz computes in:
   the cast is element-wise, so the owner sees exactly the cast of the full matrix), go to
   their owner ranks and come back orthogonalised (:func:`functional_optim._owner_compute.
   owner_map`: cost-balanced owners, batched ``all_to_all``, communication overlapped with
   Newton-Schulz; FSDP2 ``Shard(0)``, tensor-parallel ``Shard(0|1)`` on 2-D meshes);
3. every rank applies the decay and the (shape-adjusted) step to its local shards.

The owner runs the unsharded maths on the unsharded input, so the result is bitwise that of
``torch.optim.Muon`` on the full tensors. Every rank must step the same matrices (the params
with a gradient), as FSDP2 guarantees; the first step checks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._aliases._kernel_spec import KernelSpec
from functional_optim._owner_compute import (
    check_matrix_group,
    is_sharded,
    outer_of,
    owner_map,
    prepare,
)
from functional_optim.kernels.muon import adjusted_lr_ratio, newton_schulz

__all__ = ["check_muon_placements", "muon_on_shards", "shards_matrices"]

#: ``(base spec, its wrapped copy)`` by ``id(base spec)``
_SPECS: dict[int, tuple[KernelSpec, KernelSpec]] = {}

_WIRE = torch.bfloat16  # Newton-Schulz's dtype: what travels


def check_muon_placements(i: int, params: Sequence[Any]) -> None:
    """Check group ``i``'s sharded matrices before its first step (a collective).

    Raises:
        ValueError: see :func:`functional_optim._owner_compute.check_matrix_group`.
    """
    check_matrix_group(i, params, "Muon")


def _apply(param: Tensor, ortho: Tensor, lr: float | Tensor, wd: float, ratio: float) -> None:
    """The decay and the step, as ``kernels.muon_single`` writes them."""
    if isinstance(lr, Tensor):
        lr_adjusted = lr * ratio
        param.mul_(1 - lr * wd)
        param.add_(ortho, alpha=-float(lr_adjusted.item()))
    else:
        param.mul_(1 - lr * wd)
        param.add_(ortho, alpha=-(lr * ratio))


def muon_on_shards(
    params: list[Tensor],
    outer: list[Any],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    lr: float | Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    adjust_lr_fn: str | None,
) -> None:
    """Muon on the local blocks of sharded matrices of one mesh (see the module).

    Args:
        params: the local shards.
        outer: their DTensor params.
        grads, momentum_buffers, ...: as ``kernels.muon`` (local shards).
    """
    prepare(outer, "Muon")  # the first step's checks, before anything changes
    directions: list[Tensor] = []
    for g, buf in zip(grads, momentum_buffers, strict=True):
        buf.lerp_(g, 1 - momentum)
        directions.append(g.lerp(buf, momentum) if nesterov else buf)

    def orthogonalised(j: int, whole: Tensor) -> Tensor:
        del j
        return newton_schulz(whole, ns_coefficients, ns_steps, eps)

    for j, ortho in owner_map(directions, outer, orthogonalised, _WIRE, name="Muon"):
        rows, cols = int(outer[j].shape[0]), int(outer[j].shape[1])
        _apply(params[j], ortho, lr, weight_decay, adjusted_lr_ratio(adjust_lr_fn, rows, cols))


def _pick(xs: Sequence[Any], keep: list[int]) -> list[Any]:
    return [xs[k] for k in keep]


def _checked(grads: list[Tensor], ns_steps: int) -> None:
    """Newton-Schulz's checks on every rank before anything moves (an owner raising alone
    would leave the others waiting in the collective)."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    for g in grads:
        if g.dim() != 2:
            raise ValueError("Param gradient must be a 2D matrix")


def shards_matrices(spec: KernelSpec) -> KernelSpec:
    """``spec`` (Muon's kernel declaration) with a kernel that steps sharded DTensor matrices
    through :func:`muon_on_shards` and everything else through ``spec.kernel``.

    Args:
        spec: the registered declaration (its kernel takes ``kernels.muon``'s arguments).

    Returns:
        The declaration with the wrapped kernel (cached per ``spec``).
    """
    cached = _SPECS.get(id(spec))
    if cached is not None and cached[0] is spec:
        return cached[1]
    base: Callable[..., None] = spec.kernel

    def muon(
        params: list[Tensor],
        grads: list[Tensor],
        momentum_buffers: list[Tensor],
        lr: float | Tensor,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_coefficients: tuple[float, float, float],
        ns_steps: int,
        eps: float,
        adjust_lr_fn: str | None,
        impl: str = "auto",
    ) -> None:
        outer = outer_of(params)
        sharded = [k for k, d in enumerate(outer) if is_sharded(d)]
        if not sharded:
            base(
                params, grads, momentum_buffers, lr, weight_decay, momentum, nesterov,
                ns_coefficients, ns_steps, eps, adjust_lr_fn, impl,
            )  # fmt: skip
            return
        _checked(grads, ns_steps)
        hyper = (lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps)
        whole = [k for k in range(len(params)) if k not in set(sharded)]
        if whole:  # replicated matrices: every rank has them whole
            base(
                _pick(params, whole), _pick(grads, whole), _pick(momentum_buffers, whole),
                *hyper, adjust_lr_fn, impl,
            )  # fmt: skip
        muon_on_shards(
            _pick(params, sharded), _pick(outer, sharded), _pick(grads, sharded),
            _pick(momentum_buffers, sharded), *hyper, adjust_lr_fn,
        )  # fmt: skip

    wrapped = dataclasses.replace(spec, kernel=muon)
    _SPECS[id(spec)] = (spec, wrapped)
    return wrapped
