"""FunctionalRprop: a TorchScript-compilable Rprop that takes gradients explicitly."""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, gather, make_param_group, pick_impl
from functional_optim.kernels import rprop


class FunctionalRprop:
    """Rprop with explicit gradients: a drop-in for torch's ``_FunctionalRprop``.

    Same constructor, attributes (``defaults``, ``state``, ``param_group``, ``etas``,
    ``step_sizes``, flags) and errors as torch's class, without its deprecation warning;
    scriptable with ``torch.jit.script``. State (``"step"``, ``"prev"``, ``"step_size"`` filled
    with ``lr``) is created on a param's first gradient.

    ``foreach=True`` runs the multi-tensor path (bitwise equal to
    ``torch.optim.Rprop(foreach=True)``); otherwise the fastest path for the device is used (the
    per-tensor loop on CPU, bitwise equal to ``foreach=False``). The step sizes of complex
    params start at ``complex(lr, lr)`` like ``torch.optim.Rprop`` (torch's functional class
    uses ``lr + 0j``, which freezes the imaginary parts).

    Args:
        params: the parameters to optimize.
        lr: initial step size.
        etas: ``(etaminus, etaplus)``, the multiplicative decrease and increase factors.
        step_sizes: ``(min, max)`` bounds of the step sizes.
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
        etas: Tuple[float, float] = (0.5, 1.2),
        step_sizes: Tuple[float, float] = (1e-6, 50),
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        self.defaults: Dict[str, float] = {"lr": lr}
        self.etas = etas
        self.step_sizes = step_sizes
        self.foreach = foreach
        self.maximize = maximize
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        # Resolved once: the params are fixed, and the loop on CPU / foreach elsewhere is fastest.
        self._impl = pick_impl(params, foreach, False, False)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalRprop)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one Rprop step with the given gradients (None skips a param).

        Args:
            gradients: one gradient or None per param, in ``param_group["params"]`` order.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        lr = self.defaults["lr"]
        # New state of complex params: the step size is lr for the real and imaginary parts.
        new_complex: List[Tensor] = []
        for i in range(len(params)):
            p = params[i]
            if gradients[i] is not None and torch.is_complex(p) and p not in self.state:
                new_complex.append(p)
        with_grad, grads, buffers, steps = gather(
            self.state, params, gradients, ["prev", "step_size"], [0.0, lr], True, False
        )
        for p in new_complex:
            torch.view_as_real(self.state[p]["step_size"]).fill_(lr)
        etaminus, etaplus = self.etas
        step_size_min, step_size_max = self.step_sizes
        with torch.no_grad():
            rprop(
                with_grad,
                grads,
                buffers[0],
                buffers[1],
                steps,
                step_size_min,
                step_size_max,
                etaminus,
                etaplus,
                self.maximize,
                self._impl,
            )
