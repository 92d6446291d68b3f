"""What optax's Adam-family scalings share: the stored moment's dtype and Nesterov's estimate.

Moments follow optax's ``update_moment`` (``(1 - decay) * g**order + decay * m``) and
``bias_correction`` (``m / (1 - decay**t)``); counts are kept per param (0-d tensors), so a
param whose update is ``None`` keeps its moments and its count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from functional_optim._transforms._leaf import debias, store
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = ["Scalar", "keep", "moment_zeros", "nesterov_mu_hat"]

Scalar = float | Tensor


def moment_zeros(params: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Zeros like ``params`` (in ``dtype`` when given: optax's ``mu_dtype``)."""
    zeros = tree_zeros_like(params)
    if dtype is None:
        return zeros
    leaves, spec = tree_flatten(zeros)
    return spec.unflatten([None if z is None else z.to(dtype) for z in leaves])


def keep(buf: Tensor, new: Tensor, inplace: bool) -> Tensor:
    """Store ``new`` in ``buf``'s dtype (the output uses ``new`` itself, as optax does)."""
    return store(buf, new if new.dtype == buf.dtype else new.to(buf.dtype), inplace)


def nesterov_mu_hat(mu: Tensor, g: Tensor, b1: Scalar, count: Tensor) -> Tensor:
    """Dozat's Nesterov estimate as optax forms it: ``b1 * m / (1 - b1**(t+1))
    + (1 - b1) * g / (1 - b1**t)``."""
    return b1 * debias(mu, b1, count + 1) + (1 - b1) * debias(g, b1, count)
