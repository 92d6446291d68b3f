"""FunctionalAdam: a TorchScript-compilable Adam that takes gradients explicitly.

Drop-in for ``torch.distributed.optim._FunctionalAdam`` (same constructor, attributes, state
keys and messages) without its deprecation warning. The module-level helpers
(``adam_defaults``, ``adam_step``, ``adam_step_param``) are shared with
:class:`functional_optim.functional.adamw.FunctionalAdamW`, which is Adam with decoupled weight
decay, and (``adam_defaults``) with ``FunctionalAdamax``: TorchScript classes cannot inherit.
"""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import (
    check_lengths,
    ensure_state,
    gather,
    make_param_group,
    pick_impl,
)
from functional_optim.kernels.adam import adam_impl


def check_adam_args(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise torch's ``ValueError`` for an invalid Adam/AdamW/Adamax hyperparameter."""
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def adam_defaults(
    lr: float, betas: Tuple[float, float], eps: float, weight_decay: float
) -> Dict[str, float]:
    """Validate (see :func:`check_adam_args`) and return the ``defaults`` of Adam/AdamW/Adamax."""
    check_adam_args(lr, betas, eps, weight_decay)
    return {
        "lr": lr,
        "eps": eps,
        "beta1": betas[0],
        "beta2": betas[1],
        "weight_decay": weight_decay,
    }


def adam_keys(amsgrad: bool) -> List[str]:
    """State buffer names of Adam/AdamW, after ``"step"``."""
    if amsgrad:
        return ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    return ["exp_avg", "exp_avg_sq"]


def adam_update(
    state: Dict[Tensor, Dict[str, Tensor]],
    params: List[Tensor],
    gradients: List[Optional[Tensor]],
    defaults: Dict[str, float],
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    impl: str,
) -> None:
    """One Adam/AdamW step for the params that have a gradient (state created lazily)."""
    keys = adam_keys(amsgrad)
    fills = [0.0 for _ in keys]
    params_with_grad, grads, buffers, steps = gather(
        state, params, gradients, keys, fills, True, impl == "fused"
    )
    max_exp_avg_sqs = buffers[2] if amsgrad else []
    with torch.no_grad():
        adam_impl(
            params_with_grad,
            grads,
            buffers[0],
            buffers[1],
            max_exp_avg_sqs,
            steps,
            amsgrad,
            defaults["beta1"],
            defaults["beta2"],
            defaults["lr"],
            defaults["weight_decay"],
            defaults["eps"],
            maximize,
            decoupled,
            impl,
        )


def adam_step_param(
    state: Dict[Tensor, Dict[str, Tensor]],
    param: Tensor,
    grad: Optional[Tensor],
    defaults: Dict[str, float],
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    impl: str,
) -> None:
    """``step_param`` of Adam/AdamW: the state is created even if ``grad`` is None (torch)."""
    if grad is None:
        keys = adam_keys(amsgrad)
        ensure_state(state, param, keys, [0.0 for _ in keys], True, impl == "fused")
    gradients: List[Optional[Tensor]] = [grad]
    adam_update(state, [param], gradients, defaults, amsgrad, maximize, decoupled, impl)


def adam_step(
    state: Dict[Tensor, Dict[str, Tensor]],
    params: List[Tensor],
    gradients: List[Optional[Tensor]],
    defaults: Dict[str, float],
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    impl: str,
) -> None:
    """``step`` of Adam/AdamW: check the lengths, then update the params with a gradient."""
    check_lengths(params, gradients)
    adam_update(state, params, gradients, defaults, amsgrad, maximize, decoupled, impl)


class FunctionalAdam:
    """Adam over explicit gradients, like ``torch.distributed.optim._FunctionalAdam``.

    When neither ``foreach`` nor ``fused`` is set, the fastest kernel for the device is used
    (torch's fused kernel on CPU), which matches torch's default loop up to float rounding;
    ``foreach=True`` / ``fused=True`` match torch bitwise.

    Args:
        params: the parameters to optimize (one group).
        lr: learning rate.
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator.
        weight_decay: L2 penalty.
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
        weight_decay: float = 0.0,
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
        return prepare_class(FunctionalAdam)

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
            False,
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
            False,
            self._impl,
        )
