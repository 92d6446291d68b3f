"""Where ``impl="auto"`` must not take torch's fused kernel, and torch's refusal of ``fused``.

* torch 2.13's fused CPU SGD with momentum reads memory it never wrote in bfloat16 / float16
  (two identical runs differ): our fused path runs torch's loop there (bitwise
  ``foreach=False``), whether picked by default or asked for.
* ``fused`` on a device torch's fused kernels do not take gets torch's message (torch 2.13's
  fused Adagrad takes CUDA too; the CUDA side runs in tests/on_device).
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import _device_dtype_check_for_fused

import functional_optim as fo
from functional_optim.kernels import resolve_impl

from ._parity import assert_tensors_equal, make_grads, make_params

SHAPES = ((), (7,), (4, 5), (2, 3, 4), (33,))


def _fo_sgd(params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    ps = [p.clone() for p in params]
    opt = fo.Optimizer([p.requires_grad_(True) for p in ps], fo.sgd(lr=0.05, momentum=0.9))
    for row in grads:
        for p, g in zip(ps, row, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _fused_kernel(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]]
) -> list[torch.Tensor]:
    ps = [p.clone() for p in params]
    bufs: list[torch.Tensor | None] = [None] * len(ps)
    for row in grads:
        fo.kernels.sgd(
            ps, [g.clone() for g in row], bufs, 0.05, 0.9, 0.0, 0.0, False, False, "fused"
        )
    return ps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sgd_momentum_in_reduced_precision_on_cpu_is_torchs_loop(dtype: torch.dtype) -> None:
    params = [p.to(dtype) for p in make_params(SHAPES)]
    grads = [[g.to(dtype) for g in row] for row in make_grads(make_params(SHAPES), 3)]  # type: ignore[union-attr]
    leaves = [p.clone().requires_grad_(True) for p in params]
    reference = torch.optim.SGD(leaves, lr=0.05, momentum=0.9, foreach=False)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g.clone()
        reference.step()
    expected = [p.detach() for p in leaves]
    first, second = _fo_sgd(params, grads), _fo_sgd(params, grads)
    assert_tensors_equal(first, expected, what="fo.sgd vs torch loop")
    assert_tensors_equal(second, first, what="two identical runs")
    assert_tensors_equal(_fused_kernel(params, grads), expected, what="impl='fused'")


def test_fused_refusal_without_cuda_matches_torch() -> None:
    meta = torch.empty(3, device="meta")
    with pytest.raises(RuntimeError) as theirs:
        _device_dtype_check_for_fused(meta, cuda_unsupported=True)
    with pytest.raises(RuntimeError) as ours:
        resolve_impl("fused", [meta], True, False)
    assert str(ours.value) == str(theirs.value)
    assert "'cuda'" not in str(ours.value)
    with pytest.raises(RuntimeError) as with_cuda:
        resolve_impl("fused", [meta], True)
    assert "'cuda'" in str(with_cuda.value)
