"""FunctionalAdamW: a TorchScript-compilable AdamW that takes gradients explicitly.

Drop-in for ``torch.distributed.optim._FunctionalAdamW`` without its deprecation warning. It
shares validation, state set-up and the update with
:class:`functional_optim.functional.adam.FunctionalAdam` (``decoupled=True``).
"""

from typing import Dict, List, Optional, Tuple

from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, check_not_empty, ensure_state
from functional_optim.functional.adam import adam_keys, adam_update, check_adam_args, pick_impl


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
        check_adam_args(lr, betas, eps, weight_decay)
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "eps": eps,
            "beta1": betas[0],
            "beta2": betas[1],
            "weight_decay": weight_decay,
        }
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        check_not_empty(params, _allow_empty_param_list)
        self.param_group: Dict[str, List[Tensor]] = {"params": params}
        self._impl = pick_impl(params, foreach, fused, True)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdamW)

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Update one parameter with its gradient (state is created even if ``grad`` is None,
        as in torch)."""
        if grad is None:
            keys = adam_keys(self.amsgrad)
            ensure_state(self.state, param, keys, [0.0 for _ in keys], True, self._impl == "fused")
        gradients: List[Optional[Tensor]] = [grad]
        adam_update(
            self.state,
            [param],
            gradients,
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
        params = self.param_group["params"]
        check_lengths(params, gradients)
        adam_update(
            self.state,
            params,
            gradients,
            self.defaults,
            self.amsgrad,
            self.maximize,
            True,
            self._impl,
        )
