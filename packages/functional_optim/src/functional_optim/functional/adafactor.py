"""FunctionalAdafactor: a TorchScript-compilable Adafactor over explicit gradients (torch has
no ``_FunctionalAdafactor``; this follows the pattern of its eight with
``torch.optim.Adafactor``'s arguments, defaults, messages and state)."""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._local_shards import refuse_sharded
from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import (
    check_lengths,
    make_param_group,
    new_step,
    pick_impl,
)
from functional_optim.kernels.adafactor import adafactor_impl


def _new_state(param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
    """torch's initial Adafactor state: ``step`` and factored or full second moments."""
    entry: Dict[str, Tensor] = {"step": new_step(param, False)}
    if grad.dim() > 1:
        row_shape = list(grad.shape)
        row_shape[-1] = 1
        entry["row_var"] = grad.new_zeros(row_shape)
        col_shape = list(grad.shape)
        col_shape[-2] = 1
        entry["col_var"] = grad.new_zeros(col_shape)
    else:
        entry["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    return entry


class FunctionalAdafactor:
    """Adafactor over explicit gradients (``torch.optim.Adafactor``'s arguments and state).

    The default is the per-tensor kernel on CPU (bitwise equal to
    ``torch.optim.Adafactor(foreach=False)``) and the multi-tensor one elsewhere.

    Args:
        params: the parameters to optimize (one group; real, non-empty tensors).
        lr: caps the relative step size.
        beta2_decay: exponent of the second-moment decay (<= 0).
        eps: ``(eps1, eps2)``: second-moment floor (None: machine epsilon) and RMS floor.
        d: clipping threshold of the update's RMS (>= 1).
        weight_decay: decoupled weight decay.
        foreach: use the multi-tensor kernel.
        maximize: maximize the objective instead of minimizing.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: for an invalid hyperparameter or an empty ``params`` (torch's messages).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        beta2_decay: float = -0.8,
        eps: Tuple[Optional[float], float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        eps1, eps2 = eps
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not beta2_decay <= 0.0:
            raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps1 is not None and not eps1 >= 0.0:
            raise ValueError(f"epsilon1 should be >= 0 but is: {eps1}")
        if not eps2 >= 0.0:
            raise ValueError(f"epsilon2 should be >= 0 but is: {eps2}")
        if not d >= 1.0:
            raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "beta2_decay": beta2_decay,
            "d": d,
            "weight_decay": weight_decay,
            "eps2": eps2,
        }
        self.eps1 = eps1
        self.foreach = foreach
        self.maximize = maximize
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)
        self._impl = pick_impl(params, foreach, False, False)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalAdafactor)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        if not torch.jit.is_scripting():  # type: ignore[attr-defined]
            refuse_sharded(params, "Adafactor")
        params_with_grad: List[Tensor] = []
        grads: List[Tensor] = []
        row_vars: List[Optional[Tensor]] = []
        col_vars: List[Optional[Tensor]] = []
        variances: List[Optional[Tensor]] = []
        steps: List[Tensor] = []
        for i in range(len(params)):
            grad = gradients[i]
            if grad is not None:
                param = params[i]
                entry = self.state.get(param)
                if entry is None:
                    entry = _new_state(param, grad)
                    self.state[param] = entry
                params_with_grad.append(param)
                grads.append(grad)
                row_vars.append(entry.get("row_var"))
                col_vars.append(entry.get("col_var"))
                variances.append(entry.get("variance"))
                steps.append(entry["step"])
        d = self.defaults
        with torch.no_grad():
            adafactor_impl(
                params_with_grad,
                grads,
                row_vars,
                col_vars,
                variances,
                steps,
                d["d"],
                d["lr"],
                d["beta2_decay"],
                d["weight_decay"],
                self.eps1,
                d["eps2"],
                self.maximize,
                self._impl,
            )
