"""FunctionalAdagrad: a TorchScript-compilable Adagrad that takes gradients explicitly."""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import (
    check_lengths,
    ensure_state,
    gather,
    make_param_group,
)
from functional_optim.kernels import adagrad


class FunctionalAdagrad:
    """Adagrad with explicit gradients: a drop-in for torch's ``_FunctionalAdagrad``.

    Same constructor, attributes (``defaults``, ``state``, ``param_group``, flags) and errors as
    torch's class, without its deprecation warning; scriptable with ``torch.jit.script``. As in
    torch, the state (``"step"``, ``"sum"``) is created eagerly for every param.

    ``fused=True`` runs torch's fused kernel and ``foreach=True`` the multi-tensor one (results
    bitwise equal to ``torch.optim.Adagrad`` with the same flag); with neither flag the fastest
    path for the device is used (fused on CPU), equal to torch up to float rounding.
    ``warmup_lr_multiplier``, ``warmup_num_iters`` and ``coalesce_grad`` are stored only, as in
    torch.

    Differences from torch's class, both fixes: params whose gradient is None are skipped (torch
    pairs the remaining gradients with the wrong params), and the sums of complex params start
    at ``complex(v, v)`` like ``torch.optim.Adagrad`` (torch's functional class uses ``v + 0j``).

    Args:
        params: the parameters to optimize.
        lr: learning rate.
        lr_decay: learning-rate decay.
        weight_decay: L2 penalty.
        initial_accumulator_value: initial value of the sums of squared gradients.
        warmup_lr_multiplier: stored in ``defaults`` (unused, as in torch).
        warmup_num_iters: stored in ``defaults`` (unused, as in torch).
        eps: term added to the denominator.
        coalesce_grad: stored (sparse gradients are always coalesced, as in torch).
        foreach: use the multi-tensor path.
        fused: use the fused path (takes precedence over ``foreach``).
        maximize: maximize the objective instead of minimizing.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: if ``params`` is empty and ``_allow_empty_param_list`` is False.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        warmup_lr_multiplier: float = 1.0,
        warmup_num_iters: float = 0.0,
        eps: float = 1e-10,
        coalesce_grad: bool = True,
        foreach: bool = False,
        fused: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "lr_decay": lr_decay,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "warmup_lr_multiplier": warmup_lr_multiplier,
            "warmup_num_iters": warmup_num_iters,
        }
        self.coalesce_grad = coalesce_grad
        self.foreach = foreach
        self.fused = fused
        self.maximize = maximize
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self._impl = "fused" if fused else ("foreach" if foreach else "auto")
        # "auto" may pick the fused kernel, which wants float32 steps on the params' device.
        self._fused_steps = fused or not foreach
        for p in params:
            entry = ensure_state(
                self.state, p, ["sum"], [initial_accumulator_value], True, self._fused_steps
            )
            if torch.is_complex(p):
                torch.view_as_real(entry["sum"]).fill_(initial_accumulator_value)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdagrad)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one Adagrad step with the given gradients (None skips a param).

        Args:
            gradients: one gradient or None per param, in ``param_group["params"]`` order.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        initial = self.defaults["initial_accumulator_value"]
        with_grad, grads, buffers, steps = gather(
            self.state, params, gradients, ["sum"], [initial], True, self._fused_steps
        )
        with torch.no_grad():
            adagrad(
                with_grad,
                grads,
                buffers[0],
                steps,
                self.defaults["lr"],
                self.defaults["weight_decay"],
                self.defaults["lr_decay"],
                self.defaults["eps"],
                self.maximize,
                self._impl,
            )
