"""FunctionalAdamW: a TorchScript-compilable AdamW that takes gradients explicitly.

Drop-in for ``torch.distributed.optim._FunctionalAdamW`` without its deprecation warning. It
shares validation, state set-up and the update with
:class:`functional_optim.functional.adam.FunctionalAdam` (``decoupled=True``), as torch 2.13
implements AdamW as Adam with decoupled weight decay.
"""

from typing import Dict, List, Optional, Tuple

from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import make_param_group, pick_impl
from functional_optim.functional.adam import adam_defaults, adam_step, adam_step_param


class FunctionalAdamW:
    """AdamW over explicit gradients, like ``torch.distributed.optim._FunctionalAdamW``.

    When neither ``foreach`` nor ``fused`` is set, the fastest kernel for the device is used
    (torch's fused kernel on CPU), which matches torch's default loop up to float rounding;
    ``foreach=True`` / ``fused=True`` match torch bitwise.

    Args:
        params: the parameters to optimize (one group).
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        weight_decay: decoupled weight decay coefficient.
        amsgrad: use the AMSGrad variant.
        maximize: maximize the objective instead of minimizing.
        foreach: use the multi-tensor kernel.
        fused: use torch's fused kernel.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: for an invalid hyperparameter or an empty ``params`` (torch's messages).
        RuntimeError: if ``fused=True`` and a param cannot use the fused kernel.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults = adam_defaults(lr, betas, eps, weight_decay)
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self._impl = pick_impl(params, foreach, fused, True)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdamW)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (state is created even if ``grad`` is None,
        as in torch)."""
        adam_step_param(
            self.state,
            param,
            grad,
            self.defaults,
            self.amsgrad,
            self.maximize,
            True,
            self._impl,
        )

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        adam_step(
            self.state,
            self.param_group["params"],
            gradients,
            self.defaults,
            self.amsgrad,
            self.maximize,
            True,
            self._impl,
        )
