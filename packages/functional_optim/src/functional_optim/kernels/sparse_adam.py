"""sparse_adam kernel: Adam on the rows a sparse gradient touches (torch.optim.SparseAdam).

Reproduces torch's per-tensor implementation op for op (there is no other), so results are
bitwise equal: the moments and the param change only where the coalesced gradient has entries.
A tensor ``lr`` gives the step size in tensor maths (a 0-d tensor of ``lr``'s dtype), as torch
computes it from one.
"""

import math
from typing import List, Optional, Union

from torch import Tensor


def _add_at(dense: Tensor, indices: Tensor, values: Tensor) -> None:
    """``dense += sparse(indices, values)`` for coalesced (unique) ``indices``: the same sums
    as torch's dense-plus-sparse ``add_``, without building a COO tensor (whose Python
    constructor warns about invariant checks)."""
    where: List[Optional[Tensor]] = []
    for row in indices.unbind(0):
        where.append(row)
    dense.index_put_(where, values, accumulate=True)


def sparse_adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    eps: float,
    beta1: float,
    beta2: float,
    lr: Union[float, Tensor],
    maximize: bool,
) -> None:
    """SparseAdam (torch.optim.SparseAdam): dense params, sparse (COO) gradients.

    Updates ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``state_steps`` in place (the step
    counts even when a gradient has no entries, as torch's); call it under
    ``torch.no_grad()``.

    Args:
        params: dense parameters to update.
        grads: one sparse COO gradient per param.
        exp_avgs: dense first-moment buffers, one per param.
        exp_avg_sqs: dense second-moment buffers, one per param.
        state_steps: 0-d step counters, one per param (incremented here).
        eps: term added to the denominator.
        beta1: first-moment decay.
        beta2: second-moment decay.
        lr: learning rate: a float, or a 0-d tensor (the step size is then computed in its
            dtype, as torch does).
        maximize: maximize the objective instead of minimizing.

    Raises:
        RuntimeError: torch's message if a gradient is dense.
    """
    for grad in grads:
        if not grad.is_sparse:
            raise RuntimeError(
                "SparseAdam does not support dense gradients, please consider Adam instead"
            )
    for i in range(len(params)):
        state_steps[i] += 1
        grad = grads[i]
        if maximize:
            grad = -grad
        grad = grad.coalesce()
        indices = grad._indices()
        values = grad._values()
        if values.numel() == 0:
            continue
        param = params[i]
        exp_avg = exp_avgs[i]
        exp_avg_sq = exp_avg_sqs[i]
        step = float(state_steps[i].item())
        old_exp_avg = exp_avg.sparse_mask(grad)._values()
        exp_avg_update = values.sub(old_exp_avg).mul_(1 - beta1)
        _add_at(exp_avg, indices, exp_avg_update)
        old_exp_avg_sq = exp_avg_sq.sparse_mask(grad)._values()
        exp_avg_sq_update = values.pow(2).sub_(old_exp_avg_sq).mul_(1 - beta2)
        _add_at(exp_avg_sq, indices, exp_avg_sq_update)
        numer = exp_avg_update.add_(old_exp_avg)
        exp_avg_sq_update.add_(old_exp_avg_sq)
        denom = exp_avg_sq_update.sqrt_().add_(eps)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        if isinstance(lr, Tensor):
            lr_step_size = lr * math.sqrt(bias_correction2) / bias_correction1
            update = -lr_step_size * numer.div_(denom)
        else:
            step_size = lr * math.sqrt(bias_correction2) / bias_correction1
            update = -step_size * numer.div_(denom)
        _add_at(param, indices, update)
