"""FunctionalAdadelta: a TorchScript-compilable Adadelta that takes gradients explicitly."""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, gather, make_param_group, pick_impl
from functional_optim.kernels import adadelta


class FunctionalAdadelta:
    """Adadelta with explicit gradients: a drop-in for torch's ``_FunctionalAdadelta``.

    Same constructor, attributes (``defaults``, ``state``, ``param_group``, flags) and errors as
    torch's class, without its deprecation warning; scriptable with ``torch.jit.script``. State
    (``"step"``, ``"square_avg"``, ``"acc_delta"``) is created on a param's first gradient.

    ``foreach=True`` runs the multi-tensor path (bitwise equal to
    ``torch.optim.Adadelta(foreach=True)``); otherwise the fastest path for the device is used
    (the per-tensor loop on CPU, bitwise equal to ``foreach=False``).

    Args:
        params: the parameters to optimize.
        lr: coefficient that scales the update.
        rho: decay of the running averages.
        eps: term added inside the square roots.
        weight_decay: L2 penalty.
        foreach: use the multi-tensor path.
        maximize: maximize the objective instead of minimizing.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: if ``params`` is empty and ``_allow_empty_param_list`` is False.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "rho": rho,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        self.foreach = foreach
        self.maximize = maximize
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        # Resolved once: the params are fixed, and the loop on CPU / foreach elsewhere is fastest.
        self._impl = pick_impl(params, foreach, False, False)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdadelta)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one Adadelta step with the given gradients (None skips a param).

        Args:
            gradients: one gradient or None per param, in ``param_group["params"]`` order.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        with_grad, grads, buffers, steps = gather(
            self.state, params, gradients, ["square_avg", "acc_delta"], [0.0, 0.0], True, False
        )
        with torch.no_grad():
            adadelta(
                with_grad,
                grads,
                buffers[0],
                buffers[1],
                steps,
                self.defaults["lr"],
                self.defaults["rho"],
                self.defaults["eps"],
                self.defaults["weight_decay"],
                self.maximize,
                self._impl,
            )
