"""FunctionalAdamax: a TorchScript-compilable Adamax that takes gradients explicitly.

Drop-in for ``torch.distributed.optim._FunctionalAdamax`` without its deprecation warning.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, gather, make_param_group, pick_impl
from functional_optim.functional.adam import adam_defaults
from functional_optim.kernels.adamax import adamax_impl


class FunctionalAdamax:
    """Adamax over explicit gradients, like ``torch.distributed.optim._FunctionalAdamax``.

    torch has no fused Adamax; the default is the per-tensor kernel on CPU (bitwise equal to
    torch's default) and the multi-tensor one elsewhere.

    Args:
        params: the parameters to optimize (one group).
        lr: learning rate.
        betas: coefficients of the running average and of the infinity norm.
        eps: term added to the infinity norm.
        weight_decay: L2 penalty.
        foreach: use the multi-tensor kernel.
        maximize: maximize the objective instead of minimizing.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: for an invalid hyperparameter or an empty ``params`` (torch's messages).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults = adam_defaults(lr, betas, eps, weight_decay)
        self.foreach = foreach
        self.maximize = maximize
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self._impl = pick_impl(params, foreach, False, False)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdamax)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        params_with_grad, grads, buffers, steps = gather(
            self.state, params, gradients, ["exp_avg", "exp_inf"], [0.0, 0.0], True, False
        )
        d = self.defaults
        with torch.no_grad():
            adamax_impl(
                params_with_grad,
                grads,
                buffers[0],
                buffers[1],
                steps,
                d["eps"],
                d["beta1"],
                d["beta2"],
                d["lr"],
                d["weight_decay"],
                self.maximize,
                self._impl,
            )
