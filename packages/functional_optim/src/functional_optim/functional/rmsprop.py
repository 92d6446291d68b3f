"""FunctionalRMSprop: a TorchScript-compilable RMSprop that takes gradients explicitly."""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, gather, make_param_group, pick_impl
from functional_optim.kernels import rmsprop


class FunctionalRMSprop:
    """RMSprop with explicit gradients: a drop-in for torch's ``_FunctionalRMSprop``.

    Same constructor, attributes (``defaults``, ``state``, ``param_group``, flags) and errors as
    torch's class, without its deprecation warning; scriptable with ``torch.jit.script``. State
    (``"step"``, ``"square_avg"``, plus ``"momentum_buffer"`` if ``momentum > 0`` and
    ``"grad_avg"`` if ``centered``) is created on a param's first gradient.

    ``foreach=True`` runs the multi-tensor path (bitwise equal to
    ``torch.optim.RMSprop(foreach=True)``); otherwise the fastest path for the device is used
    (the per-tensor loop on CPU, bitwise equal to ``foreach=False``).

    Args:
        params: the parameters to optimize.
        lr: learning rate.
        alpha: smoothing constant of the running averages.
        eps: term added to the denominator.
        weight_decay: L2 penalty.
        momentum: momentum factor.
        centered: normalize by the estimated variance of the gradient.
        foreach: use the multi-tensor path.
        maximize: maximize the objective instead of minimizing.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: if ``params`` is empty and ``_allow_empty_param_list`` is False.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "alpha": alpha,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
        }
        self.centered = centered
        self.foreach = foreach
        self.maximize = maximize
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        # Resolved once: the params are fixed, and the loop on CPU / foreach elsewhere is fastest.
        self._impl = pick_impl(params, foreach, False, False)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalRMSprop)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one RMSprop step with the given gradients (None skips a param).

        Args:
            gradients: one gradient or None per param, in ``param_group["params"]`` order.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        momentum = self.defaults["momentum"]
        # torch's key order: square_avg, momentum_buffer (momentum > 0), grad_avg (centered).
        keys = ["square_avg"]
        if momentum > 0:
            keys.append("momentum_buffer")
        if self.centered:
            keys.append("grad_avg")
        with_grad, grads, buffers, steps = gather(
            self.state, params, gradients, keys, [0.0 for _ in keys], True, False
        )
        empty: List[Tensor] = []
        momentum_buffers = buffers[1] if momentum > 0 else empty
        grad_avgs = buffers[len(keys) - 1] if self.centered else empty
        with torch.no_grad():
            rmsprop(
                with_grad,
                grads,
                buffers[0],
                grad_avgs,
                momentum_buffers,
                steps,
                self.defaults["lr"],
                self.defaults["alpha"],
                self.defaults["eps"],
                self.defaults["weight_decay"],
                momentum,
                self.centered,
                self.maximize,
                self._impl,
            )
