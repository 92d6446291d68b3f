"""FunctionalSGD: a TorchScript-compilable SGD that takes gradients explicitly.

Drop-in for ``torch.distributed.optim._FunctionalSGD`` (same constructor, attributes and state;
like torch, no hyperparameter validation) without its deprecation warning.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from functional_optim.functional._local_shards import (
    check_local_step,
    has_dtensor,
    local_optional,
    local_tensors,
    wrap_like,
)
from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import (
    check_lengths,
    ensure_state,
    make_param_group,
    pick_impl,
)
from functional_optim.kernels._tensor_lists import has_sparse
from functional_optim.kernels.sgd import sgd_impl


class FunctionalSGD:
    """SGD over explicit gradients, like ``torch.distributed.optim._FunctionalSGD``.

    When neither ``foreach`` nor ``fused`` is set, the fastest kernel for the device is used
    (torch's fused kernel on CPU; the per-tensor one for sparse gradients), which matches
    torch's default loop up to float rounding; ``foreach=True`` / ``fused=True`` match torch
    bitwise.

    Args:
        params: the parameters to optimize (one group).
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing.
        foreach: use the multi-tensor kernel.
        fused: use torch's fused kernel.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: for an empty ``params`` (torch's message).
        RuntimeError: if ``fused=True`` and a param cannot use the fused kernel.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
        }
        self.nesterov = nesterov
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self._impl = pick_impl(params, foreach, fused, True)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalSGD)

    def _update(self, params: List[Tensor], gradients: List[Optional[Tensor]]) -> None:
        params_with_grad: List[Tensor] = []
        grads: List[Tensor] = []
        states: List[Dict[str, Tensor]] = []
        bufs: List[Optional[Tensor]] = []
        for i in range(len(params)):
            grad = gradients[i]
            if grad is not None:
                entry = ensure_state(self.state, params[i], [], [], False, False)
                params_with_grad.append(params[i])
                grads.append(grad)
                states.append(entry)
                bufs.append(entry.get("momentum_buffer"))
        owners = params_with_grad
        if not torch.jit.is_scripting() and has_dtensor(params_with_grad):  # type: ignore[attr-defined]
            check_local_step(params_with_grad, grads, "SGD")
            params_with_grad = local_tensors(params_with_grad)
            grads = local_tensors(grads)
            bufs = local_optional(bufs)
        impl = self._impl
        if impl == "fused" and not self.fused and has_sparse(grads):
            impl = "single"  # auto picked fused, but it cannot take sparse gradients
        d = self.defaults
        with torch.no_grad():
            sgd_impl(
                params_with_grad,
                grads,
                bufs,
                d["lr"],
                d["momentum"],
                d["dampening"],
                d["weight_decay"],
                self.nesterov,
                self.maximize,
                impl,
            )
        for i in range(len(states)):
            buf = bufs[i]
            if buf is not None:
                if not torch.jit.is_scripting():  # type: ignore[attr-defined]
                    buf = wrap_like(buf, owners[i])
                states[i]["momentum_buffer"] = buf

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (a None gradient does nothing; torch fails)."""
        gradients: List[Optional[Tensor]] = [grad]
        self._update([param], gradients)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        self._update(params, gradients)
